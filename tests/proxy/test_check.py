"""egress.check: name rules, DNS through a fake resolver, every address, one Decision."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from egressbox.core.decide import Decision, SelfEndpoints
from egressbox.core.errors import Reason, ResolveError, Verdict
from egressbox.core.hosts import INVALID_HOST_TEXT
from egressbox.core.policy import Policy, parse_policy
from egressbox.net.resolve import Resolution
from egressbox.proxy.check import Pending, check, check_now, recheck
from fakes import FakeResolver, ip

METADATA = ["169.254.169.254/32", "fd00:ec2::254/128"]
PUBLIC_V4 = "151.101.0.223"
PUBLIC_V6 = "2a04:4e42::223"


def make_policy(**egress: Any) -> Policy:
    return parse_policy({"egress": egress}, env={})


LISTENERS = SelfEndpoints(endpoints=frozenset({(ip("127.0.0.1"), 8080)}))


# -- allowed ----------------------------------------------------------------------------


async def test_allowed_name_is_resolved_once_and_pinned() -> None:
    resolver = FakeResolver({"pypi.org": [PUBLIC_V4, PUBLIC_V6]})
    policy = make_policy(allow=["pypi.org:443"], deny_cidrs=METADATA)
    decision = await check(policy, resolver, "PyPI.org.", 443)
    assert decision == Decision(
        Verdict.ALLOW,
        Reason.ALLOWED,
        "pypi.org",
        443,
        (ip(PUBLIC_V4), ip(PUBLIC_V6)),
        "pypi.org:443",
        "allowed by pypi.org:443",
    )
    assert decision.allowed
    assert resolver.queries == ["pypi.org"]


async def test_port_as_text() -> None:
    resolver = FakeResolver({"pypi.org": [PUBLIC_V4]})
    decision = await check(make_policy(allow=["pypi.org:443"]), resolver, "pypi.org", "443")
    assert (decision.reason, decision.port) == (Reason.ALLOWED, 443)


async def test_idn_is_queried_in_ascii() -> None:
    resolver = FakeResolver({"xn--strae-oqa.de": [PUBLIC_V4]})
    decision = await check(make_policy(allow=["straße.de"]), resolver, "STRASSE.de", 443)
    assert decision.reason is Reason.NO_ALLOW_RULE  # "strasse" is another name
    decision = await check(make_policy(allow=["straße.de"]), resolver, "straße.de", 443)
    assert decision.reason is Reason.ALLOWED
    assert decision.host == "xn--strae-oqa.de"
    assert resolver.queries == ["xn--strae-oqa.de"]


async def test_wildcard_subdomains_only() -> None:
    resolver = FakeResolver({"a.b.example.com": [PUBLIC_V4], "example.com": [PUBLIC_V4]})
    policy = make_policy(allow=["*.example.com"])
    assert (await check(policy, resolver, "a.b.example.com", 443)).reason is Reason.ALLOWED
    assert (await check(policy, resolver, "example.com", 443)).reason is Reason.NO_ALLOW_RULE
    assert resolver.queries == ["a.b.example.com"]


async def test_ip_literals_are_not_resolved() -> None:
    resolver = FakeResolver()
    policy = make_policy(allow=["1.1.1.1:53", "[2606:4700::/32]:443"])
    decision = await check(policy, resolver, "1.1.1.1", 53)
    assert (decision.reason, decision.addresses, decision.rule) == (
        Reason.ALLOWED,
        (ip("1.1.1.1"),),
        "1.1.1.1:53",
    )
    decision = await check(policy, resolver, "[2606:4700::1111]", 443)
    assert decision.reason is Reason.ALLOWED
    assert decision.host == "2606:4700::1111"
    assert resolver.queries == []


# -- denied before any DNS query ---------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "port", "reason"),
    [
        ("evil.example", 443, Reason.NO_ALLOW_RULE),
        ("pypi.org", 80, Reason.NO_ALLOW_RULE),
        ("evilpypi.org", 443, Reason.NO_ALLOW_RULE),
        ("151.101.0.223", 443, Reason.NO_ALLOW_RULE),  # a name never admits an IP literal
        ("[2a04:4e42::223]", 443, Reason.NO_ALLOW_RULE),
        ("10.1.2.3", 443, Reason.NO_ALLOW_RULE),  # allow_cidrs admit nothing by themselves
        ("db.internal", 443, Reason.DENY_RULE),
        ("x.db.internal", 443, Reason.DENY_RULE),
        ("bad.pypi.org", 443, Reason.DENY_RULE),
        ("", 443, Reason.BAD_HOST),
        ("127.1", 443, Reason.BAD_HOST),
        ("2130706433", 443, Reason.BAD_HOST),
        ("0x7f.1", 443, Reason.BAD_HOST),
        ("a b.example", 443, Reason.BAD_HOST),
        ("[fe80::1%eth0]", 443, Reason.BAD_HOST),
        ("pypi.org", 0, Reason.BAD_PORT),
        ("pypi.org", 65536, Reason.BAD_PORT),
        ("pypi.org", "", Reason.BAD_PORT),
        ("pypi.org", "443/tcp", Reason.BAD_PORT),
    ],
)
async def test_denied_without_dns(host: str, port: int | str, reason: Reason) -> None:
    resolver = FakeResolver({"pypi.org": [PUBLIC_V4]})
    policy = make_policy(
        allow=["pypi.org:443", "*.pypi.org", "*.db.internal"],
        deny=["*.internal", "bad.pypi.org"],
        allow_cidrs=["10.0.0.0/8"],
    )
    decision = await check(policy, resolver, host, port)
    assert (decision.verdict, decision.reason) == (Verdict.DENY, reason)
    assert decision.addresses == ()
    assert not decision.allowed
    assert resolver.queries == []


async def test_no_policy_denies_without_dns() -> None:
    resolver = FakeResolver({"pypi.org": [PUBLIC_V4]})
    decision = await check(None, resolver, "pypi.org", 443)
    assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.NO_POLICY)
    assert (decision.host, decision.port) == ("pypi.org", 443)
    # a malformed target is still reported as such
    assert (await check(None, resolver, "127.1", 443)).reason is Reason.BAD_HOST
    assert (await check(None, resolver, "pypi.org", 0)).reason is Reason.BAD_PORT
    assert resolver.queries == []


async def test_empty_allow_list_denies_without_dns() -> None:
    resolver = FakeResolver({"pypi.org": [PUBLIC_V4]})
    decision = await check(make_policy(), resolver, "pypi.org", 443)
    assert decision.reason is Reason.NO_ALLOW_RULE
    assert resolver.queries == []


async def test_bad_target_is_never_echoed() -> None:
    resolver = FakeResolver()
    policy = make_policy(allow=["pypi.org"])
    for host in ("user:hunter2@pypi.org", "pypi.org/hunter2", "hunter2 pypi.org", "[hunter2]"):
        decision = await check(policy, resolver, host, 443)
        assert decision.reason is Reason.BAD_HOST, host
        assert decision.host == INVALID_HOST_TEXT
        assert "hunter2" not in decision.detail
    decision = await check(policy, resolver, "pypi.org", "hunter2")
    assert decision.reason is Reason.BAD_PORT
    assert decision.port == 0
    assert "hunter2" not in decision.detail


# -- every address ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "port", "reason"),
    [
        ([PUBLIC_V4, PUBLIC_V6], 443, Reason.ALLOWED),
        (["169.254.169.254"], 80, Reason.DENY_CIDR),
        (["fd00:ec2::254"], 80, Reason.DENY_CIDR),
        (["64:ff9b::a9fe:a9fe"], 80, Reason.DENY_CIDR),
        (["::ffff:169.254.169.254"], 80, Reason.DENY_CIDR),
        (["2002:a9fe:a9fe::1"], 80, Reason.DENY_CIDR),
        (["127.0.0.1"], 8080, Reason.SELF_CONNECTION),
        (["::ffff:127.0.0.1"], 8080, Reason.SELF_CONNECTION),
        (["0.0.0.0"], 8080, Reason.SELF_CONNECTION),
        (["127.0.0.1"], 8081, Reason.PRIVATE_ADDRESS),
        (["10.0.0.1"], 443, Reason.PRIVATE_ADDRESS),
        (["192.168.0.1"], 443, Reason.PRIVATE_ADDRESS),
        (["fd12::1"], 443, Reason.PRIVATE_ADDRESS),
        (["100.64.0.1"], 443, Reason.PRIVATE_ADDRESS),
        (["fe80::1"], 443, Reason.PRIVATE_ADDRESS),
        (["::1"], 443, Reason.PRIVATE_ADDRESS),
        (["64:ff9b::a00:1"], 443, Reason.PRIVATE_ADDRESS),
        ([PUBLIC_V4, "10.0.0.1"], 443, Reason.PRIVATE_ADDRESS),  # mixed answer
        (["224.0.0.1"], 443, Reason.SPECIAL_ADDRESS),
        (["192.0.2.1"], 443, Reason.SPECIAL_ADDRESS),
        (["2001:db8::1"], 443, Reason.SPECIAL_ADDRESS),
        (["240.0.0.1"], 443, Reason.SPECIAL_ADDRESS),
        (["::ffff:8.8.8.8"], 443, Reason.SPECIAL_ADDRESS),
    ],
)
async def test_every_address_is_checked(answer: list[str], port: int, reason: Reason) -> None:
    resolver = FakeResolver({"app.example.com": answer})
    policy = make_policy(allow=["app.example.com"], deny_cidrs=METADATA)
    decision = await check(policy, resolver, "app.example.com", port, self_endpoints=LISTENERS)
    assert decision.reason is reason
    assert decision.verdict is (Verdict.ALLOW if reason is Reason.ALLOWED else Verdict.DENY)
    assert decision.addresses == tuple(ip(a) for a in answer)
    assert decision.rule == "app.example.com"
    assert resolver.queries == ["app.example.com"]


async def test_private_flag_and_allow_private_and_allow_cidrs() -> None:
    resolver = FakeResolver(
        {"db.corp": ["10.1.2.3"], "web.corp": ["10.1.2.4"], "lo.test": ["127.0.0.1", "::1"]}
    )
    policy = make_policy(
        allow=[{"host": "db.corp:5432", "private": True}, "web.corp", "lo.test"],
        allow_cidrs=["127.0.0.0/8", "::1/128"],
    )
    assert (await check(policy, resolver, "db.corp", 5432)).reason is Reason.ALLOWED
    assert (await check(policy, resolver, "web.corp", 443)).reason is Reason.PRIVATE_ADDRESS
    assert (await check(policy, resolver, "lo.test", 3000)).reason is Reason.ALLOWED
    wide = make_policy(allow=["web.corp"], allow_private=True)
    assert (await check(wide, resolver, "web.corp", 443)).reason is Reason.ALLOWED


async def test_ip_literal_address_checks() -> None:
    resolver = FakeResolver()
    policy = make_policy(
        allow=["10.1.2.3:5432", {"host": "10.1.2.4", "private": True}, "169.254.169.254"],
        deny_cidrs=METADATA,
    )
    assert (await check(policy, resolver, "10.1.2.3", 5432)).reason is Reason.PRIVATE_ADDRESS
    assert (await check(policy, resolver, "10.1.2.4", 5432)).reason is Reason.ALLOWED
    assert (await check(policy, resolver, "169.254.169.254", 80)).reason is Reason.DENY_CIDR
    assert resolver.queries == []


@pytest.mark.parametrize(
    "answer",
    [
        ["169.254.169.254"],
        ["100.100.100.200"],
        ["168.63.129.16"],
        ["fd00:ec2::254"],
        [PUBLIC_V4, "169.254.170.2"],
        ["64:ff9b::a9fe:a9fe"],
    ],
)
async def test_a_name_resolving_to_a_metadata_endpoint_is_denied(answer: list[str]) -> None:
    resolver = FakeResolver({"imds.example.com": answer})
    policy = make_policy(
        allow=["imds.example.com", *answer],  # exact entries for the addresses admit no name
        allow_private=True,
        allow_cidrs=["169.254.0.0/16", "100.64.0.0/10", "168.63.129.16/32", "fd00:ec2::/32"],
    )
    decision = await check(policy, resolver, "imds.example.com", 80)
    assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.METADATA_ADDRESS)
    assert decision.addresses == tuple(ip(a) for a in answer)
    assert resolver.queries == ["imds.example.com"]
    # A connection admitted to such an address under an older policy is closed on recheck.
    again = recheck(policy, "imds.example.com", 80, decision.addresses)
    assert again.reason is Reason.METADATA_ADDRESS


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ResolveError(Reason.DNS_FAILURE, "pypi.org: no such name (NXDOMAIN)"), Reason.DNS_FAILURE),
        (ResolveError(Reason.DNS_TIMEOUT, "pypi.org: no answer within 5 s"), Reason.DNS_TIMEOUT),
    ],
)
async def test_dns_errors(error: ResolveError, reason: Reason) -> None:
    resolver = FakeResolver({"pypi.org": error})
    decision = await check(make_policy(allow=["pypi.org:443"]), resolver, "pypi.org", 443)
    assert decision == Decision(
        Verdict.DENY, reason, "pypi.org", 443, (), "pypi.org:443", str(error)
    )
    assert resolver.queries == ["pypi.org"]


async def test_cname_chain_deny() -> None:
    resolver = FakeResolver(
        {"a.example.com": [PUBLIC_V4], "b.example.com": [PUBLIC_V4]},
        cnames={
            "a.example.com": ["edge.cdn.net", "db.internal"],
            "b.example.com": ["edge.cdn.net"],
        },
    )
    policy = make_policy(allow=["*.example.com"], deny=["*.internal"])
    decision = await check(policy, resolver, "a.example.com", 443)
    assert (decision.verdict, decision.reason, decision.rule) == (
        Verdict.DENY,
        Reason.DENY_RULE,
        "*.internal",
    )
    assert (await check(policy, resolver, "b.example.com", 443)).reason is Reason.ALLOWED


async def test_wildcard_listener_self_connection() -> None:
    endpoints = SelfEndpoints(
        endpoints=frozenset({(ip("0.0.0.0"), 3128)}),
        wildcard_ports=frozenset({3128}),
        local_addresses=frozenset({ip("192.168.1.5")}),
    )
    resolver = FakeResolver({"me.corp": ["192.168.1.5"], "lo.test": ["127.0.0.9"]})
    policy = make_policy(
        allow=["me.corp", "lo.test", "127.0.0.1"], allow_private=True, allow_cidrs=["127.0.0.0/8"]
    )
    for host in ("me.corp", "lo.test", "127.0.0.1"):
        decision = await check(policy, resolver, host, 3128, self_endpoints=endpoints)
        assert decision.reason is Reason.SELF_CONNECTION, host
    assert (await check(policy, resolver, "me.corp", 22, self_endpoints=endpoints)).reason is (
        Reason.ALLOWED
    )


# -- report mode ------------------------------------------------------------------------

REPORT_ANSWERS: dict[str, Sequence[str] | ResolveError] = {
    "pypi.org": [PUBLIC_V4],
    "evil.example": [PUBLIC_V4],
    "lan.example": ["192.168.1.1"],
    "lo.example": ["127.0.0.1"],
    "meta.example": ["169.254.169.254"],
    "nat64.example": ["64:ff9b::a9fe:a9fe"],
    "mcast.example": ["224.0.0.1"],
    "mixed.example": [PUBLIC_V4, "10.0.0.1"],
    "timeout.example": ResolveError(Reason.DNS_TIMEOUT, "timeout.example: no answer"),
}


@pytest.mark.parametrize(
    ("host", "port", "verdict", "reason", "queried"),
    [
        # name rules are relaxed: a miss is let through and marked would_deny
        ("evil.example", 443, Verdict.WOULD_DENY, Reason.NO_ALLOW_RULE, True),
        ("pypi.org", 80, Verdict.WOULD_DENY, Reason.NO_ALLOW_RULE, True),
        ("8.8.8.8", 53, Verdict.WOULD_DENY, Reason.NO_ALLOW_RULE, False),
        ("[2606:4700::1111]", 443, Verdict.WOULD_DENY, Reason.NO_ALLOW_RULE, False),
        # a match is a plain allow
        ("pypi.org", 443, Verdict.ALLOW, Reason.ALLOWED, True),
        # everything else stays enforced
        ("127.1", 443, Verdict.DENY, Reason.BAD_HOST, False),
        ("evil.example", 0, Verdict.DENY, Reason.BAD_PORT, False),
        ("x.internal", 443, Verdict.DENY, Reason.DENY_RULE, False),
        ("meta.example", 80, Verdict.DENY, Reason.DENY_CIDR, True),
        ("nat64.example", 80, Verdict.DENY, Reason.DENY_CIDR, True),
        ("169.254.169.254", 80, Verdict.DENY, Reason.DENY_CIDR, False),
        ("lo.example", 8080, Verdict.DENY, Reason.SELF_CONNECTION, True),
        ("127.0.0.1", 8080, Verdict.DENY, Reason.SELF_CONNECTION, False),
        ("lo.example", 22, Verdict.DENY, Reason.PRIVATE_ADDRESS, True),
        ("lan.example", 443, Verdict.DENY, Reason.PRIVATE_ADDRESS, True),
        ("10.0.0.1", 443, Verdict.DENY, Reason.PRIVATE_ADDRESS, False),
        ("mixed.example", 443, Verdict.DENY, Reason.PRIVATE_ADDRESS, True),
        ("mcast.example", 443, Verdict.DENY, Reason.SPECIAL_ADDRESS, True),
        ("224.0.0.1", 443, Verdict.DENY, Reason.SPECIAL_ADDRESS, False),
        ("nx.example", 443, Verdict.DENY, Reason.DNS_FAILURE, True),
        ("timeout.example", 443, Verdict.DENY, Reason.DNS_TIMEOUT, True),
    ],
)
async def test_report_mode_matrix(
    host: str, port: int, verdict: Verdict, reason: Reason, queried: bool
) -> None:
    resolver = FakeResolver(REPORT_ANSWERS)
    policy = make_policy(
        allow=["pypi.org:443"], deny=["*.internal"], deny_cidrs=METADATA, mode="report"
    )
    decision = await check(policy, resolver, host, port, self_endpoints=LISTENERS)
    assert (decision.verdict, decision.reason) == (verdict, reason)
    assert decision.allowed is (verdict is not Verdict.DENY)
    assert bool(resolver.queries) is queried
    if verdict is Verdict.WOULD_DENY:
        assert decision.rule is None
        assert decision.addresses  # the addresses that were checked, for pinning
        # pypi.org:80 is admitted on another port: the detail says which.
        assert decision.detail.startswith(
            ("report mode: no allow entry matches", "report mode: no allow entry admits port 80")
        )


async def test_report_mode_without_policy_still_denies() -> None:
    resolver = FakeResolver({"pypi.org": [PUBLIC_V4]})
    assert (await check(None, resolver, "pypi.org", 443)).reason is Reason.NO_POLICY
    assert resolver.queries == []


# -- any garbage gives a Decision --------------------------------------------------------

GARBAGE_ALPHABET = (
    "[]:.%@/\\ \t\r\n\x00*-_0123456789abcdefxX\u00df\u0130\u200d\u3002\uff0e\ufffd\udcff"
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    host=st.one_of(
        st.text(max_size=80),
        st.text(alphabet=GARBAGE_ALPHABET, max_size=60),
        st.from_regex(r"\[?[0-9a-fA-F:.%]{0,45}\]?", fullmatch=True),
        st.just("a." * 600),
        st.just("a" * 64 + ".com"),
    ),
    port=st.one_of(
        st.integers(min_value=-(2**70), max_value=2**70),
        st.text(max_size=8),
        st.from_regex(r"[0-9]{1,7}", fullmatch=True),
    ),
    report=st.booleans(),
)
def test_garbage_gives_a_decision(host: str, port: int | str, report: bool) -> None:
    resolver = FakeResolver()
    policy = make_policy(mode="report" if report else "enforce")
    decision = asyncio.run(check(policy, resolver, host, port))
    assert isinstance(decision, Decision)
    if decision.reason in (Reason.BAD_HOST, Reason.BAD_PORT):
        assert decision.verdict is Verdict.DENY
        assert decision.addresses == ()
        assert resolver.queries == []
        assert decision.host == INVALID_HOST_TEXT or decision.reason is Reason.BAD_PORT
        assert 0 <= decision.port <= 65535
    elif report:
        # a well-formed target: report mode resolves it (NXDOMAIN here) or checks the literal
        assert decision.reason in (
            Reason.DNS_FAILURE,
            Reason.NO_ALLOW_RULE,
            Reason.PRIVATE_ADDRESS,
            Reason.SPECIAL_ADDRESS,
        )
    else:
        assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.NO_ALLOW_RULE)
        assert resolver.queries == []


async def test_ip_and_cidr_deny_entries_refuse_resolved_addresses() -> None:
    policy = make_policy(allow=["*.example.com"], deny=["93.184.216.0/24:443", "2606:2800::1"])
    resolver = FakeResolver(
        {
            "a.example.com": ["93.184.216.34"],
            "b.example.com": ["2606:2800::1"],
            "c.example.com": ["64:ff9b::5db8:d822"],  # NAT64 form of 93.184.216.34
        }
    )
    a = await check(policy, resolver, "a.example.com", 443)
    assert (a.verdict, a.reason, a.rule) == (Verdict.DENY, Reason.DENY_RULE, "93.184.216.0/24:443")
    assert (await check(policy, resolver, "a.example.com", 80)).verdict is Verdict.ALLOW
    b = await check(policy, resolver, "b.example.com", 80)
    assert (b.reason, b.rule) == (Reason.DENY_RULE, "[2606:2800::1]")
    c = await check(policy, resolver, "c.example.com", 443)
    assert c.reason is Reason.DENY_RULE


# -- check_now: the same decision without awaiting, when no query is needed -----------


class CachingResolver(FakeResolver):
    """A FakeResolver that also answers without a query for the names in `cached`."""

    def __init__(self, answers: dict[str, list[str]], cached: set[str]) -> None:
        super().__init__(answers)
        self.addresses = answers
        self.cached = cached
        self.asked_now: list[str] = []

    def resolve_now(self, host: str) -> Resolution | None:
        self.asked_now.append(host)
        if host not in self.cached:
            return None
        return Resolution(tuple(ip(a) for a in self.addresses[host]), (host,), 60.0, "cache")


@pytest.mark.parametrize(
    ("host", "port", "needs_dns"),
    [
        ("151.101.0.223", 443, False),  # IP literal, allowed
        ("10.0.0.1", 443, False),  # IP literal, denied by the address checks
        ("evil.example", 443, False),  # no allow entry: denied before DNS
        ("pypi.org", 80, False),  # wrong port: denied before DNS
        ("bad host", 443, False),  # bad target
        ("pypi.org", 443, False),  # cached
        ("files.pythonhosted.org", 443, True),  # not cached: needs the query
    ],
)
async def test_check_now_agrees_with_check(host: str, port: int, needs_dns: bool) -> None:
    answers = {"pypi.org": [PUBLIC_V4], "files.pythonhosted.org": [PUBLIC_V6]}
    policy = make_policy(
        allow=["pypi.org:443", "files.pythonhosted.org:443", "151.101.0.223", "10.0.0.1"]
    )
    resolver = CachingResolver(answers, cached={"pypi.org"})
    decided = check_now(policy, resolver, host, port, self_endpoints=LISTENERS)
    assert isinstance(decided, Pending) is needs_dns
    assert resolver.queries == []
    expected = await check(policy, FakeResolver(answers), host, port, self_endpoints=LISTENERS)
    if isinstance(decided, Pending):
        assert await decided.finish() == expected
        assert resolver.queries == [host]
    else:
        assert decided == expected


async def test_check_now_without_resolve_now_needs_the_query() -> None:
    resolver = FakeResolver({"pypi.org": [PUBLIC_V4]})
    policy = make_policy(allow=["pypi.org:443"])
    pending = check_now(policy, resolver, "pypi.org", 443)
    assert isinstance(pending, Pending)
    assert resolver.queries == []
    decision = await pending.finish()
    assert decision.reason is Reason.ALLOWED
    assert resolver.queries == ["pypi.org"]


# -- the memo of decisions made without a query ----------------------------------------


class StableCache(FakeResolver):
    """resolve_now answers from one Resolution object per name until `replace`."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        super().__init__(answers)
        self.cache = {
            name: Resolution(tuple(ip(a) for a in addrs), (name,), 60.0, "cache")
            for name, addrs in answers.items()
        }
        self.asked_now = 0

    def resolve_now(self, host: str) -> Resolution | None:
        self.asked_now += 1
        return self.cache.get(host)

    def replace(self, host: str, addresses: list[str]) -> None:
        self.cache[host] = Resolution(tuple(ip(a) for a in addresses), (host,), 60.0, "cache")


def test_a_repeated_target_gets_the_memoized_decision() -> None:
    policy = make_policy(allow=["151.101.0.223"])
    first = check_now(policy, FakeResolver(), "151.101.0.223", 443, self_endpoints=LISTENERS)
    again = check_now(policy, FakeResolver(), "151.101.0.223", 443, self_endpoints=LISTENERS)
    assert isinstance(first, Decision) and first.allowed
    assert again is first


def test_a_new_policy_or_new_endpoints_decide_afresh() -> None:
    allowing = make_policy(allow=["151.101.0.223"])
    denying = make_policy(allow=["pypi.org"])
    target = ("151.101.0.223", 8443)
    assert _decided(check_now(allowing, FakeResolver(), *target)).allowed
    assert not _decided(check_now(denying, FakeResolver(), *target)).allowed
    self_target = SelfEndpoints(frozenset({(ip("151.101.0.223"), 8443)}))
    refused = _decided(check_now(allowing, FakeResolver(), *target, self_endpoints=self_target))
    assert refused.reason is Reason.SELF_CONNECTION


def test_a_name_is_memoized_only_while_its_cached_answer_stays() -> None:
    policy = make_policy(allow=["pypi.org:443"])
    resolver = StableCache({"pypi.org": [PUBLIC_V4]})
    first = _decided(check_now(policy, resolver, "pypi.org", 443))
    assert _decided(check_now(policy, resolver, "pypi.org", 443)) is first
    # A new answer in the cache (a refresh, or a rebinding attempt) is judged anew.
    resolver.replace("pypi.org", ["10.0.0.7"])
    second = _decided(check_now(policy, resolver, "pypi.org", 443))
    assert not second.allowed
    assert second.reason is Reason.PRIVATE_ADDRESS
    # An answer gone from the cache means a query, never the old decision.
    del resolver.cache["pypi.org"]
    assert isinstance(check_now(policy, resolver, "pypi.org", 443), Pending)


def _decided(result: Decision | Pending) -> Decision:
    assert isinstance(result, Decision)
    return result


# -- recheck: an open connection judged again ---------------------------------------------


async def test_recheck_agrees_with_a_fresh_decision_on_the_same_answer() -> None:
    resolver = FakeResolver({"pypi.org": [PUBLIC_V4, PUBLIC_V6]})
    policy = make_policy(allow=["pypi.org:443"], deny_cidrs=METADATA)
    fresh = await check(policy, resolver, "pypi.org", 443)
    again = recheck(policy, fresh.host, fresh.port, fresh.addresses)
    assert again == fresh
    assert resolver.queries == ["pypi.org"]  # recheck asked nothing


@pytest.mark.parametrize(
    ("egress", "reason"),
    [
        ({"allow": ["files.pythonhosted.org:443"]}, Reason.NO_ALLOW_RULE),
        ({"allow": ["pypi.org:443"], "deny": ["pypi.org"]}, Reason.DENY_RULE),
        ({"allow": ["pypi.org:443"], "deny_cidrs": [f"{PUBLIC_V6}/128"]}, Reason.DENY_CIDR),
    ],
    ids=["no-rule", "deny-entry", "deny-cidr-on-one-address"],
)
def test_recheck_under_a_new_policy_judges_the_admitted_addresses(
    egress: dict[str, Any], reason: Reason
) -> None:
    addresses = (ip(PUBLIC_V4), ip(PUBLIC_V6))
    assert recheck(make_policy(allow=["pypi.org:443"]), "pypi.org", 443, addresses).allowed
    decision = recheck(make_policy(**egress), "pypi.org", 443, addresses)
    assert (decision.verdict, decision.reason) == (Verdict.DENY, reason)


def test_recheck_keeps_report_mode_and_self_connections() -> None:
    report = make_policy(allow=[], mode="report")
    assert recheck(report, "pypi.org", 443, (ip(PUBLIC_V4),)).verdict is Verdict.WOULD_DENY
    own = make_policy(allow=["127.0.0.1"], allow_cidrs=["127.0.0.1/32"])
    decision = recheck(own, "127.0.0.1", 8080, (ip("127.0.0.1"),), self_endpoints=LISTENERS)
    assert decision.reason is Reason.SELF_CONNECTION
    assert recheck(None, "pypi.org", 443, (ip(PUBLIC_V4),)).reason is Reason.NO_POLICY
