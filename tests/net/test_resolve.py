"""Tests for egressbox.net.resolve against a real DNS server on loopback (tests/dnsserver.py).

All traffic stays on loopback: explicit nameservers point at the test server,
and the system-configuration tests use a temporary resolv.conf whose server is
the test server (the DNS port is patched to the server's ephemeral port).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path

import dns.message
import dns.query
import dns.rcode
import pytest

from dnsserver import (
    AAAA,
    CNAME,
    NXDOMAIN,
    REFUSED,
    SERVFAIL,
    SILENT,
    A,
    Behaviour,
    DnsServer,
    Query,
)
from egressbox.core.errors import Reason, ResolveError
from egressbox.net import resolve
from egressbox.net.resolve import DnsResolver, Resolution, parse_hosts, parse_nameserver

pytestmark = pytest.mark.timeout(30)

# Generous for a server on loopback that answers at once.
TIMEOUT = 3.0
# For tests that wait for a timeout on purpose.
SHORT = 0.5
# An upper bound on "about the timeout" that a loaded CI machine still meets.
SLACK = 5.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def explicit(
    server: DnsServer,
    *,
    timeout: float = TIMEOUT,
    cache_size: int = resolve.CACHE_SIZE,
    max_ttl: float = resolve.MAX_CACHE_TTL,
    clock: Callable[[], float] = time.monotonic,
) -> DnsResolver:
    """A resolver that asks only `server`."""
    return DnsResolver(
        [server.nameserver], timeout=timeout, cache_size=cache_size, max_ttl=max_ttl, clock=clock
    )


async def failure(resolver: DnsResolver, host: str) -> ResolveError:
    with pytest.raises(ResolveError) as info:
        await resolver.resolve(host)
    return info.value


def v4(text: str) -> IPv4Address:
    return IPv4Address(text)


def v6(text: str) -> IPv6Address:
    return IPv6Address(text)


# ----------------------------------------------------------------------------
# Answers


async def test_a_only(dns_server: DnsServer) -> None:
    dns_server.set("a.test", A("192.0.2.1"))
    answer = await explicit(dns_server).resolve("a.test")
    assert answer == Resolution((v4("192.0.2.1"),), ("a.test",), 300.0, "dns")
    assert sorted(dns_server.queries, key=lambda q: q.rtype) == [
        Query("a.test", "A", "udp"),
        Query("a.test", "AAAA", "udp"),
    ]


async def test_aaaa_only(dns_server: DnsServer) -> None:
    dns_server.set("six.test", AAAA("2001:db8::6"))
    answer = await explicit(dns_server).resolve("six.test")
    assert answer.addresses == (v6("2001:db8::6"),)
    assert answer.source == "dns"


async def test_both_types_a_first(dns_server: DnsServer) -> None:
    dns_server.set(
        "both.test", AAAA("2001:db8::1"), A("192.0.2.1"), A("192.0.2.2"), AAAA("2001:db8::2")
    )
    answer = await explicit(dns_server).resolve("both.test")
    assert answer.addresses[:2] in [
        (v4("192.0.2.1"), v4("192.0.2.2")),
        (v4("192.0.2.2"), v4("192.0.2.1")),
    ]
    assert set(answer.addresses[2:]) == {v6("2001:db8::1"), v6("2001:db8::2")}


async def test_cname_chain_reported_in_order_and_lowercase(dns_server: DnsServer) -> None:
    dns_server.set("www.test", CNAME("Edge.CDN.test.", ttl=200))
    dns_server.set("edge.cdn.test", CNAME("host.cdn.test", ttl=100))
    dns_server.set("host.cdn.test", A("192.0.2.9", ttl=150), AAAA("2001:db8::9", ttl=400))
    answer = await explicit(dns_server).resolve("www.test")
    assert answer.names == ("www.test", "edge.cdn.test", "host.cdn.test")
    assert answer.addresses == (v4("192.0.2.9"), v6("2001:db8::9"))
    assert answer.ttl == 100.0  # the smallest TTL along either chain


async def test_negative_ttl_of_absent_type_bounds_the_ttl() -> None:
    with DnsServer({"a.test": [A("192.0.2.1", ttl=300)]}, negative_ttl=30) as server:
        answer = await explicit(server).resolve("a.test")
    assert answer.ttl == 30.0


async def test_large_answer_truncated_over_udp_retried_over_tcp(dns_server: DnsServer) -> None:
    records = [A(f"192.0.2.{i}") for i in range(1, 61)]  # > 512 bytes
    dns_server.set("big.test", *records)
    answer = await explicit(dns_server).resolve("big.test")
    assert len(answer.addresses) == 60
    assert Query("big.test", "A", "tcp") in dns_server.queries


async def test_forced_truncation_retried_over_tcp(dns_server: DnsServer) -> None:
    dns_server.set("tc.test", A("192.0.2.3"), truncate=True)
    answer = await explicit(dns_server).resolve("tc.test")
    assert answer.addresses == (v4("192.0.2.3"),)
    transports = {(q.rtype, q.transport) for q in dns_server.queries}
    assert transports == {("A", "udp"), ("A", "tcp"), ("AAAA", "udp"), ("AAAA", "tcp")}


async def test_several_nameservers_next_one_used_after_servfail() -> None:
    with DnsServer() as broken, DnsServer() as good:
        broken.set_behaviour("a.test", SERVFAIL)
        good.set("a.test", A("192.0.2.5"))
        resolver = DnsResolver([broken.nameserver, good.nameserver], timeout=TIMEOUT)
        answer = await resolver.resolve("a.test")
    assert answer.addresses == (v4("192.0.2.5"),)


async def test_ipv6_nameserver() -> None:
    try:
        server = DnsServer(host="::1").start()
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with server:
        server.set("a.test", A("192.0.2.1"))
        assert server.address == f"[::1]:{server.port}"
        assert parse_nameserver(server.address) == ("::1", server.port)
        answer = await explicit(server).resolve("a.test")
    assert answer.addresses == (v4("192.0.2.1"),)


# ----------------------------------------------------------------------------
# Failures


async def test_nxdomain_is_dns_failure(dns_server: DnsServer) -> None:
    error = await failure(explicit(dns_server), "missing.test")
    assert error.reason is Reason.DNS_FAILURE
    assert "missing.test does not exist (NXDOMAIN" in str(error)
    assert dns_server.address in str(error)


async def test_no_address_records_is_dns_failure(dns_server: DnsServer) -> None:
    dns_server.set("empty.test")
    error = await failure(explicit(dns_server), "empty.test")
    assert error.reason is Reason.DNS_FAILURE
    assert str(error) == "no A or AAAA record for empty.test"


async def test_cname_to_nothing_names_the_alias(dns_server: DnsServer) -> None:
    dns_server.set("alias.test", CNAME("target.test"))
    dns_server.set("target.test")
    error = await failure(explicit(dns_server), "alias.test")
    assert str(error) == "no A or AAAA record for alias.test (alias of target.test)"


@pytest.mark.parametrize(("behaviour", "word"), [(SERVFAIL, "SERVFAIL"), (REFUSED, "REFUSED")])
async def test_server_errors_are_dns_failure(
    dns_server: DnsServer, behaviour: Behaviour, word: str
) -> None:
    dns_server.set_behaviour("bad.test", behaviour)
    error = await failure(explicit(dns_server), "bad.test")
    assert error.reason is Reason.DNS_FAILURE
    assert f"{dns_server.address} answered {word}" in str(error)


async def test_silence_is_dns_timeout_within_about_the_timeout(dns_server: DnsServer) -> None:
    dns_server.set_behaviour("slow.test", SILENT)
    start = time.monotonic()
    error = await failure(explicit(dns_server, timeout=SHORT), "slow.test")
    elapsed = time.monotonic() - start
    assert error.reason is Reason.DNS_TIMEOUT
    assert (
        str(error) == f"DNS server {dns_server.address} did not answer within 0.5 s for slow.test"
    )
    assert elapsed < SHORT + SLACK
    assert dns_server.queries_for("slow.test")  # it was asked, and said nothing


async def test_timeout_beyond_dnspython_retries_still_bounded(dns_server: DnsServer) -> None:
    # Longer than dnspython's 2 s per try, so its retries and back-off run.
    dns_server.set_behaviour("slow.test", SILENT)
    start = time.monotonic()
    error = await failure(explicit(dns_server, timeout=2.25), "slow.test")
    assert error.reason is Reason.DNS_TIMEOUT
    assert "within 2.25 s" in str(error)
    assert time.monotonic() - start < 2.25 + SLACK


async def test_one_type_silent_other_type_still_answers(dns_server: DnsServer) -> None:
    # A middlebox that drops AAAA queries must not make the name unusable.
    dns_server.set("v4.test", A("192.0.2.1"))
    dns_server.set_behaviour("v4.test", SILENT, only=["AAAA"])
    answer = await explicit(dns_server, timeout=SHORT).resolve("v4.test")
    assert answer.addresses == (v4("192.0.2.1"),)


async def test_one_type_servfail_other_type_still_answers(dns_server: DnsServer) -> None:
    dns_server.set("v6.test", AAAA("2001:db8::1"))
    dns_server.set_behaviour("v6.test", SERVFAIL, only=["A"])
    answer = await explicit(dns_server).resolve("v6.test")
    assert answer.addresses == (v6("2001:db8::1"),)


async def test_failures_are_not_cached(dns_server: DnsServer) -> None:
    resolver = explicit(dns_server)
    await failure(resolver, "later.test")
    dns_server.set("later.test", A("192.0.2.4"))
    answer = await resolver.resolve("later.test")
    assert answer.addresses == (v4("192.0.2.4"),)


async def test_name_dns_cannot_carry_fails_without_a_query(dns_server: DnsServer) -> None:
    error = await failure(explicit(dns_server), "a" * 64 + ".test")
    assert error.reason is Reason.DNS_FAILURE
    assert dns_server.queries == []


# ----------------------------------------------------------------------------
# Cache


async def test_changing_answers_with_ttl_zero_seen_fresh(dns_server: DnsServer) -> None:
    # The DNS-rebinding shape: a public address first, then loopback.
    dns_server.set_sequence("rebind.test", [[A("93.184.216.34", ttl=0)], [A("127.0.0.1", ttl=0)]])
    resolver = explicit(dns_server)
    first = await resolver.resolve("rebind.test")
    second = await resolver.resolve("rebind.test")
    assert first.addresses == (v4("93.184.216.34"),)
    assert second.addresses == (v4("127.0.0.1"),)
    assert (first.source, second.source) == ("dns", "dns")
    assert first.ttl == 0.0


async def test_positive_ttl_is_cached(dns_server: DnsServer) -> None:
    dns_server.set("a.test", A("192.0.2.1", ttl=120))
    clock = FakeClock()
    resolver = explicit(dns_server, clock=clock)
    await resolver.resolve("a.test")
    dns_server.clear_queries()
    clock.advance(20)
    cached = await resolver.resolve("a.test")
    assert dns_server.queries == []
    assert cached.source == "cache"
    assert cached.addresses == (v4("192.0.2.1"),)
    assert cached.ttl == 100.0  # what is left of it


async def test_cache_expires_with_the_clock(dns_server: DnsServer) -> None:
    dns_server.set("a.test", A("192.0.2.1", ttl=60))
    clock = FakeClock()
    resolver = explicit(dns_server, clock=clock)
    await resolver.resolve("a.test")
    clock.advance(59)
    assert (await resolver.resolve("a.test")).source == "cache"
    clock.advance(2)
    dns_server.clear_queries()
    assert (await resolver.resolve("a.test")).source == "dns"
    assert len(dns_server.queries) == 2


async def test_max_ttl_caps_a_long_ttl(dns_server: DnsServer) -> None:
    dns_server.set("a.test", A("192.0.2.1", ttl=86400))
    clock = FakeClock()
    resolver = explicit(dns_server, clock=clock, max_ttl=10.0)
    await resolver.resolve("a.test")
    clock.advance(9)
    assert (await resolver.resolve("a.test")).ttl == 1.0
    clock.advance(2)
    assert (await resolver.resolve("a.test")).source == "dns"


async def test_cache_is_lru_bounded(dns_server: DnsServer) -> None:
    for name in ("a.test", "b.test", "c.test"):
        dns_server.set(name, A("192.0.2.1"))
    resolver = explicit(dns_server, cache_size=2)
    await resolver.resolve("a.test")
    await resolver.resolve("b.test")
    await resolver.resolve("a.test")  # a is now the most recently used
    await resolver.resolve("c.test")  # evicts b, the least recently used
    assert (await resolver.resolve("a.test")).source == "cache"
    assert (await resolver.resolve("b.test")).source == "dns"


async def test_cache_size_zero_disables_the_cache(dns_server: DnsServer) -> None:
    dns_server.set("a.test", A("192.0.2.1"))
    resolver = explicit(dns_server, cache_size=0)
    await resolver.resolve("a.test")
    assert (await resolver.resolve("a.test")).source == "dns"


async def test_clear_cache(dns_server: DnsServer) -> None:
    dns_server.set("a.test", A("192.0.2.1"))
    resolver = explicit(dns_server)
    await resolver.resolve("a.test")
    resolver.clear_cache()
    assert (await resolver.resolve("a.test")).source == "dns"


async def test_concurrent_lookups_share_one_query(dns_server: DnsServer) -> None:
    dns_server.set("a.test", A("192.0.2.1"))
    resolver = explicit(dns_server, cache_size=0)
    answers = await asyncio.gather(*(resolver.resolve("a.test") for _ in range(5)))
    assert {a.addresses for a in answers} == {(v4("192.0.2.1"),)}
    assert len(dns_server.queries) == 2  # one A, one AAAA


async def test_cancelled_waiter_does_not_cancel_the_others(dns_server: DnsServer) -> None:
    dns_server.set_behaviour("slow.test", SILENT)
    resolver = explicit(dns_server, timeout=SHORT)
    first = asyncio.create_task(resolver.resolve("slow.test"))
    second = asyncio.create_task(resolver.resolve("slow.test"))
    await asyncio.sleep(0.05)
    first.cancel()
    with pytest.raises(ResolveError) as info:
        await second
    assert info.value.reason is Reason.DNS_TIMEOUT
    assert first.cancelled()


# ----------------------------------------------------------------------------
# Hosts file and the system configuration


@pytest.fixture
def hosts_file(tmp_path: Path) -> Path:
    path = tmp_path / "hosts"
    path.write_text(
        "# a comment line\n"
        "192.0.2.10   Pinned.Test. alias.test  # trailing comment\n"
        "2001:db8::10 pinned.test\n"
        "not-an-ip    broken.test\n"
        "192.0.2.300  broken.test\n"
        "192.0.2.11\n"
    )
    return path


@pytest.fixture
def resolv_conf(tmp_path: Path, dns_server: DnsServer, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A resolv.conf naming the test server, with a search list that must be ignored."""
    path = tmp_path / "resolv.conf"
    path.write_text("nameserver 127.0.0.1\nsearch example.com\noptions ndots:5\n")
    monkeypatch.setattr(resolve, "DNS_PORT", dns_server.port)
    return path


def system(
    hosts: Path | None, conf: Path, *, clock: Callable[[], float] = time.monotonic
) -> DnsResolver:
    """A resolver without nameservers: the hosts file, then the servers in `conf`."""
    hosts_path = str(hosts) if hosts is not None else None
    return DnsResolver(hosts_path=hosts_path, resolv_conf=str(conf), timeout=TIMEOUT, clock=clock)


async def test_hosts_file_answers_without_any_query(
    hosts_file: Path, resolv_conf: Path, dns_server: DnsServer
) -> None:
    dns_server.set("pinned.test", A("198.51.100.1"))
    answer = await system(hosts_file, resolv_conf).resolve("pinned.test")
    assert answer == Resolution(
        (v4("192.0.2.10"), v6("2001:db8::10")), ("pinned.test",), 0.0, "hosts"
    )
    assert (await system(hosts_file, resolv_conf).resolve("alias.test")).source == "hosts"
    assert dns_server.queries == []


async def test_hosts_miss_asks_system_servers_without_search_domains(
    hosts_file: Path, resolv_conf: Path, dns_server: DnsServer
) -> None:
    dns_server.set("plain", A("198.51.100.2"))
    dns_server.set("plain.example.com", A("198.51.100.3"))
    answer = await system(hosts_file, resolv_conf).resolve("plain")
    assert answer.addresses == (v4("198.51.100.2"),)
    assert answer.source == "dns"
    assert {q.name for q in dns_server.queries} == {"plain"}


async def test_malformed_hosts_lines_ignored(
    hosts_file: Path, resolv_conf: Path, dns_server: DnsServer
) -> None:
    resolver = system(hosts_file, resolv_conf)
    error = await failure(resolver, "broken.test")
    assert error.reason is Reason.DNS_FAILURE
    assert dns_server.queries_for("broken.test")  # not in the file, so DNS was asked


async def test_explicit_nameservers_ignore_the_hosts_file(
    hosts_file: Path, dns_server: DnsServer
) -> None:
    dns_server.set("pinned.test", A("198.51.100.1"))
    resolver = DnsResolver([dns_server.nameserver], hosts_path=str(hosts_file), timeout=TIMEOUT)
    answer = await resolver.resolve("pinned.test")
    assert answer.addresses == (v4("198.51.100.1"),)
    assert answer.source == "dns"


async def test_explicit_nameservers_no_fallback_on_nxdomain(
    hosts_file: Path, resolv_conf: Path, dns_server: DnsServer
) -> None:
    # The resolv.conf fixture points the "system" at a second server that
    # knows the name: an explicit server's NXDOMAIN must still be final.
    with DnsServer() as only:
        dns_server.set("known.test", A("198.51.100.1"))
        resolver = DnsResolver(
            [only.nameserver],
            hosts_path=str(hosts_file),
            resolv_conf=str(resolv_conf),
            timeout=TIMEOUT,
        )
        error = await failure(resolver, "pinned.test")
        assert "NXDOMAIN" in str(error)
        assert (await failure(resolver, "known.test")).reason is Reason.DNS_FAILURE
    assert dns_server.queries == []


async def test_hosts_file_reread_when_it_changes(
    hosts_file: Path, resolv_conf: Path, dns_server: DnsServer
) -> None:
    clock = FakeClock()
    resolver = system(hosts_file, resolv_conf, clock=clock)
    assert (await resolver.resolve("alias.test")).addresses == (v4("192.0.2.10"),)
    before = hosts_file.stat().st_mtime_ns
    hosts_file.write_text("192.0.2.99 alias.test\n")
    os.utime(hosts_file, ns=(before + 10**9, before + 10**9))
    # Checked at most once a second, by the resolver's clock.
    assert (await resolver.resolve("alias.test")).addresses == (v4("192.0.2.10"),)
    clock.advance(1.0)
    assert (await resolver.resolve("alias.test")).addresses == (v4("192.0.2.99"),)


async def test_missing_hosts_file_falls_through_to_dns(
    tmp_path: Path, resolv_conf: Path, dns_server: DnsServer
) -> None:
    dns_server.set("localhost", A("198.51.100.7"))
    resolver = system(tmp_path / "no-such-hosts", resolv_conf)
    assert (await resolver.resolve("localhost")).source == "dns"


async def test_no_hosts_file_at_all(resolv_conf: Path, dns_server: DnsServer) -> None:
    dns_server.set("a.test", A("198.51.100.8"))
    assert (await system(None, resolv_conf).resolve("a.test")).source == "dns"


async def test_system_without_nameservers_is_a_clear_failure(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("# nothing here\nsearch example.com\n")
    resolver = DnsResolver(hosts_path=None, resolv_conf=str(conf), timeout=TIMEOUT)
    error = await failure(resolver, "a.test")
    assert error.reason is Reason.DNS_FAILURE
    assert "no usable DNS server in the system configuration" in str(error)
    assert str(conf) in str(error)


async def test_system_timeout_message_names_the_servers(
    resolv_conf: Path, dns_server: DnsServer
) -> None:
    dns_server.set_behaviour("slow.test", SILENT)
    resolver = DnsResolver(hosts_path=None, resolv_conf=str(resolv_conf), timeout=SHORT)
    error = await failure(resolver, "slow.test")
    assert error.reason is Reason.DNS_TIMEOUT
    assert f"DNS server {dns_server.address} (from {resolv_conf})" in str(error)


def test_parse_hosts() -> None:
    table = parse_hosts(
        "127.0.0.1 localhost\n"
        "::1 localhost ip6-localhost\n"
        "192.0.2.1 Mixed.Case.TEST. # comment\n"
        "  192.0.2.2\tmixed.case.test\n"
        "192.0.2.1 mixed.case.test\n"  # a repeat adds nothing
        "fe80::1%eth0 scoped.test\n"
        "0127.0.0.1 octal.test\n"
        "garbage\n"
        "#192.0.2.3 commented.test\n"
    )
    assert table == {
        "localhost": (ip_address("127.0.0.1"), ip_address("::1")),
        "ip6-localhost": (ip_address("::1"),),
        "mixed.case.test": (ip_address("192.0.2.1"), ip_address("192.0.2.2")),
    }


# ----------------------------------------------------------------------------
# Configuration


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1", ("127.0.0.1", 53)),
        ("127.0.0.1:5353", ("127.0.0.1", 5353)),
        (" 10.0.0.1:1 ", ("10.0.0.1", 1)),
        ("192.0.2.1:65535", ("192.0.2.1", 65535)),
        ("::1", ("::1", 53)),
        ("2001:DB8:0::1", ("2001:db8::1", 53)),
        ("[::1]", ("::1", 53)),
        ("[2001:db8::1]:5353", ("2001:db8::1", 5353)),
        ("[::ffff:192.0.2.1]:53", ("::ffff:c000:201", 53)),
    ],
)
def test_parse_nameserver(text: str, expected: tuple[str, int]) -> None:
    assert parse_nameserver(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "the address is missing"),
        ("localhost", "names are not accepted"),
        ("dns.google:53", "names are not accepted"),
        ("127.0.0.1:0", "port '0' is not 1-65535"),
        ("127.0.0.1:65536", "port '65536' is not 1-65535"),
        ("127.0.0.1:", "port '' is not 1-65535"),
        ("127.0.0.1:+53", "is not 1-65535"),
        ("127.0.0.1:5 3", "is not 1-65535"),
        ("127.1", "is not an IP address"),
        ("0177.0.0.1", "is not an IP address"),
        ("[127.0.0.1]:53", "is not an IPv6 address"),
        ("[::1", "unbalanced brackets"),
        ("[::1]53", "unbalanced brackets"),
        ("[fe80::1%eth0]", "zone id"),
        ("fe80::1%eth0", "zone id"),
        (":53", "the address is missing"),
    ],
)
def test_parse_nameserver_rejects(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="expected IP, IP:PORT") as info:
        parse_nameserver(text)
    assert fragment in str(info.value)


def test_constructor_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="timeout"):
        DnsResolver([("127.0.0.1", 53)], timeout=0)
    with pytest.raises(ValueError, match="cache size"):
        DnsResolver([("127.0.0.1", 53)], cache_size=-1)
    with pytest.raises(ValueError, match="not an IP address"):
        DnsResolver([("dns.example", 53)])
    with pytest.raises(ValueError, match="bad nameserver"):
        DnsResolver([("127.0.0.1", 0)])


def test_resolution_needs_an_address() -> None:
    with pytest.raises(ValueError, match="at least one address"):
        Resolution((), ("a.test",), 0.0, "dns")


# ----------------------------------------------------------------------------
# The test server itself, used synchronously


@pytest.fixture
def udp_port_nobody_uses() -> int:
    # Bound and closed again: nothing listens there now (a race is harmless).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_dns_server_sync_use_and_sequences(dns_server: DnsServer) -> None:
    dns_server.set_sequence("seq.test", [[A("192.0.2.1")], NXDOMAIN, [A("192.0.2.3")]])
    port = dns_server.port

    def ask(rtype: str, tcp: bool = False) -> dns.message.Message:
        query = dns.message.make_query("seq.test", rtype)
        if tcp:
            return dns.query.tcp(query, "127.0.0.1", timeout=TIMEOUT, port=port)
        return dns.query.udp(query, "127.0.0.1", timeout=TIMEOUT, port=port)

    assert ask("A").answer[0][0].to_text() == "192.0.2.1"
    assert ask("AAAA").rcode() == dns.rcode.NOERROR  # each type has its own turn
    assert ask("A", tcp=True).rcode() == dns.rcode.NXDOMAIN
    assert ask("A").answer[0][0].to_text() == "192.0.2.3"
    assert ask("A").answer[0][0].to_text() == "192.0.2.3"  # the last step repeats
    assert [q.transport for q in dns_server.queries_for("seq.test")] == [
        "udp",
        "udp",
        "tcp",
        "udp",
        "udp",
    ]
    assert dns_server.errors == []


def test_dns_server_unknown_name_is_nxdomain_and_remove(dns_server: DnsServer) -> None:
    dns_server.set("gone.test", A("192.0.2.1"))
    dns_server.remove("gone.test")
    query = dns.message.make_query("gone.test", "A")
    reply = dns.query.udp(query, "127.0.0.1", timeout=TIMEOUT, port=dns_server.port)
    assert reply.rcode() == dns.rcode.NXDOMAIN


async def test_nobody_listening_is_an_error_not_a_hang(udp_port_nobody_uses: int) -> None:
    resolver = DnsResolver([("127.0.0.1", udp_port_nobody_uses)], timeout=SHORT)
    start = time.monotonic()
    error = await failure(resolver, "a.test")
    assert error.reason in (Reason.DNS_TIMEOUT, Reason.DNS_FAILURE)
    assert time.monotonic() - start < SHORT + SLACK


async def test_a_cached_name_keeps_its_memoized_decision_until_the_entry_changes(
    dns_server: DnsServer,
) -> None:
    """The real cache hands out a fresh copy per lookup (its TTL counts down): the
    decision memo still hits while the entry is the same, and a new entry (here a
    rebinding to a private address after the old one is dropped) decides afresh."""
    from egressbox.core.decide import Decision
    from egressbox.core.policy import parse_policy
    from egressbox.proxy.check import check, check_now

    policy = parse_policy({"egress": {"allow": ["memo.test:443"]}}, env={})
    dns_server.set("memo.test", A("151.101.0.223"))  # a public address: allowed
    resolver = explicit(dns_server)
    first = await check(policy, resolver, "memo.test", 443)
    assert first.allowed
    hit = check_now(policy, resolver, "memo.test", 443)
    assert isinstance(hit, Decision) and hit.allowed
    assert check_now(policy, resolver, "memo.test", 443) is hit
    dns_server.set("memo.test", A("10.0.0.9"))
    resolver.clear_cache()
    assert not isinstance(check_now(policy, resolver, "memo.test", 443), Decision)
    second = await check(policy, resolver, "memo.test", 443)
    assert second.reason is Reason.PRIVATE_ADDRESS
    again = check_now(policy, resolver, "memo.test", 443)
    assert isinstance(again, Decision) and again.reason is Reason.PRIVATE_ADDRESS
