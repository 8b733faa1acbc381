"""Policy entries: parse_pattern, RuleSet matching and CidrIndex."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressbox.core.rules import (
    MIN_IPV4_PREFIX,
    MIN_IPV6_PREFIX,
    CidrIndex,
    PatternError,
    Rule,
    RuleKind,
    RuleSet,
    min_prefix,
    parse_network,
    parse_pattern,
)


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def net(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(text)


def rules(*patterns: str) -> RuleSet:
    return RuleSet.build(parse_pattern(p) for p in patterns)


# -- parse_pattern ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "kind", "value", "port", "text"),
    [
        # names: normalized exactly like requests
        ("pypi.org", RuleKind.NAME, "pypi.org", None, "pypi.org"),
        ("pypi.org:443", RuleKind.NAME, "pypi.org", 443, "pypi.org:443"),
        ("Pypi.ORG.", RuleKind.NAME, "pypi.org", None, "pypi.org"),
        ("  pypi.org:443  ", RuleKind.NAME, "pypi.org", 443, "pypi.org:443"),
        ("straße.de", RuleKind.NAME, "xn--strae-oqa.de", None, "xn--strae-oqa.de"),
        ("Straße.de.:80", RuleKind.NAME, "xn--strae-oqa.de", 80, "xn--strae-oqa.de:80"),
        ("xn--strae-oqa.de", RuleKind.NAME, "xn--strae-oqa.de", None, "xn--strae-oqa.de"),
        ("_dmarc.example.com", RuleKind.NAME, "_dmarc.example.com", None, "_dmarc.example.com"),
        ("localhost", RuleKind.NAME, "localhost", None, "localhost"),
        ("db.corp:5432", RuleKind.NAME, "db.corp", 5432, "db.corp:5432"),
        ("a.b:1", RuleKind.NAME, "a.b", 1, "a.b:1"),
        ("a.b:65535", RuleKind.NAME, "a.b", 65535, "a.b:65535"),
        # wildcards: the value is the suffix without "*."
        ("*.example.com", RuleKind.WILDCARD, "example.com", None, "*.example.com"),
        ("*.Example.COM.:443", RuleKind.WILDCARD, "example.com", 443, "*.example.com:443"),
        ("*.com", RuleKind.WILDCARD, "com", None, "*.com"),
        ("*.bücher.de", RuleKind.WILDCARD, "xn--bcher-kva.de", None, "*.xn--bcher-kva.de"),
        ("*", RuleKind.ANY_NAME, "*", None, "*"),
        ("*:443", RuleKind.ANY_NAME, "*", 443, "*:443"),
        # IP literals: canonical text, IPv6 in brackets when a port follows
        ("10.1.2.3", RuleKind.IP, "10.1.2.3", None, "10.1.2.3"),
        ("10.1.2.3:5432", RuleKind.IP, "10.1.2.3", 5432, "10.1.2.3:5432"),
        ("[2001:db8::1]:443", RuleKind.IP, "2001:db8::1", 443, "[2001:db8::1]:443"),
        ("[2001:DB8:0::1]", RuleKind.IP, "2001:db8::1", None, "[2001:db8::1]"),
        ("2001:db8:0:0::1", RuleKind.IP, "2001:db8::1", None, "[2001:db8::1]"),
        ("::1", RuleKind.IP, "::1", None, "[::1]"),
        ("[::1]:22", RuleKind.IP, "::1", 22, "[::1]:22"),
        ("[::ffff:10.0.0.1]", RuleKind.IP, "::ffff:10.0.0.1", None, "[::ffff:10.0.0.1]"),
        # CIDRs, v4 and v6, with and without ports
        ("10.0.0.0/8", RuleKind.CIDR, "10.0.0.0/8", None, "10.0.0.0/8"),
        ("10.8.0.0/16:443", RuleKind.CIDR, "10.8.0.0/16", 443, "10.8.0.0/16:443"),
        ("1.2.3.4/32", RuleKind.CIDR, "1.2.3.4/32", None, "1.2.3.4/32"),
        ("2001:db8::/32", RuleKind.CIDR, "2001:db8::/32", None, "2001:db8::/32"),
        ("[2001:db8::/32]", RuleKind.CIDR, "2001:db8::/32", None, "2001:db8::/32"),
        ("[2001:db8::/32]:443", RuleKind.CIDR, "2001:db8::/32", 443, "[2001:db8::/32]:443"),
        ("[2001:DB8:0::/48]:80", RuleKind.CIDR, "2001:db8::/48", 80, "[2001:db8::/48]:80"),
        ("0.0.0.0/0", RuleKind.CIDR, "0.0.0.0/0", None, "0.0.0.0/0"),
    ],
)
def test_parse_pattern(
    pattern: str, kind: RuleKind, value: str, port: int | None, text: str
) -> None:
    rule = parse_pattern(pattern)
    assert (rule.kind, rule.value, rule.port, rule.text) == (kind, value, port, text)
    assert rule.private is False
    assert rule.broad is False
    # The canonical text parses back to the same rule.
    assert parse_pattern(rule.text) == rule


def test_parse_pattern_network_field() -> None:
    assert parse_pattern("10.8.0.0/16:443").network == net("10.8.0.0/16")
    assert parse_pattern("[2001:db8::/32]:443").network == net("2001:db8::/32")
    assert parse_pattern("10.1.2.3").network is None
    assert parse_pattern("pypi.org").network is None


def test_parse_pattern_flags() -> None:
    rule = parse_pattern("db.corp:5432", private=True)
    assert rule.private is True
    assert rule.broad is False
    rule = parse_pattern("*.com", broad=True)
    assert rule.broad is True
    assert rule.private is False


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("", "empty pattern; write a host name, *.suffix, IP or CIDR"),
        ("   ", "empty pattern"),
        ("a b.com", '"a b.com" is not a valid host (bad host: only letters'),
        ("a/b.com", '"a/b.com" is not a network'),
        ("user@example.com", '"user@example.com" is not a valid host'),
        ("-a.example.com", "cannot start or end with '-'"),
        ("a..example.com", "empty label"),
        ("xn--zz.example.com", "xn--zz.example.com"),
        ("127.1", "numeric host is not a canonical dotted-quad IPv4 address"),
        ("2130706433", "numeric host"),
        ("0x7f.0.0.1", "numeric host"),
        ("0177.0.0.1", "numeric host"),
        ("256.1.1.1", "IPv4 octet out of range"),
        ("[fe80::1%eth0]", "zone id"),
        ("*.com.*", '"*.com.*": "*" may only be the whole first label, as in "*.example.com"'),
        ("foo*.com", '"*" may only be the whole first label'),
        ("a.*.com", '"*" may only be the whole first label'),
        ("**.com", '"*" may only be the whole first label'),
        ("*.", '"*." is not a valid wildcard'),
        ("*.10.0.0.1", '"*.10.0.0.1": a wildcard needs a domain name; use a CIDR for addresses'),
        ("10.0.0/8", '"10.0.0/8" is not a network; use "10.0.0.0/8"'),
        ("10/8", '"10/8" is not a network; use "10.0.0.0/8"'),
        ("10.0.0.1/8", '"10.0.0.1/8" has host bits set; use "10.0.0.0/8"'),
        ("2001:db8::1/32", '"2001:db8::1/32" has host bits set; use "2001:db8::/32"'),
        ("10.0.0.0/33", '"10.0.0.0/33" is not a network; write it as ADDRESS/LENGTH'),
        ("x:y:z/5", '"x:y:z/5" is not a network; write it as ADDRESS/LENGTH'),
        ("[::1", '"[::1" has an unbalanced "["'),
        ("[::1]x", '"[::1]x": only ":PORT" may follow "]"'),
        ("[::1]:", '"[::1]:": the port must be a number from 1 to 65535'),
        ("[pypi.org]:443", "brackets are only for IPv6 addresses"),
        ("[10.0.0.1]", "brackets are only for IPv6 addresses"),
        ("pypi.org:", '"pypi.org:": the port must be a number from 1 to 65535'),
        ("pypi.org:0", "the port must be a number from 1 to 65535"),
        ("pypi.org:65536", "the port must be a number from 1 to 65535"),
        ("pypi.org:-1", "the port must be a number from 1 to 65535"),
        ("pypi.org:https", "the port must be a number from 1 to 65535"),
        ("pypi.org:+443", "the port must be a number from 1 to 65535"),
        ("pypi.org:٤٤٣", "the port must be a number from 1 to 65535"),
        ("10.8.0.0/16:0", "the port must be a number from 1 to 65535"),
    ],
)
def test_parse_pattern_errors(pattern: str, message: str) -> None:
    with pytest.raises(PatternError) as info:
        parse_pattern(pattern)
    assert message in str(info.value)


def test_pattern_error_is_value_error() -> None:
    assert issubclass(PatternError, ValueError)


def test_parse_network() -> None:
    assert parse_network("10.0.0.0/8") == net("10.0.0.0/8")
    assert parse_network("::1/128") == net("::1/128")
    with pytest.raises(PatternError, match=r'has host bits set; use "192\.168\.1\.0/24"'):
        parse_network("192.168.1.7/24")
    with pytest.raises(PatternError, match=r'use "192\.168\.0\.0/16"'):
        parse_network("192.168/16")
    with pytest.raises(PatternError, match="ADDRESS/LENGTH"):
        parse_network("nonsense")


@pytest.mark.parametrize(
    ("pattern", "broad"),
    [
        ("*", True),
        ("*:443", True),
        ("*.com", True),
        ("*.com:443", True),
        ("*.co.uk", False),
        ("*.example.com", False),
        ("com", False),  # one exact name is not broad
        ("0.0.0.0/0", True),
        ("8.0.0.0/7", True),
        ("10.0.0.0/8", False),
        ("::/0", True),
        ("2000::/3", True),
        ("2001:db8::/31", True),
        ("2001:db8::/32", False),
        ("10.1.2.3", False),
        ("pypi.org:443", False),
    ],
)
def test_is_too_broad(pattern: str, broad: bool) -> None:
    assert parse_pattern(pattern).is_too_broad() is broad


def test_min_prefix() -> None:
    assert min_prefix(net("10.0.0.0/8")) == MIN_IPV4_PREFIX == 8
    assert min_prefix(net("2001:db8::/32")) == MIN_IPV6_PREFIX == 32


def test_admits_port() -> None:
    any_port = parse_pattern("pypi.org")
    assert all(any_port.admits_port(p) for p in (1, 22, 443, 65535))
    only_443 = parse_pattern("pypi.org:443")
    assert only_443.admits_port(443)
    assert not only_443.admits_port(80)
    assert not only_443.admits_port(4430)


# -- RuleSet.match_name ---------------------------------------------------------------


def text_of(rule: Rule | None) -> str | None:
    return None if rule is None else rule.text


def test_match_name_exact() -> None:
    rs = rules("pypi.org:443", "github.com")
    assert text_of(rs.match_name("pypi.org", 443)) == "pypi.org:443"
    assert rs.match_name("pypi.org", 80) is None
    assert text_of(rs.match_name("github.com", 1)) == "github.com"
    assert text_of(rs.match_name("github.com", 65535)) == "github.com"
    assert rs.match_name("www.pypi.org", 443) is None
    assert rs.match_name("pypi.org.evil", 443) is None
    assert rs.match_name("evilpypi.org", 443) is None


def test_match_name_wildcard_is_subdomains_only() -> None:
    rs = rules("*.example.com")
    assert text_of(rs.match_name("a.example.com", 80)) == "*.example.com"
    assert text_of(rs.match_name("a.b.c.example.com", 80)) == "*.example.com"
    assert rs.match_name("example.com", 80) is None
    assert rs.match_name("badexample.com", 80) is None
    assert rs.match_name("example.com.evil", 80) is None
    assert rs.match_name("com", 80) is None


def test_match_name_exact_before_wildcard() -> None:
    rs = rules("*.example.com", "api.example.com:443")
    assert text_of(rs.match_name("api.example.com", 443)) == "api.example.com:443"
    # The exact entry does not admit port 80; the wildcard does.
    assert text_of(rs.match_name("api.example.com", 80)) == "*.example.com"


def test_match_name_most_specific_suffix() -> None:
    rs = rules("*.example.com", "*.b.example.com", "*.c.b.example.com:443")
    assert text_of(rs.match_name("x.c.b.example.com", 443)) == "*.c.b.example.com:443"
    assert text_of(rs.match_name("x.c.b.example.com", 80)) == "*.b.example.com"
    assert text_of(rs.match_name("c.b.example.com", 443)) == "*.b.example.com"
    assert text_of(rs.match_name("x.b.example.com", 443)) == "*.b.example.com"
    assert text_of(rs.match_name("b.example.com", 443)) == "*.example.com"


def test_match_name_first_rule_wins_for_equal_entries() -> None:
    rs = RuleSet.build(
        [
            parse_pattern("db.corp", private=True),
            parse_pattern("db.corp"),
            parse_pattern("db.corp:5432"),
        ]
    )
    found = rs.match_name("db.corp", 5432)
    assert found is not None
    assert found.private is True
    assert found is rs.rules[0]


def test_match_name_port_specific_wildcards() -> None:
    rs = rules("*.example.com:443", "*.example.com:8443")
    assert text_of(rs.match_name("a.example.com", 443)) == "*.example.com:443"
    assert text_of(rs.match_name("a.example.com", 8443)) == "*.example.com:8443"
    assert rs.match_name("a.example.com", 80) is None


def test_match_name_any() -> None:
    rs = rules("pypi.org:443", "*.example.com:443", "*:8080")
    assert text_of(rs.match_name("pypi.org", 443)) == "pypi.org:443"
    assert text_of(rs.match_name("a.example.com", 443)) == "*.example.com:443"
    assert text_of(rs.match_name("pypi.org", 8080)) == "*:8080"
    assert text_of(rs.match_name("anything.at.all", 8080)) == "*:8080"
    assert rs.match_name("anything.at.all", 80) is None


def test_names_never_match_ip_literals() -> None:
    rs = rules("pypi.org", "*.example.com", "*")
    assert rs.match_ip(ip("151.101.0.223"), 443) is None
    assert rs.match_ip(ip("2001:db8::1"), 443) is None


def test_empty_ruleset() -> None:
    rs = RuleSet.build([])
    assert rs.rules == ()
    assert rs.match_name("pypi.org", 443) is None
    assert rs.match_ip(ip("1.1.1.1"), 443) is None
    assert RuleSet().match_name("pypi.org", 443) is None


# -- RuleSet.match_ip -----------------------------------------------------------------


def test_match_ip_exact_and_cidr() -> None:
    rs = rules("10.1.2.3:5432", "10.8.0.0/16:443", "[2001:db8::/32]:443", "[2001:db8::1]")
    assert text_of(rs.match_ip(ip("10.1.2.3"), 5432)) == "10.1.2.3:5432"
    assert rs.match_ip(ip("10.1.2.3"), 5433) is None
    assert text_of(rs.match_ip(ip("10.8.255.255"), 443)) == "10.8.0.0/16:443"
    assert rs.match_ip(ip("10.8.0.1"), 80) is None
    assert rs.match_ip(ip("10.9.0.1"), 443) is None
    assert text_of(rs.match_ip(ip("2001:db8::1"), 80)) == "[2001:db8::1]"
    assert text_of(rs.match_ip(ip("2001:db8::1"), 443)) == "[2001:db8::1]"
    assert text_of(rs.match_ip(ip("2001:db8:ffff::9"), 443)) == "[2001:db8::/32]:443"
    assert rs.match_ip(ip("2001:db9::1"), 443) is None


def test_match_ip_exact_before_cidr_and_longest_prefix() -> None:
    rs = rules("10.0.0.0/8", "10.1.0.0/16:443", "10.1.2.0/24:443", "10.1.2.3:443")
    assert text_of(rs.match_ip(ip("10.1.2.3"), 443)) == "10.1.2.3:443"
    assert text_of(rs.match_ip(ip("10.1.2.4"), 443)) == "10.1.2.0/24:443"
    assert text_of(rs.match_ip(ip("10.1.3.4"), 443)) == "10.1.0.0/16:443"
    assert text_of(rs.match_ip(ip("10.1.2.3"), 80)) == "10.0.0.0/8"
    assert text_of(rs.match_ip(ip("10.200.0.1"), 443)) == "10.0.0.0/8"


def test_ipv4_entries_never_match_ipv6_forms() -> None:
    rs = rules("10.1.2.3", "10.0.0.0/8", "0.0.0.0/0")
    for wrapped in ("::ffff:10.1.2.3", "::10.1.2.3", "64:ff9b::a01:203", "2002:a01:203::1"):
        assert rs.match_ip(ip(wrapped), 443) is None, wrapped


def test_ipv6_entries_never_match_ipv4() -> None:
    rs = rules("[::ffff:10.1.2.3]", "::ffff:0:0/96", "::/0")
    assert rs.match_ip(ip("10.1.2.3"), 443) is None
    assert text_of(rs.match_ip(ip("::ffff:10.1.2.3"), 443)) == "[::ffff:10.1.2.3]"


def test_host_route_cidrs() -> None:
    rs = rules("1.2.3.4/32", "2001:db8::1/128")
    assert text_of(rs.match_ip(ip("1.2.3.4"), 1)) == "1.2.3.4/32"
    assert rs.match_ip(ip("1.2.3.5"), 1) is None
    assert text_of(rs.match_ip(ip("2001:db8::1"), 1)) == "2001:db8::1/128"


# -- CidrIndex ------------------------------------------------------------------------


def test_cidr_index_empty() -> None:
    index: CidrIndex[str] = CidrIndex()
    assert index.first(ip("10.0.0.1")) is None
    assert index.lookup_all(ip("::1")) == []


def test_cidr_index_most_specific_first() -> None:
    index: CidrIndex[str] = CidrIndex()
    # Added out of order on purpose.
    index.add(net("10.1.0.0/16"), "sixteen")
    index.add(net("10.0.0.0/8"), "eight")
    index.add(net("10.1.2.0/24"), "twenty-four")
    index.add(net("0.0.0.0/0"), "zero")
    index.add(net("10.1.2.3/32"), "host")
    assert index.lookup_all(ip("10.1.2.3")) == [
        ["host"],
        ["twenty-four"],
        ["sixteen"],
        ["eight"],
        ["zero"],
    ]
    assert index.first(ip("10.1.2.3")) == "host"
    assert index.first(ip("10.1.2.4")) == "twenty-four"
    assert index.first(ip("10.1.3.4")) == "sixteen"
    assert index.first(ip("10.2.0.0")) == "eight"
    assert index.first(ip("11.0.0.0")) == "zero"


def test_cidr_index_separates_families() -> None:
    index: CidrIndex[str] = CidrIndex()
    index.add(net("0.0.0.0/0"), "v4")
    index.add(net("::/0"), "v6")
    index.add(net("::ffff:0:0/96"), "mapped")
    assert index.first(ip("10.0.0.1")) == "v4"
    assert index.first(ip("2001:db8::1")) == "v6"
    # An IPv4-mapped address is an IPv6 address to the index.
    assert index.lookup_all(ip("::ffff:10.0.0.1")) == [["mapped"], ["v6"]]


def test_cidr_index_many_values_per_network() -> None:
    index: CidrIndex[int] = CidrIndex()
    index.add(net("192.168.0.0/16"), 1)
    index.add(net("192.168.0.0/16"), 2)
    assert index.lookup_all(ip("192.168.7.7")) == [[1, 2]]
    assert index.first(ip("192.168.7.7")) == 1
    assert index.first(ip("192.169.0.0")) is None


def test_cidr_index_boundaries() -> None:
    index: CidrIndex[str] = CidrIndex()
    index.add(net("172.16.0.0/12"), "rfc1918")
    index.add(net("fc00::/7"), "ula")
    assert index.first(ip("172.15.255.255")) is None
    assert index.first(ip("172.16.0.0")) == "rfc1918"
    assert index.first(ip("172.31.255.255")) == "rfc1918"
    assert index.first(ip("172.32.0.0")) is None
    assert index.first(ip("fbff:ffff:ffff:ffff:ffff:ffff:ffff:ffff")) is None
    assert index.first(ip("fc00::")) == "ula"
    assert index.first(ip("fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff")) == "ula"
    assert index.first(ip("fe00::")) is None


# -- RuleSet against a naive reference matcher -----------------------------------------

LABELS = ("a", "b", "c", "api", "example", "com", "org")
PORTS = (22, 80, 443, 8443)


def reference_match(rule_list: list[Rule], name: str, port: int) -> Rule | None:
    """A linear scan with the documented semantics, written independently."""
    admitting = [r for r in rule_list if r.port is None or r.port == port]
    for r in admitting:
        if r.kind is RuleKind.NAME and r.value == name:
            return r
    best: Rule | None = None
    for r in admitting:
        is_suffix = r.kind is RuleKind.WILDCARD and name.endswith("." + r.value)
        if is_suffix and (best is None or len(r.value) > len(best.value)):
            best = r
    if best is not None:
        return best
    for r in admitting:
        if r.kind is RuleKind.ANY_NAME:
            return r
    return None


names = st.lists(st.sampled_from(LABELS), min_size=1, max_size=4).map(".".join)
ports = st.one_of(st.none(), st.sampled_from(PORTS))


@st.composite
def patterns(draw: st.DrawFn) -> str:
    shape = draw(st.sampled_from(("name", "name", "wildcard", "wildcard", "any")))
    host = {"name": draw(names), "wildcard": "*." + draw(names), "any": "*"}[shape]
    port = draw(ports)
    return host if port is None else f"{host}:{port}"


@st.composite
def rule_sets_and_queries(draw: st.DrawFn) -> tuple[list[Rule], list[tuple[str, int]]]:
    rule_list = [parse_pattern(p) for p in draw(st.lists(patterns(), max_size=12))]
    seeds = [r.value for r in rule_list if r.kind is not RuleKind.ANY_NAME]
    queries: list[tuple[str, int]] = []
    for _ in range(draw(st.integers(1, 12))):
        from_rules: bool = draw(st.booleans())
        if seeds and from_rules:
            base = draw(st.sampled_from(seeds))
            how = draw(st.sampled_from(("same", "child", "grandchild", "parent")))
            if how == "child":
                base = f"{draw(st.sampled_from(LABELS))}.{base}"
            elif how == "grandchild":
                base = f"{draw(st.sampled_from(LABELS))}.{draw(st.sampled_from(LABELS))}.{base}"
            elif how == "parent" and "." in base:
                base = base.split(".", 1)[1]
        else:
            base = draw(names)
        queries.append((base, draw(st.sampled_from((*PORTS, 1, 65535)))))
    return rule_list, queries


@settings(max_examples=400, deadline=None)
@given(rule_sets_and_queries())
def test_match_name_agrees_with_reference(
    case: tuple[list[Rule], list[tuple[str, int]]],
) -> None:
    rule_list, queries = case
    rs = RuleSet.build(rule_list)
    for name, port in queries:
        expected = reference_match(rule_list, name, port)
        got = rs.match_name(name, port)
        assert got is expected, (name, port, text_of(got), text_of(expected))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2**32 - 1),
            st.integers(8, 32),
            st.one_of(st.none(), st.sampled_from(PORTS)),
        ),
        max_size=10,
    ),
    st.lists(st.tuples(st.integers(0, 2**32 - 1), st.sampled_from(PORTS)), max_size=10),
)
def test_match_ip_agrees_with_reference(
    entries: list[tuple[int, int, int | None]], queries: list[tuple[int, int]]
) -> None:
    rule_list = []
    for value, length, port in entries:
        network = ipaddress.IPv4Network((value, length), strict=False)
        text = str(network) if port is None else f"{network}:{port}"
        rule_list.append(parse_pattern(text))
    rs = RuleSet.build(rule_list)
    probes: list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]
    probes = [(ipaddress.IPv4Address(v), p) for v, p in queries]
    probes += [(r.network.network_address, p) for r in rule_list if r.network for p in PORTS]
    for address, port in probes:
        candidates = [
            r
            for r in rule_list
            if r.network is not None and address in r.network and r.admits_port(port)
        ]
        longest = max((r.network.prefixlen for r in candidates if r.network), default=None)
        expected = next(
            (r for r in candidates if r.network and r.network.prefixlen == longest), None
        )
        assert rs.match_ip(address, port) is expected
