"""The pure decision: name rules, then every address (DESIGN §3), without DNS."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any

import pytest

from egressbox.core.addresses import METADATA_ENDPOINTS
from egressbox.core.decide import (
    NO_SELF,
    Decision,
    NamePass,
    SelfEndpoints,
    Target,
    bad_target,
    check_address,
    decide_addresses,
    decide_name,
    parse_target,
)
from egressbox.core.errors import HostError, Reason, Verdict
from egressbox.core.hosts import INVALID_HOST_TEXT, canonical_ip_text
from egressbox.core.ip import IPAddress
from egressbox.core.policy import Policy, parse_policy

METADATA = ["169.254.169.254/32", "fd00:ec2::254/128"]


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


def make_policy(**egress: Any) -> Policy:
    return parse_policy({"egress": egress}, env={})


def passed(policy: Policy, host: str, port: int) -> NamePass:
    result = decide_name(policy, parse_target(host, port))
    assert isinstance(result, NamePass), result
    return result


def decide(
    policy: Policy,
    host: str,
    port: int,
    addresses: Sequence[str],
    *,
    names: Sequence[str] = (),
    self_endpoints: SelfEndpoints = NO_SELF,
) -> Decision:
    """Name rules then address checks, as egress.check does after resolving."""
    result = decide_name(policy, parse_target(host, port))
    if isinstance(result, Decision):
        return result
    return decide_addresses(
        policy,
        result,
        [ip(a) for a in addresses],
        names=names,
        self_endpoints=self_endpoints,
    )


# -- parse_target and bad_target --------------------------------------------------------


def test_parse_target_normalizes() -> None:
    target = parse_target("PyPI.org.", 443)
    assert target == Target(target.host, 443)
    assert target.host.text == "pypi.org"
    assert target.host.ip is None
    assert parse_target("straße.de", "80").host.text == "xn--strae-oqa.de"
    v6 = parse_target("[2001:DB8::1]", "443")
    assert (v6.host.text, v6.host.ip, v6.port) == ("2001:db8::1", ip("2001:db8::1"), 443)
    assert parse_target("10.0.0.1", 1).host.ip == ip("10.0.0.1")


def test_parse_target_cache_is_transparent() -> None:
    first = parse_target("PyPI.org.", 443)
    again = parse_target("PyPI.org.", 80)
    assert first.host == again.host
    assert (first.port, again.port) == (443, 80)
    # errors are raised every time, never remembered as a host
    for _ in range(3):
        with pytest.raises(HostError):
            parse_target("127.1", 443)


@pytest.mark.parametrize(
    ("host", "port", "reason"),
    [
        ("", 443, Reason.BAD_HOST),
        ("a b", 443, Reason.BAD_HOST),
        ("127.1", 443, Reason.BAD_HOST),
        ("[fe80::1%eth0]", 443, Reason.BAD_HOST),
        ("pypi.org", 0, Reason.BAD_PORT),
        ("pypi.org", 65536, Reason.BAD_PORT),
        ("pypi.org", -1, Reason.BAD_PORT),
        ("pypi.org", "", Reason.BAD_PORT),
        ("pypi.org", "https", Reason.BAD_PORT),
        ("pypi.org", "0443x", Reason.BAD_PORT),
    ],
)
def test_parse_target_errors(host: str, port: int | str, reason: Reason) -> None:
    with pytest.raises(HostError) as info:
        parse_target(host, port)
    assert info.value.reason is reason


def test_bad_target_decisions() -> None:
    host_error = HostError(Reason.BAD_HOST, "bad host: empty host")
    decision = bad_target(host_error, 443)
    assert decision.verdict is Verdict.DENY
    assert decision.reason is Reason.BAD_HOST
    assert decision.host == INVALID_HOST_TEXT
    assert decision.port == 443
    assert decision.addresses == ()
    assert decision.rule is None
    assert decision.detail == "bad host: empty host"
    assert not decision.allowed
    # A port that is not a valid number is never echoed.
    assert bad_target(host_error, "443").port == 0
    assert bad_target(host_error, 70000).port == 0
    port_error = HostError(Reason.BAD_PORT, "bad port")
    assert bad_target(port_error, 443).port == 0
    assert bad_target(port_error, 443).reason is Reason.BAD_PORT


# -- name rules -------------------------------------------------------------------------


def test_no_policy_denies_everything() -> None:
    for host, port in [("pypi.org", 443), ("10.0.0.1", 22), ("[::1]", 80)]:
        decision = decide_name(None, parse_target(host, port))
        assert isinstance(decision, Decision)
        assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.NO_POLICY)
        assert decision.addresses == ()


def test_empty_allow_list_is_no_allow_rule() -> None:
    decision = decide_name(make_policy(), parse_target("pypi.org", 443))
    assert isinstance(decision, Decision)
    assert decision.reason is Reason.NO_ALLOW_RULE
    assert decision.detail == "no allow entry matches the name pypi.org:443"


def test_allow_match_passes_with_its_rule() -> None:
    result = passed(make_policy(allow=["pypi.org:443"]), "PYPI.org.", 443)
    assert result.rule is not None
    assert result.rule.text == "pypi.org:443"
    assert result.would_deny is None
    assert result.target.host.text == "pypi.org"


@pytest.mark.parametrize(
    ("allow", "host", "port", "admitted"),
    [
        (["pypi.org"], "pypi.org", 1, True),
        (["pypi.org"], "pypi.org", 65535, True),
        (["pypi.org:443"], "pypi.org", 443, True),
        (["pypi.org:443"], "pypi.org", 80, False),
        (["pypi.org"], "www.pypi.org", 443, False),
        (["*.example.com"], "a.example.com", 443, True),
        (["*.example.com"], "a.b.c.example.com", 443, True),
        (["*.example.com"], "example.com", 443, False),
        (["*.example.com"], "notexample.com", 443, False),
        (["*.example.com:443"], "a.example.com", 80, False),
        (["Pypi.ORG."], "pypi.org", 443, True),
        (["straße.de"], "xn--strae-oqa.de", 443, True),
        (["xn--strae-oqa.de"], "straße.de", 443, True),
        (["straße.de"], "strasse.de", 443, False),
        (["10.1.2.3"], "10.1.2.3", 443, True),
        (["10.8.0.0/16:443"], "10.8.1.1", 443, True),
        (["10.8.0.0/16:443"], "10.8.1.1", 80, False),
        (["[2001:db8::/32]:443"], "[2001:db8::5]", 443, True),
        (["[2001:db8::1]"], "2001:db8:0::1", 22, True),
        # a name never admits an IP literal
        (["pypi.org", "*.example.com", {"host": "*", "broad": True}], "151.101.0.223", 443, False),
        (["*.example.com"], "[2001:db8::1]", 443, False),
        # an IPv4 entry never admits the IPv6 form of the address
        (["10.1.2.3"], "[::ffff:10.1.2.3]", 443, False),
        (["10.0.0.0/8"], "::ffff:10.1.2.3", 443, False),
        (["10.0.0.0/8"], "64:ff9b::a01:203", 443, False),
        # allow_cidrs never admits a destination by itself
        ([], "10.1.2.3", 443, False),
    ],
)
def test_name_rules(allow: list[Any], host: str, port: int, admitted: bool) -> None:
    policy = make_policy(allow=allow, allow_cidrs=["10.0.0.0/8"])
    result = decide_name(policy, parse_target(host, port))
    if admitted:
        assert isinstance(result, NamePass)
    else:
        assert isinstance(result, Decision)
        assert result.reason is Reason.NO_ALLOW_RULE
        assert result.verdict is Verdict.DENY


def test_ip_literal_miss_explains_itself() -> None:
    decision = decide_name(make_policy(allow=["pypi.org"]), parse_target("[2001:db8::1]", 443))
    assert isinstance(decision, Decision)
    assert decision.detail == (
        "no allow entry matches the IP address [2001:db8::1]:443"
        " (a name entry never admits an IP literal)"
    )


@pytest.mark.parametrize(
    ("allow", "deny", "host", "port"),
    [
        (["pypi.org"], ["pypi.org"], "pypi.org", 443),
        (["*.example.com"], ["bad.example.com"], "bad.example.com", 443),
        (["*.example.com"], ["*.bad.example.com"], "x.bad.example.com", 443),
        (["api.example.com"], ["*.example.com"], "api.example.com", 443),
        (["api.example.com:443"], ["api.example.com:443"], "api.example.com", 443),
        (["10.1.2.3"], ["10.0.0.0/8"], "10.1.2.3", 443),
        (["10.0.0.0/8"], ["10.1.2.3:22"], "10.1.2.3", 22),
        (["[2001:db8::/32]"], ["[2001:db8::1]"], "2001:db8::1", 443),
        (["pypi.org"], [{"host": "*", "broad": True}], "pypi.org", 443),
        (["pypi.org"], ["Pypi.ORG."], "pypi.org", 443),
    ],
)
def test_deny_beats_allow(allow: list[Any], deny: list[Any], host: str, port: int) -> None:
    decision = decide_name(make_policy(allow=allow, deny=deny), parse_target(host, port))
    assert isinstance(decision, Decision)
    assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.DENY_RULE)
    assert decision.rule is not None
    assert decision.addresses == ()


def test_deny_rule_decision_fields() -> None:
    policy = make_policy(allow=["*.example.com"], deny=["*.bad.example.com:443"])
    decision = decide_name(policy, parse_target("X.Bad.Example.com", 443))
    assert decision == Decision(
        Verdict.DENY,
        Reason.DENY_RULE,
        "x.bad.example.com",
        443,
        (),
        "*.bad.example.com:443",
        "x.bad.example.com:443 matches deny entry *.bad.example.com:443",
    )
    # The port-specific deny entry leaves other ports to the allow entry.
    assert isinstance(decide_name(policy, parse_target("x.bad.example.com", 80)), NamePass)


def test_report_mode_name_rules() -> None:
    policy = make_policy(allow=["pypi.org:443"], deny=["*.internal"], mode="report")
    miss = decide_name(policy, parse_target("evil.example", 443))
    assert isinstance(miss, NamePass)
    assert miss.rule is None
    assert miss.would_deny is Reason.NO_ALLOW_RULE
    literal = decide_name(policy, parse_target("8.8.8.8", 53))
    assert isinstance(literal, NamePass)
    assert literal.would_deny is Reason.NO_ALLOW_RULE
    hit = decide_name(policy, parse_target("pypi.org", 443))
    assert isinstance(hit, NamePass)
    assert hit.would_deny is None
    # deny entries stay enforced
    denied = decide_name(policy, parse_target("db.internal", 443))
    assert isinstance(denied, Decision)
    assert (denied.verdict, denied.reason) == (Verdict.DENY, Reason.DENY_RULE)


# -- every address ----------------------------------------------------------------------

PUBLIC_V4 = "151.101.0.223"
PUBLIC_V6 = "2a04:4e42::223"


def test_allowed_decision_carries_pinned_addresses() -> None:
    policy = make_policy(allow=["pypi.org:443"], deny_cidrs=METADATA)
    decision = decide(policy, "pypi.org", 443, [PUBLIC_V4, PUBLIC_V6, PUBLIC_V4])
    assert decision == Decision(
        Verdict.ALLOW,
        Reason.ALLOWED,
        "pypi.org",
        443,
        (ip(PUBLIC_V4), ip(PUBLIC_V6)),  # deduplicated, order kept
        "pypi.org:443",
        "allowed by pypi.org:443",
    )
    assert decision.allowed


def test_ip_literal_allowed() -> None:
    policy = make_policy(allow=["1.1.1.1:53", "[2606:4700::/32]:443"])
    assert decide(policy, "1.1.1.1", 53, ["1.1.1.1"]).reason is Reason.ALLOWED
    decision = decide(policy, "[2606:4700::1111]", 443, ["2606:4700::1111"])
    assert decision.reason is Reason.ALLOWED
    assert decision.rule == "[2606:4700::/32]:443"


def test_no_addresses_is_dns_failure() -> None:
    policy = make_policy(allow=["pypi.org"])
    decision = decide(policy, "pypi.org", 443, [])
    assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.DNS_FAILURE)
    assert decision.rule == "pypi.org"


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        # private_address: RFC 1918, ULA, CGNAT, site-local, loopback, link-local
        ("10.0.0.1", Reason.PRIVATE_ADDRESS),
        ("172.16.0.1", Reason.PRIVATE_ADDRESS),
        ("172.31.255.255", Reason.PRIVATE_ADDRESS),
        ("192.168.1.1", Reason.PRIVATE_ADDRESS),
        ("fd12:3456::1", Reason.PRIVATE_ADDRESS),
        ("100.64.0.1", Reason.PRIVATE_ADDRESS),
        ("100.127.255.255", Reason.PRIVATE_ADDRESS),
        ("fec0::1", Reason.PRIVATE_ADDRESS),
        ("127.0.0.1", Reason.PRIVATE_ADDRESS),
        ("127.255.255.254", Reason.PRIVATE_ADDRESS),
        ("::1", Reason.PRIVATE_ADDRESS),
        ("169.254.1.1", Reason.PRIVATE_ADDRESS),
        ("fe80::1", Reason.PRIVATE_ADDRESS),
        # special_address: everything else that is not global unicast
        ("0.0.0.0", Reason.SPECIAL_ADDRESS),
        ("0.1.2.3", Reason.SPECIAL_ADDRESS),
        ("::", Reason.SPECIAL_ADDRESS),
        ("224.0.0.1", Reason.SPECIAL_ADDRESS),
        ("239.255.255.255", Reason.SPECIAL_ADDRESS),
        ("ff02::1", Reason.SPECIAL_ADDRESS),
        ("240.0.0.1", Reason.SPECIAL_ADDRESS),
        ("255.255.255.255", Reason.SPECIAL_ADDRESS),
        ("192.0.2.1", Reason.SPECIAL_ADDRESS),
        ("198.51.100.1", Reason.SPECIAL_ADDRESS),
        ("203.0.113.1", Reason.SPECIAL_ADDRESS),
        ("2001:db8::1", Reason.SPECIAL_ADDRESS),
        ("198.18.0.1", Reason.SPECIAL_ADDRESS),
        ("192.0.0.8", Reason.SPECIAL_ADDRESS),
        ("100::1", Reason.SPECIAL_ADDRESS),
        ("4000::1", Reason.SPECIAL_ADDRESS),
        # IPv6 forms wrapping an IPv4 address are special themselves ...
        ("::ffff:8.8.8.8", Reason.SPECIAL_ADDRESS),
        ("::8.8.8.8", Reason.SPECIAL_ADDRESS),
        # ... or judged by the IPv4 address they carry
        ("64:ff9b::a00:1", Reason.PRIVATE_ADDRESS),  # NAT64 of 10.0.0.1
        ("64:ff9b::7f00:1", Reason.PRIVATE_ADDRESS),  # NAT64 of 127.0.0.1
        ("64:ff9b::c000:201", Reason.SPECIAL_ADDRESS),  # NAT64 of 192.0.2.1
        ("2002:a00:1::1", Reason.PRIVATE_ADDRESS),  # 6to4 of 10.0.0.1
        ("2002:7f00:1::1", Reason.PRIVATE_ADDRESS),  # 6to4 of 127.0.0.1
        ("2001:0:808:808::5601:fefe", Reason.PRIVATE_ADDRESS),  # Teredo client 169.254.1.1
    ],
)
def test_special_ranges_are_denied(address: str, reason: Reason) -> None:
    policy = make_policy(allow=["app.example.com"])
    decision = decide(policy, "app.example.com", 443, [address])
    assert (decision.verdict, decision.reason) == (Verdict.DENY, reason)
    assert decision.addresses == (ip(address),)
    assert decision.rule == "app.example.com"
    assert "to admit it, add a covering egress.allow_cidrs entry" in decision.detail


@pytest.mark.parametrize(
    "address",
    [
        "8.8.8.8",
        "1.1.1.1",
        "100.63.255.255",  # just below CGNAT
        "100.128.0.0",  # just above CGNAT
        "172.15.255.255",
        "172.32.0.0",
        "2606:4700::1111",
        "64:ff9b::808:808",  # NAT64 of 8.8.8.8
        "2002:808:808::1",  # 6to4 of 8.8.8.8
    ],
)
def test_global_addresses_are_allowed(address: str) -> None:
    decision = decide(make_policy(allow=["app.example.com"]), "app.example.com", 443, [address])
    assert decision.reason is Reason.ALLOWED


def test_mixed_answer_denies_the_name() -> None:
    policy = make_policy(allow=["app.example.com"])
    decision = decide(policy, "app.example.com", 443, [PUBLIC_V4, "10.0.0.1", PUBLIC_V6])
    assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.PRIVATE_ADDRESS)
    assert decision.addresses == (ip(PUBLIC_V4), ip("10.0.0.1"), ip(PUBLIC_V6))
    assert decision.detail.startswith("10.0.0.1 is in 10.0.0.0/8, private use (RFC 1918)")
    # ... whatever the order of the answer
    decision = decide(policy, "app.example.com", 443, ["127.0.0.1", PUBLIC_V4])
    assert decision.reason is Reason.PRIVATE_ADDRESS


def test_private_flag_lifts_private_like_ranges_only() -> None:
    policy = make_policy(allow=[{"host": "db.corp:5432", "private": True}])
    for address in ("10.1.2.3", "172.16.5.4", "192.168.0.9", "fd12::9", "100.64.1.1", "fec0::9"):
        decision = decide(policy, "db.corp", 5432, [address])
        assert decision.reason is Reason.ALLOWED, address
        assert decision.rule == "db.corp:5432"
    for address in ("127.0.0.1", "::1", "169.254.1.1", "fe80::1"):
        assert decide(policy, "db.corp", 5432, [address]).reason is Reason.PRIVATE_ADDRESS
    for address in ("224.0.0.1", "192.0.2.1", "0.0.0.0", "::ffff:10.1.2.3"):
        assert decide(policy, "db.corp", 5432, [address]).reason is Reason.SPECIAL_ADDRESS


def test_private_flag_is_per_rule() -> None:
    policy = make_policy(allow=[{"host": "db.corp", "private": True}, "web.corp"])
    assert decide(policy, "db.corp", 443, ["10.0.0.1"]).reason is Reason.ALLOWED
    assert decide(policy, "web.corp", 443, ["10.0.0.1"]).reason is Reason.PRIVATE_ADDRESS


def test_private_flag_on_ip_literal() -> None:
    policy = make_policy(allow=[{"host": "10.1.2.3:5432", "private": True}, "10.1.2.4:5432"])
    assert decide(policy, "10.1.2.3", 5432, ["10.1.2.3"]).reason is Reason.ALLOWED
    assert decide(policy, "10.1.2.4", 5432, ["10.1.2.4"]).reason is Reason.PRIVATE_ADDRESS


def test_allow_private_lifts_private_like_ranges_policy_wide() -> None:
    policy = make_policy(allow=["a.corp", "10.1.2.3"], allow_private=True)
    for address in ("10.1.2.3", "192.168.0.9", "fd12::9", "100.64.1.1", "fec0::9"):
        assert decide(policy, "a.corp", 80, [address]).reason is Reason.ALLOWED, address
    assert decide(policy, "10.1.2.3", 80, ["10.1.2.3"]).reason is Reason.ALLOWED
    for address in ("127.0.0.1", "::1", "169.254.1.1", "fe80::1"):
        assert decide(policy, "a.corp", 80, [address]).reason is Reason.PRIVATE_ADDRESS
    assert decide(policy, "a.corp", 80, ["224.0.0.1"]).reason is Reason.SPECIAL_ADDRESS


def test_allow_cidrs_lift_any_range_for_allowed_names() -> None:
    policy = make_policy(
        allow=["local.test", "10.1.2.3", "[::1]"],
        allow_cidrs=["127.0.0.0/8", "::1/128", "10.0.0.0/8", "169.254.0.0/16", "192.0.2.0/24"],
    )
    for address in ("127.0.0.1", "::1", "10.9.9.9", "169.254.1.1", "192.0.2.7"):
        assert decide(policy, "local.test", 80, [address]).reason is Reason.ALLOWED, address
    assert decide(policy, "10.1.2.3", 80, ["10.1.2.3"]).reason is Reason.ALLOWED
    assert decide(policy, "[::1]", 80, ["::1"]).reason is Reason.ALLOWED
    # Outside the granted ranges the ban stays.
    assert decide(policy, "local.test", 80, ["192.168.1.1"]).reason is Reason.PRIVATE_ADDRESS
    assert decide(policy, "local.test", 80, ["fe80::1"]).reason is Reason.PRIVATE_ADDRESS


def test_allow_cidrs_never_admit_by_themselves() -> None:
    policy = make_policy(allow=["pypi.org"], allow_cidrs=["10.0.0.0/8", "127.0.0.0/8"])
    for host in ("10.1.2.3", "127.0.0.1", "other.example"):
        decision = decide(policy, host, 80, ["10.1.2.3"])
        assert decision.reason is Reason.NO_ALLOW_RULE, host


def test_ipv4_allow_cidrs_never_lift_ipv6_wrappers() -> None:
    policy = make_policy(
        allow=["app.example.com"], allow_cidrs=["10.0.0.0/8", "127.0.0.0/8"], allow_private=True
    )
    # The embedded IPv4 is inside allow_cidrs, but the wrapper is judged on its own.
    for wrapped, reason in [
        ("::ffff:10.1.2.3", Reason.SPECIAL_ADDRESS),
        ("::ffff:127.0.0.1", Reason.SPECIAL_ADDRESS),
        ("::10.1.2.3", Reason.SPECIAL_ADDRESS),
        ("64:ff9b::7f00:1", Reason.PRIVATE_ADDRESS),
        ("2002:7f00:1::1", Reason.PRIVATE_ADDRESS),
    ]:
        decision = decide(policy, "app.example.com", 80, [wrapped])
        assert decision.reason is reason, wrapped
    # An IPv6 entry for the wrapped form itself does lift the wrapper's ban.
    policy = make_policy(allow=["app.example.com"], allow_cidrs=["::ffff:10.0.0.0/104"])
    assert decide(policy, "app.example.com", 80, ["::ffff:10.1.2.3"]).reason is Reason.ALLOWED


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254",
        "fd00:ec2::254",
        "::ffff:169.254.169.254",  # IPv4-mapped
        "::169.254.169.254",  # IPv4-compatible
        "::ffff:0:a9fe:a9fe",  # IPv4-translated
        "64:ff9b::a9fe:a9fe",  # NAT64 well-known prefix
        "64:ff9b:1::a9fe:a9fe",  # NAT64 local-use prefix
        "2002:a9fe:a9fe::1",  # 6to4
        "2001:0:808:808::5601:5601",  # Teredo, client address inverted
    ],
)
def test_deny_cidrs_see_embedded_ipv4(address: str) -> None:
    policy = make_policy(allow=["app.example.com"], deny_cidrs=METADATA)
    decision = decide(policy, "app.example.com", 80, [PUBLIC_V4, address])
    assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.DENY_CIDR)
    assert decision.detail.startswith(canonical_ip_text(ip(address)))
    assert "is inside deny_cidrs entry" in decision.detail


def test_deny_cidrs_beat_everything() -> None:
    policy = make_policy(
        allow=[{"host": "db.corp", "private": True}, "1.2.3.4", "app.example.com"],
        allow_cidrs=["169.254.0.0/16", "10.0.0.0/8"],
        deny_cidrs=["169.254.169.254/32", "10.9.0.0/16", "1.2.3.0/24", "8.8.8.8/32"],
        allow_private=True,
    )
    assert decide(policy, "db.corp", 80, ["169.254.169.254"]).reason is Reason.DENY_CIDR
    assert decide(policy, "db.corp", 80, ["169.254.1.1"]).reason is Reason.ALLOWED
    assert decide(policy, "db.corp", 80, ["10.9.1.1"]).reason is Reason.DENY_CIDR
    assert decide(policy, "db.corp", 80, ["10.8.1.1"]).reason is Reason.ALLOWED
    assert decide(policy, "1.2.3.4", 80, ["1.2.3.4"]).reason is Reason.DENY_CIDR
    assert decide(policy, "app.example.com", 80, ["8.8.8.8"]).reason is Reason.DENY_CIDR
    decision = decide(policy, "app.example.com", 80, ["8.8.8.8"])
    assert decision.rule == "app.example.com"
    assert decision.detail == "8.8.8.8 is inside deny_cidrs entry 8.8.8.8/32"


def test_cname_chain_against_deny_entries() -> None:
    policy = make_policy(allow=["*.example.com"], deny=["*.internal", "evil.example.net:443"])
    decision = decide(
        policy,
        "a.example.com",
        443,
        [PUBLIC_V4],
        names=["a.example.com", "b.example.com", "db.internal"],
    )
    assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.DENY_RULE)
    assert decision.rule == "*.internal"
    assert decision.addresses == (ip(PUBLIC_V4),)
    assert decision.detail == (
        "a.example.com is an alias of db.internal, which matches deny entry *.internal"
    )
    # A port-specific deny entry applies to its port only.
    names = ["a.example.com", "evil.example.net"]
    assert decide(policy, "a.example.com", 443, [PUBLIC_V4], names=names).reason is (
        Reason.DENY_RULE
    )
    assert decide(policy, "a.example.com", 80, [PUBLIC_V4], names=names).reason is (Reason.ALLOWED)
    # CNAME targets need no allow entry of their own.
    names = ["a.example.com", "cdn.provider.net"]
    assert decide(policy, "a.example.com", 443, [PUBLIC_V4], names=names).reason is (Reason.ALLOWED)


# -- cloud metadata endpoints ----------------------------------------------------------

METADATA_ADDRESSES = [str(entry.network.network_address) for entry in METADATA_ENDPOINTS]
# Every broad grant there is, each covering every endpoint in the table.
BROAD_CIDRS = [
    "169.254.0.0/16",
    "100.64.0.0/10",
    "168.63.129.16/32",
    "192.0.0.0/24",
    "192.0.0.192/32",
    "fd00:ec2::/32",
    "fd00:ec2::254/128",
    "fd00:a9fe::/32",
    "fd00:42::/32",
    "fd20:ce::/32",
    "fe80::/64",
]
BROAD_ENTRIES = [
    "meta.test",
    {"host": "private.test", "private": True},
    "*.cloud.test",
    "169.254.0.0/16",
    "100.64.0.0/10",
    "168.63.129.16/32",
    "192.0.0.192/32",
    "[fd00:ec2::/32]",
    "[fd00:a9fe::/32]",
    "[fd00:42::/32]",
    "[fd20:ce::/32]",
    "[fe80::/64]",
]


def literal(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def broad_policy(**extra: Any) -> Policy:
    return make_policy(allow=BROAD_ENTRIES, allow_cidrs=BROAD_CIDRS, allow_private=True, **extra)


@pytest.mark.parametrize("address", METADATA_ADDRESSES)
def test_metadata_is_denied_under_every_broad_grant(address: str) -> None:
    policy = broad_policy()
    # A name that resolves to it, alone or among public addresses; with private = true too.
    for host in ("meta.test", "private.test", "a.cloud.test"):
        for answer in ([address], [PUBLIC_V4, address], [address, PUBLIC_V6]):
            decision = decide(policy, host, 443, answer)
            assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.METADATA_ADDRESS)
            assert decision.addresses == tuple(ip(a) for a in answer)
    # The IP literal itself, admitted by a CIDR allow entry (even a /32 one).
    decision = decide(policy, literal(address), 80, [address])
    assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.METADATA_ADDRESS)
    assert decision.rule is not None and "/" in decision.rule
    assert "a cloud metadata endpoint" in decision.detail


@pytest.mark.parametrize("address", METADATA_ADDRESSES)
def test_allow_cidrs_equal_to_the_endpoint_do_not_lift_it(address: str) -> None:
    cidr = f"{address}/{128 if ':' in address else 32}"
    policy = make_policy(allow=["meta.test"], allow_cidrs=[cidr])
    assert decide(policy, "meta.test", 80, [address]).reason is Reason.METADATA_ADDRESS
    # The same grant still lifts the ban for an ordinary neighbour.
    policy = make_policy(allow=["meta.test"], allow_cidrs=["169.254.0.0/16", "fd00::/32"])
    assert decide(policy, "meta.test", 80, ["169.254.1.1"]).reason is Reason.ALLOWED
    assert decide(policy, "meta.test", 80, ["fd00::1"]).reason is Reason.ALLOWED


@pytest.mark.parametrize("address", METADATA_ADDRESSES)
def test_only_an_exact_ip_entry_admits_metadata(address: str) -> None:
    policy = make_policy(allow=[literal(address), "meta.test"])
    decision = decide(policy, literal(address), 80, [address])
    assert (decision.verdict, decision.reason) == (Verdict.ALLOW, Reason.ALLOWED)
    assert decision.rule == literal(address)
    assert decision.addresses == (ip(address),)
    # No allow_cidrs or allow_private is needed for it, and the entry admits no name.
    assert decide(policy, "meta.test", 80, [address]).reason is Reason.METADATA_ADDRESS
    # Exact under the broad grants too.
    policy = broad_policy()
    exact = make_policy(
        allow=[*BROAD_ENTRIES, literal(address)], allow_cidrs=BROAD_CIDRS, allow_private=True
    )
    assert decide(policy, literal(address), 80, [address]).reason is Reason.METADATA_ADDRESS
    assert decide(exact, literal(address), 80, [address]).reason is Reason.ALLOWED


def test_the_exact_entry_keeps_its_port() -> None:
    policy = make_policy(allow=["169.254.169.254:80", "169.254.0.0/16"], allow_private=True)
    decision = decide(policy, "169.254.169.254", 80, ["169.254.169.254"])
    assert (decision.reason, decision.rule) == (Reason.ALLOWED, "169.254.169.254:80")
    # Port 443 is matched by the CIDR entry only: not an exact grant.
    decision = decide(policy, "169.254.169.254", 443, ["169.254.169.254"])
    assert (decision.reason, decision.rule) == (Reason.METADATA_ADDRESS, "169.254.0.0/16")
    policy = make_policy(allow=["[fd00:ec2::254]:80"])
    assert decide(policy, "[fd00:ec2::254]", 80, ["fd00:ec2::254"]).reason is Reason.ALLOWED
    assert decide(policy, "[fd00:ec2::254]", 81, ["fd00:ec2::254"]).reason is (Reason.NO_ALLOW_RULE)


@pytest.mark.parametrize(
    "wrapped",
    [
        "::ffff:169.254.169.254",  # IPv4-mapped
        "::169.254.169.254",  # IPv4-compatible
        "::ffff:0:a9fe:a9fe",  # IPv4-translated
        "64:ff9b::a9fe:a9fe",  # NAT64
        "64:ff9b:1::a9fe:a9fe",  # local-use NAT64
        "2002:a9fe:a9fe::1",  # 6to4
        "2001:0:808:808::5601:5601",  # Teredo client
        "::ffff:100.100.100.200",
        "64:ff9b::6464:64c8",  # NAT64 of 100.100.100.200
        "2002:a83f:8110::1",  # 6to4 of 168.63.129.16
    ],
)
def test_metadata_behind_ipv6_wrappers(wrapped: str) -> None:
    # Even a grant for the wrapper itself and an exact entry for it: the
    # embedded endpoint is never named exactly, so it stays denied.
    policy = make_policy(
        allow=["meta.test", literal(wrapped), "169.254.169.254", "100.100.100.200"],
        allow_cidrs=[
            "::/96",
            "::ffff:0:0/96",
            "::ffff:0:0:0/96",
            "64:ff9b::/96",
            "64:ff9b:1::/48",
            {"cidr": "2002::/16", "broad": True},
            "2001::/32",
        ],
        allow_private=True,
    )
    for host in ("meta.test", literal(wrapped)):
        decision = decide(policy, host, 80, [wrapped])
        assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.METADATA_ADDRESS)
        assert "(it carries " in decision.detail


def test_metadata_detail() -> None:
    decision = decide(broad_policy(), "meta.test", 80, ["169.254.169.254"])
    assert decision.detail == (
        "169.254.169.254 is a cloud metadata endpoint (instance metadata service of AWS, GCP,"
        " Azure, OCI...); only an allow entry naming exactly that address, asked for as that"
        " IP literal, admits it (allow_cidrs, allow_private, CIDR entries and names never do)"
    )
    decision = decide(broad_policy(), "meta.test", 80, ["64:ff9b::6464:64c8"])
    assert decision.detail.startswith(
        "64:ff9b::6464:64c8 (it carries 100.100.100.200) is a cloud metadata endpoint"
        " (Alibaba Cloud ECS instance metadata)"
    )


def test_deny_cidrs_and_deny_entries_beat_an_exact_metadata_entry() -> None:
    policy = make_policy(allow=["169.254.169.254"], deny_cidrs=["169.254.169.254/32"])
    assert decide(policy, "169.254.169.254", 80, ["169.254.169.254"]).reason is Reason.DENY_CIDR
    policy = make_policy(allow=["169.254.169.254"], deny=["169.254.0.0/16"])
    assert decide(policy, "169.254.169.254", 80, ["169.254.169.254"]).reason is Reason.DENY_RULE


def test_check_order_self_then_metadata_then_ranges() -> None:
    endpoints = SelfEndpoints(endpoints=frozenset({(ip("169.254.169.254"), 80)}))
    policy = make_policy(allow_private=True)
    refusal = check_address(policy, ip("169.254.169.254"), 80, None, endpoints)
    assert refusal is not None and refusal.reason is Reason.SELF_CONNECTION
    refusal = check_address(policy, ip("169.254.169.254"), 81, None, endpoints)
    assert refusal is not None and refusal.reason is Reason.METADATA_ADDRESS
    # The metadata class outranks a wrapper's own special_address ban.
    refusal = check_address(policy, ip("::ffff:169.254.169.254"), 81, None, endpoints)
    assert refusal is not None and refusal.reason is Reason.METADATA_ADDRESS


# -- the proxy's own listeners ----------------------------------------------------------

LISTENERS = SelfEndpoints(
    endpoints=frozenset({(ip("127.0.0.1"), 8080), (ip("::1"), 1080)}),
)
WILDCARD = SelfEndpoints(
    endpoints=frozenset({(ip("0.0.0.0"), 3128)}),
    wildcard_ports=frozenset({3128}),
    local_addresses=frozenset({ip("192.168.1.5"), ip("2001:db8::5")}),
)


@pytest.mark.parametrize(
    ("endpoints", "address", "port", "expected"),
    [
        (LISTENERS, "127.0.0.1", 8080, True),
        (LISTENERS, "::ffff:127.0.0.1", 8080, True),
        (LISTENERS, "0.0.0.0", 8080, True),
        (LISTENERS, "::", 8080, True),
        (LISTENERS, "::1", 1080, True),
        (LISTENERS, "0.0.0.0", 1080, True),
        (LISTENERS, "127.0.0.1", 8081, False),
        (LISTENERS, "127.0.0.2", 8080, False),
        (LISTENERS, "::1", 8080, False),
        (LISTENERS, "127.0.0.1", 1080, False),
        (LISTENERS, "0.0.0.0", 9999, False),
        (LISTENERS, "8.8.8.8", 8080, False),
        (WILDCARD, "127.0.0.1", 3128, True),
        (WILDCARD, "127.3.2.1", 3128, True),
        (WILDCARD, "::1", 3128, True),
        (WILDCARD, "::ffff:127.0.0.1", 3128, True),
        (WILDCARD, "0.0.0.0", 3128, True),
        (WILDCARD, "192.168.1.5", 3128, True),
        (WILDCARD, "::ffff:192.168.1.5", 3128, True),
        (WILDCARD, "2001:db8::5", 3128, True),
        (WILDCARD, "192.168.1.6", 3128, False),
        (WILDCARD, "8.8.8.8", 3128, False),
        (WILDCARD, "192.168.1.5", 3129, False),
        (NO_SELF, "127.0.0.1", 8080, False),
    ],
)
def test_self_endpoints(endpoints: SelfEndpoints, address: str, port: int, expected: bool) -> None:
    assert endpoints.contains(ip(address), port) is expected


def test_self_connection_is_denied_even_when_loopback_is_granted() -> None:
    policy = make_policy(
        allow=["localhost", "127.0.0.1", "[::1]", "[::ffff:127.0.0.1]", "0.0.0.0"],
        allow_cidrs=["127.0.0.0/8", "::1/128", "::ffff:127.0.0.0/104", "0.0.0.0/32"],
    )
    for host, address in [
        ("localhost", "127.0.0.1"),
        ("127.0.0.1", "127.0.0.1"),
        ("[::ffff:127.0.0.1]", "::ffff:127.0.0.1"),
        ("0.0.0.0", "0.0.0.0"),
    ]:
        decision = decide(policy, host, 8080, [address], self_endpoints=LISTENERS)
        assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.SELF_CONNECTION)
        assert decision.detail.endswith("port 8080 is this proxy's own listener")
    # Other loopback ports stay reachable under this policy.
    assert decide(policy, "localhost", 5432, ["127.0.0.1"], self_endpoints=LISTENERS).reason is (
        Reason.ALLOWED
    )
    mixed = decide(policy, "localhost", 8080, ["::1", "127.0.0.1"], self_endpoints=LISTENERS)
    assert mixed.reason is Reason.SELF_CONNECTION


def test_self_connection_through_embedded_ipv4() -> None:
    policy = make_policy(allow=["app.example.com"])
    decision = decide(
        policy, "app.example.com", 8080, ["64:ff9b::7f00:1"], self_endpoints=LISTENERS
    )
    assert decision.reason is Reason.SELF_CONNECTION


def test_wildcard_listener_on_a_local_address() -> None:
    policy = make_policy(allow=["me.corp"], allow_private=True)
    decision = decide(policy, "me.corp", 3128, ["192.168.1.5"], self_endpoints=WILDCARD)
    assert decision.reason is Reason.SELF_CONNECTION
    assert decide(policy, "me.corp", 3129, ["192.168.1.5"], self_endpoints=WILDCARD).reason is (
        Reason.ALLOWED
    )


def test_check_order_deny_cidr_then_self_then_ranges() -> None:
    policy = make_policy(allow=["x.test"], deny_cidrs=["127.0.0.1/32"])
    loopback = ip("127.0.0.1")
    refusal = check_address(policy, loopback, 8080, None, LISTENERS)
    assert refusal is not None
    assert refusal[0] is Reason.DENY_CIDR
    refusal = check_address(make_policy(), loopback, 8080, None, LISTENERS)
    assert refusal is not None
    assert refusal[0] is Reason.SELF_CONNECTION
    refusal = check_address(make_policy(), loopback, 8081, None, LISTENERS)
    assert refusal is not None
    assert refusal[0] is Reason.PRIVATE_ADDRESS
    assert check_address(make_policy(), ip(PUBLIC_V4), 8080, None, LISTENERS) is None


def test_range_detail_names_the_carried_address() -> None:
    decision = decide(make_policy(allow=["x.test"]), "x.test", 80, ["64:ff9b::a00:1"])
    assert decision.detail == (
        "64:ff9b::a00:1 (it carries 10.0.0.1) is in 10.0.0.0/8, private use (RFC 1918); to admit"
        " it, add a covering egress.allow_cidrs entry, set allow_private = true, or write the"
        " entry with private = true"
    )
    decision = decide(make_policy(allow=["x.test"]), "x.test", 80, ["127.0.0.1"])
    assert decision.detail == (
        "127.0.0.1 is in 127.0.0.0/8, loopback (RFC 1122); to admit it, add a covering"
        " egress.allow_cidrs entry"
    )


# -- report mode ------------------------------------------------------------------------


def report_policy() -> Policy:
    return make_policy(
        allow=["pypi.org:443"], deny=["*.internal"], deny_cidrs=METADATA, mode="report"
    )


def test_report_mode_miss_becomes_would_deny() -> None:
    decision = decide(report_policy(), "evil.example", 443, [PUBLIC_V4])
    assert decision == Decision(
        Verdict.WOULD_DENY,
        Reason.NO_ALLOW_RULE,
        "evil.example",
        443,
        (ip(PUBLIC_V4),),
        None,
        "report mode: no allow entry matches the name evil.example:443",
    )
    assert decision.allowed
    literal = decide(report_policy(), "8.8.8.8", 53, ["8.8.8.8"])
    assert (literal.verdict, literal.reason) == (Verdict.WOULD_DENY, Reason.NO_ALLOW_RULE)
    assert literal.allowed
    assert literal.addresses == (ip("8.8.8.8"),)


@pytest.mark.parametrize(
    ("host", "port", "addresses", "reason"),
    [
        ("evil.example", 443, ["10.0.0.1"], Reason.PRIVATE_ADDRESS),
        ("evil.example", 443, [PUBLIC_V4, "127.0.0.1"], Reason.PRIVATE_ADDRESS),
        ("evil.example", 443, ["224.0.0.1"], Reason.SPECIAL_ADDRESS),
        ("evil.example", 443, ["169.254.169.254"], Reason.DENY_CIDR),
        ("evil.example", 443, ["64:ff9b::a9fe:a9fe"], Reason.DENY_CIDR),
        ("evil.example", 8080, ["127.0.0.1"], Reason.SELF_CONNECTION),
        ("10.0.0.1", 22, ["10.0.0.1"], Reason.PRIVATE_ADDRESS),
        ("169.254.169.254", 80, ["169.254.169.254"], Reason.DENY_CIDR),
        ("127.0.0.1", 8080, ["127.0.0.1"], Reason.SELF_CONNECTION),
        ("db.internal", 443, [PUBLIC_V4], Reason.DENY_RULE),
        ("pypi.org", 443, ["10.0.0.1"], Reason.PRIVATE_ADDRESS),
        ("evil.example", 443, [], Reason.DNS_FAILURE),
    ],
)
def test_report_mode_keeps_address_checks(
    host: str, port: int, addresses: list[str], reason: Reason
) -> None:
    decision = decide(report_policy(), host, port, addresses, self_endpoints=LISTENERS)
    assert (decision.verdict, decision.reason) == (Verdict.DENY, reason)
    assert not decision.allowed


def test_report_mode_cname_deny_stays_enforced() -> None:
    decision = decide(
        report_policy(), "evil.example", 443, [PUBLIC_V4], names=["evil.example", "x.internal"]
    )
    assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.DENY_RULE)


@pytest.mark.parametrize("address", METADATA_ADDRESSES)
def test_report_mode_keeps_the_metadata_ban(address: str) -> None:
    policy = broad_policy(mode="report")
    # A name miss, an allowed name and an IP literal admitted by no entry or a CIDR entry.
    for host, answer in [
        ("unlisted.example", [address]),
        ("meta.test", [PUBLIC_V4, address]),
        (literal(address), [address]),
    ]:
        decision = decide(policy, host, 80, answer)
        assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.METADATA_ADDRESS)
        assert not decision.allowed
    report = make_policy(allow=["pypi.org"], allow_private=True, mode="report")
    decision = decide(report, literal(address), 80, [address])
    assert (decision.verdict, decision.reason) == (Verdict.DENY, Reason.METADATA_ADDRESS)


def test_decision_allowed_property() -> None:
    for verdict, allowed in [
        (Verdict.ALLOW, True),
        (Verdict.WOULD_DENY, True),
        (Verdict.DENY, False),
    ]:
        assert Decision(verdict, Reason.ALLOWED, "h", 1).allowed is allowed
