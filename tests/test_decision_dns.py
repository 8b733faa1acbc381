"""The decision with egressbox's own resolver against a real DNS server on loopback."""

from __future__ import annotations

import ipaddress

from dnsserver import AAAA, CNAME, NXDOMAIN, SERVFAIL, SILENT, A, DnsServer
from egressbox.core.errors import Reason, Verdict
from egressbox.core.policy import Policy, parse_policy
from egressbox.net.resolve import DnsResolver
from egressbox.proxy.check import check

POLICY = {
    "egress": {
        "allow": ["*.example.test", "rebind.test:443", "alias.test"],
        "deny": ["*.internal.test"],
        "deny_cidrs": ["169.254.169.254/32"],
    }
}


def policy(extra: dict[str, object] | None = None) -> Policy:
    data = {"egress": {**POLICY["egress"], **(extra or {})}}
    return parse_policy(data, env={})


def resolver(server: DnsServer) -> DnsResolver:
    return DnsResolver([server.nameserver], timeout=0.5)


async def test_rebinding_second_answer_is_checked_again(dns_server: DnsServer) -> None:
    # First answer public, second loopback, TTL 0: each decision resolves anew
    # and pins only what it checked; the second one is denied.
    dns_server.set_sequence("rebind.test", [[A("93.184.216.34", ttl=0)], [A("127.0.0.1", ttl=0)]])
    res = resolver(dns_server)
    first = await check(policy(), res, "rebind.test", 443)
    assert first.verdict is Verdict.ALLOW
    assert first.addresses == (ipaddress.ip_address("93.184.216.34"),)
    second = await check(policy(), res, "rebind.test", 443)
    assert (second.verdict, second.reason) == (Verdict.DENY, Reason.PRIVATE_ADDRESS)
    assert first.addresses == (ipaddress.ip_address("93.184.216.34"),)  # unchanged


async def test_mixed_answer_denies_the_name(dns_server: DnsServer) -> None:
    dns_server.set("mixed.example.test", A("93.184.216.34"), A("10.0.0.5"))
    decision = await check(policy(), resolver(dns_server), "mixed.example.test", 443)
    assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.PRIVATE_ADDRESS)
    assert set(decision.addresses) == {
        ipaddress.ip_address("93.184.216.34"),
        ipaddress.ip_address("10.0.0.5"),
    }


async def test_aaaa_wrapping_metadata_is_denied(dns_server: DnsServer) -> None:
    dns_server.set("nat64.example.test", AAAA("64:ff9b::a9fe:a9fe"))
    decision = await check(policy(), resolver(dns_server), "nat64.example.test", 80)
    assert decision.reason is Reason.DENY_CIDR


async def test_cname_into_denied_zone_is_denied(dns_server: DnsServer) -> None:
    dns_server.set("alias.test", CNAME("db.internal.test"))
    dns_server.set("db.internal.test", A("93.184.216.34"))
    decision = await check(policy(), resolver(dns_server), "alias.test", 443)
    assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.DENY_RULE)
    assert decision.rule == "*.internal.test"


async def test_cname_chain_to_public_address_is_allowed(dns_server: DnsServer) -> None:
    dns_server.set("www.example.test", CNAME("cdn.example.test"))
    dns_server.set("cdn.example.test", A("93.184.216.34"), AAAA("2606:2800:220:1::1"))
    decision = await check(policy(), resolver(dns_server), "www.example.test", 443)
    assert decision.verdict is Verdict.ALLOW
    assert len(decision.addresses) == 2


async def test_names_outside_the_policy_are_never_queried(dns_server: DnsServer) -> None:
    res = resolver(dns_server)
    for host in ("evil.test", "example.test", "x.internal.test", "rebind.test"):
        port = 80 if host == "rebind.test" else 443  # rebind.test is allowed on 443 only
        decision = await check(policy(), res, host, port)
        assert decision.verdict is Verdict.DENY
    assert dns_server.queries == []


async def test_dns_failures_map_to_reasons(dns_server: DnsServer) -> None:
    dns_server.set_behaviour("nx.example.test", NXDOMAIN)
    dns_server.set_behaviour("fail.example.test", SERVFAIL)
    dns_server.set_behaviour("slow.example.test", SILENT)
    res = resolver(dns_server)
    expected = {
        "nx.example.test": Reason.DNS_FAILURE,
        "fail.example.test": Reason.DNS_FAILURE,
        "slow.example.test": Reason.DNS_TIMEOUT,
    }
    for host, reason in expected.items():
        decision = await check(policy(), res, host, 443)
        assert (decision.verdict, decision.reason) == (Verdict.DENY, reason), host
        assert decision.addresses == ()


async def test_report_mode_resolves_but_keeps_the_address_ban(dns_server: DnsServer) -> None:
    dns_server.set("public.test", A("93.184.216.34"))
    dns_server.set("loop.test", A("127.0.0.1"))
    report = policy({"mode": "report"})
    res = resolver(dns_server)
    public = await check(report, res, "public.test", 443)
    assert (public.verdict, public.reason) == (Verdict.WOULD_DENY, Reason.NO_ALLOW_RULE)
    assert public.allowed
    loop = await check(report, res, "loop.test", 443)
    assert (loop.verdict, loop.reason) == (Verdict.DENY, Reason.PRIVATE_ADDRESS)


async def test_allow_cidrs_lifts_ban_only_for_allowed_names(dns_server: DnsServer) -> None:
    dns_server.set("svc.example.test", A("127.0.0.1"))
    dns_server.set("other.test", A("127.0.0.1"))
    local = policy({"allow_cidrs": ["127.0.0.0/8"]})
    res = resolver(dns_server)
    assert (await check(local, res, "svc.example.test", 8080)).verdict is Verdict.ALLOW
    other = await check(local, res, "other.test", 8080)
    assert other.reason is Reason.NO_ALLOW_RULE
