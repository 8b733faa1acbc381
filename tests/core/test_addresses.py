"""IP classification (DESIGN §3.4): the closed table, tested at every range boundary.

Expectations come from a brute-force longest-prefix scan over TABLE written
here, from explicit spot checks, and from an independent list of the IANA
special-purpose registries, never from `ipaddress.is_global` and friends.
"""

from __future__ import annotations

import ast
import ipaddress
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressbox.core import addresses
from egressbox.core.addresses import (
    METADATA_ENDPOINTS,
    PRIVATE_LIKE,
    ROUTABLE,
    SPECIAL_PURPOSE,
    TABLE,
    Category,
    EmbedKind,
    Range,
    embedded_ipv4,
    is_metadata,
    is_routable,
    lookup,
    reason_for,
    unwrap_mapped,
)
from egressbox.core.errors import Reason
from egressbox.core.ip import IPAddress
from sources import source_of

V4 = ipaddress.IPv4Address
V6 = ipaddress.IPv6Address
C = Category
K = EmbedKind


def _ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


def _from_int(version: int, value: int) -> IPAddress:
    return V4(value) if version == 4 else V6(value)


def brute_force(ip: IPAddress) -> Range:
    """The longest-prefix TABLE entry containing ip, by scanning every entry."""
    best: Range | None = None
    for entry in TABLE:
        # Versions are compared explicitly: `V4 in V6Network` is not an error.
        if entry.network.version != ip.version or ip not in entry.network:
            continue
        if best is None or entry.network.prefixlen > best.network.prefixlen:
            best = entry
        else:
            assert entry.network.prefixlen != best.network.prefixlen, "duplicate entries"
    assert best is not None, f"{ip} is in no entry"
    return best


# --------------------------------------------------------------------------
# The table itself
# --------------------------------------------------------------------------


def test_table_is_closed_and_unambiguous() -> None:
    networks = [entry.network for entry in TABLE]
    assert len(set(networks)) == len(networks), "a network is listed twice"
    assert ipaddress.ip_network("0.0.0.0/0") in networks
    assert ipaddress.ip_network("::/0") in networks
    for entry in TABLE:
        assert isinstance(entry.category, Category)
        assert entry.name


def _boundary_id(entry: Range) -> str:
    return str(entry.network)


@pytest.mark.parametrize("entry", TABLE, ids=_boundary_id)
def test_range_boundaries(entry: Range) -> None:
    net = entry.network
    first, last = int(net.network_address), int(net.broadcast_address)
    for value in (first, last):
        ip = _from_int(net.version, value)
        expected = brute_force(ip)
        assert lookup(ip) == expected, ip
        if expected != entry:
            # Only a more specific entry may take the edge of this range.
            assert expected.network.prefixlen > net.prefixlen, ip
            assert expected.network.subnet_of(net), ip  # type: ignore[arg-type]
    max_value = (1 << net.max_prefixlen) - 1
    for value in (first - 1, last + 1):
        if not 0 <= value <= max_value:
            continue
        ip = _from_int(net.version, value)
        assert ip not in net
        got = lookup(ip)
        assert got == brute_force(ip), ip
        assert got != entry, ip


# --------------------------------------------------------------------------
# Spot checks with explicit categories
# --------------------------------------------------------------------------

SPOT_CHECKS: list[tuple[str, Category]] = [
    # IPv4
    ("8.8.8.8", C.GLOBAL),
    ("1.1.1.1", C.GLOBAL),
    ("0.0.0.0", C.UNSPECIFIED),
    ("0.0.0.1", C.THIS_NETWORK),
    ("0.255.255.255", C.THIS_NETWORK),
    ("1.0.0.0", C.GLOBAL),
    ("9.255.255.255", C.GLOBAL),
    ("10.0.0.0", C.PRIVATE),
    ("10.255.255.255", C.PRIVATE),
    ("11.0.0.0", C.GLOBAL),
    ("100.63.255.255", C.GLOBAL),
    ("100.64.0.0", C.SHARED),
    ("100.127.255.255", C.SHARED),
    ("100.128.0.0", C.GLOBAL),
    ("127.0.0.1", C.LOOPBACK),
    ("127.255.255.255", C.LOOPBACK),
    ("169.254.0.0", C.LINK_LOCAL),
    ("169.254.169.254", C.METADATA),  # a class of its own inside link-local
    ("169.254.169.255", C.LINK_LOCAL),
    ("169.254.255.255", C.LINK_LOCAL),
    ("169.253.255.255", C.GLOBAL),
    ("169.255.0.0", C.GLOBAL),
    ("172.15.255.255", C.GLOBAL),
    ("172.16.0.0", C.PRIVATE),
    ("172.31.255.255", C.PRIVATE),
    ("172.32.0.0", C.GLOBAL),
    ("192.0.0.0", C.PROTOCOL_ASSIGNMENTS),
    ("192.0.0.8", C.PROTOCOL_ASSIGNMENTS),
    ("192.0.0.170", C.PROTOCOL_ASSIGNMENTS),
    ("192.0.0.255", C.PROTOCOL_ASSIGNMENTS),
    ("192.0.1.0", C.GLOBAL),
    ("192.0.2.1", C.DOCUMENTATION),
    ("192.31.196.1", C.GLOBAL),  # AS112-v4: globally reachable
    ("192.52.193.1", C.GLOBAL),  # AMT: globally reachable
    ("192.88.99.1", C.RESERVED),
    ("192.168.0.1", C.PRIVATE),
    ("192.175.48.1", C.GLOBAL),  # direct delegation AS112: globally reachable
    ("198.17.255.255", C.GLOBAL),
    ("198.18.0.0", C.BENCHMARKING),
    ("198.19.255.255", C.BENCHMARKING),
    ("198.20.0.0", C.GLOBAL),
    ("198.51.100.7", C.DOCUMENTATION),
    ("203.0.113.255", C.DOCUMENTATION),
    ("223.255.255.255", C.GLOBAL),
    ("224.0.0.1", C.MULTICAST),
    ("233.252.0.1", C.DOCUMENTATION),
    ("239.255.255.255", C.MULTICAST),
    ("240.0.0.0", C.RESERVED),
    ("255.255.255.254", C.RESERVED),
    ("255.255.255.255", C.BROADCAST),
    # IPv6
    ("2606:4700::1111", C.GLOBAL),
    ("2001:4860:4860::8888", C.GLOBAL),
    ("::", C.UNSPECIFIED),
    ("::1", C.LOOPBACK),
    ("::2", C.IPV4_EMBEDDING),
    ("::127.0.0.1", C.IPV4_EMBEDDING),
    ("::ffff:7f00:1", C.IPV4_EMBEDDING),
    ("::ffff:8.8.8.8", C.IPV4_EMBEDDING),
    ("::ffff:0:7f00:1", C.IPV4_EMBEDDING),
    ("::1:0:0", C.RESERVED),
    ("64:ff9b::a9fe:a9fe", C.TRANSLATION),
    ("64:ff9b::8.8.8.8", C.TRANSLATION),
    ("64:ff9b:1::a9fe:a9fe", C.IPV4_EMBEDDING),
    ("64:ff9b:1:ffff:ffff:ffff:ffff:ffff", C.IPV4_EMBEDDING),
    ("64:ff9b:2::", C.RESERVED),
    ("100::1", C.DISCARD),
    ("100::ffff:ffff:ffff:ffff", C.DISCARD),
    ("100:0:0:1::1", C.DISCARD),
    ("100:0:0:2::", C.RESERVED),
    ("1fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", C.RESERVED),
    ("2000::", C.GLOBAL),
    ("2001::1", C.TUNNEL),
    ("2002:7f00:1::", C.TUNNEL),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", C.TUNNEL),
    ("2001:1::1", C.GLOBAL),
    ("2001:1::2", C.GLOBAL),
    ("2001:1::3", C.GLOBAL),
    ("2001:1::4", C.PROTOCOL_ASSIGNMENTS),
    ("2001:2::1", C.BENCHMARKING),
    ("2001:2:1::", C.PROTOCOL_ASSIGNMENTS),
    ("2001:3::1", C.GLOBAL),
    ("2001:4:112::1", C.GLOBAL),
    ("2001:10::1", C.RESERVED),
    ("2001:20::1", C.GLOBAL),
    ("2001:30::1", C.GLOBAL),
    ("2001:1ff:ffff:ffff:ffff:ffff:ffff:ffff", C.PROTOCOL_ASSIGNMENTS),
    ("2001:200::", C.GLOBAL),
    ("2001:db7:ffff:ffff:ffff:ffff:ffff:ffff", C.GLOBAL),
    ("2001:db8::1", C.DOCUMENTATION),
    ("2001:db9::", C.GLOBAL),
    ("2620:4f:8000::1", C.GLOBAL),
    ("3ffe:ffff:ffff:ffff:ffff:ffff:ffff:ffff", C.GLOBAL),
    ("3fff::", C.DOCUMENTATION),
    ("3fff:fff:ffff:ffff:ffff:ffff:ffff:ffff", C.DOCUMENTATION),
    ("3fff:1000::", C.GLOBAL),
    ("4000::1", C.RESERVED),
    ("5f00::1", C.RESERVED),
    ("fbff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", C.RESERVED),
    ("fc00::", C.PRIVATE),
    ("fd12:3456::1", C.PRIVATE),
    ("fe00::", C.RESERVED),
    ("fe80::1", C.LINK_LOCAL),
    ("febf:ffff:ffff:ffff:ffff:ffff:ffff:ffff", C.LINK_LOCAL),
    ("fec0::1", C.SITE_LOCAL),
    ("ff02::1", C.MULTICAST),
    ("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", C.MULTICAST),
]


@pytest.mark.parametrize(("text", "category"), SPOT_CHECKS)
def test_spot_checks(text: str, category: Category) -> None:
    assert lookup(_ip(text)).category is category


# Entries of the IANA IPv4 and IPv6 Special-Purpose Address Registries that
# are NOT globally reachable (or are N/A wrappers judged by their payload),
# listed here independently of TABLE: every address in them must be refused.
IANA_NOT_GLOBAL: list[str] = [
    "0.0.0.0/8",
    "0.0.0.0/32",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/29",
    "192.0.0.8/32",
    "192.0.0.170/31",
    "192.0.2.0/24",
    "192.88.99.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "224.0.0.0/4",
    "240.0.0.0/4",
    "255.255.255.255/32",
    "::1/128",
    "::/128",
    "::ffff:0:0/96",
    "64:ff9b:1::/48",
    "100::/64",
    "100:0:0:1::/64",
    "2001:2::/48",
    "2001:10::/28",
    "2001:db8::/32",
    "3fff::/20",
    "5f00::/16",
    "fc00::/7",
    "fe80::/10",
    "fec0::/10",
    "ff00::/8",
]

# Globally reachable registry entries (and plain unicast) that must stay dialable.
IANA_GLOBAL: list[str] = [
    "64:ff9b::/96",
    "2001:1::1/128",
    "2001:1::2/128",
    "2001:1::3/128",
    "2001:3::/32",
    "2001:4:112::/48",
    "2001:20::/28",
    "2001:30::/28",
    "2620:4f:8000::/48",
    "192.31.196.0/24",
    "192.52.193.0/24",
    "192.175.48.0/24",
]


@pytest.mark.parametrize("cidr", IANA_NOT_GLOBAL)
def test_iana_non_global_ranges_are_not_routable(cidr: str) -> None:
    net = ipaddress.ip_network(cidr)
    for ip in (net.network_address, net.broadcast_address, net[net.num_addresses // 2]):
        assert not is_routable(lookup(ip).category), ip


@pytest.mark.parametrize("cidr", IANA_GLOBAL)
def test_iana_global_ranges_are_routable(cidr: str) -> None:
    net = ipaddress.ip_network(cidr)
    for ip in (net.network_address, net.broadcast_address):
        assert is_routable(lookup(ip).category), ip


@pytest.mark.parametrize("text", ["::127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::"])
def test_forms_python_calls_global_are_never_admitted(text: str) -> None:
    # ipaddress says is_global for some of these; the table (plus the
    # embedded IPv4) must refuse every one of them.
    ip = _ip(text)
    refused = not is_routable(lookup(ip).category) or any(
        not is_routable(lookup(v4).category) for _, v4 in embedded_ipv4(ip)
    )
    assert refused


def test_addresses_does_not_lean_on_ipaddress_predicates() -> None:
    tree = ast.parse(source_of(addresses))
    predicates = {
        "is_global",
        "is_private",
        "is_reserved",
        "is_loopback",
        "is_link_local",
        "is_site_local",
        "is_multicast",
        "is_unspecified",
    }
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} & predicates
    assert not used


# --------------------------------------------------------------------------
# Embedded IPv4
# --------------------------------------------------------------------------

EMBEDDED: list[tuple[str, set[tuple[EmbedKind, str]]]] = [
    ("::ffff:7f00:1", {(K.MAPPED, "127.0.0.1")}),
    ("::ffff:169.254.169.254", {(K.MAPPED, "169.254.169.254")}),
    ("::127.0.0.1", {(K.COMPATIBLE, "127.0.0.1")}),
    ("::ffff:0:7f00:1", {(K.TRANSLATED, "127.0.0.1")}),
    ("2002:7f00:1::", {(K.SIX_TO_FOUR, "127.0.0.1")}),
    ("2002:a9fe:a9fe:1234:5678:9abc:def0:1", {(K.SIX_TO_FOUR, "169.254.169.254")}),
    ("64:ff9b::a9fe:a9fe", {(K.NAT64, "169.254.169.254")}),
    ("64:ff9b::7f00:1", {(K.NAT64, "127.0.0.1")}),
    # Teredo (RFC 4380 §4 layout), the commonly cited example: server
    # 65.54.227.120, flags 0x8000, port 40000 and client 192.0.2.45, both inverted.
    (
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",
        {(K.TEREDO_SERVER, "65.54.227.120"), (K.TEREDO_CLIENT, "192.0.2.45")},
    ),
    ("::", set()),
    ("::1", set()),
    ("2606:4700::1111", set()),
    ("fe80::7f00:1", set()),
    ("2001:1::7f00:1", set()),
    ("2003:7f00:1::", set()),
    ("64:ff9b:0:1::7f00:1", set()),  # outside 64:ff9b::/96
    ("8.8.8.8", set()),
    ("127.0.0.1", set()),
]


@pytest.mark.parametrize(("text", "expected"), EMBEDDED)
def test_embedded_ipv4(text: str, expected: set[tuple[EmbedKind, str]]) -> None:
    got = set(embedded_ipv4(_ip(text)))
    assert got == {(kind, V4(v4)) for kind, v4 in expected}


@pytest.mark.parametrize(
    "text",
    [
        "64:ff9b:1::a9fe:a9fe",  # /96 placement (RFC 6052 §2.2)
        "64:ff9b:1:a9fe:a9:fe00::",  # /48 placement: 16 bits, the u octet, 16 bits
        "64:ff9b:1:1234:5678:9abc:a9fe:a9fe",  # /96 placement, operator bits set
    ],
)
def test_local_use_nat64_both_placements(text: str) -> None:
    ip = _ip(text)
    assert lookup(ip).category is C.IPV4_EMBEDDING
    assert (K.NAT64, V4("169.254.169.254")) in set(embedded_ipv4(ip))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("::ffff:127.0.0.1", "127.0.0.1"),
        ("::ffff:8.8.8.8", "8.8.8.8"),
        ("::127.0.0.1", "::7f00:1"),  # only mapped addresses are one endpoint with v4
        ("2001:db8::1", "2001:db8::1"),
        ("10.0.0.1", "10.0.0.1"),
    ],
)
def test_unwrap_mapped(text: str, expected: str) -> None:
    assert unwrap_mapped(_ip(text)) == _ip(expected)


# --------------------------------------------------------------------------
# Categories and reasons
# --------------------------------------------------------------------------


def test_routable_categories() -> None:
    assert frozenset({C.GLOBAL, C.TRANSLATION, C.TUNNEL}) == ROUTABLE
    for category in Category:
        assert is_routable(category) is (category in ROUTABLE)
    assert frozenset({C.PRIVATE, C.SHARED, C.SITE_LOCAL}) == PRIVATE_LIKE


REASONS: dict[Category, Reason] = {
    C.LOOPBACK: Reason.PRIVATE_ADDRESS,
    C.PRIVATE: Reason.PRIVATE_ADDRESS,
    C.SHARED: Reason.PRIVATE_ADDRESS,
    C.SITE_LOCAL: Reason.PRIVATE_ADDRESS,
    C.LINK_LOCAL: Reason.PRIVATE_ADDRESS,
    C.UNSPECIFIED: Reason.SPECIAL_ADDRESS,
    C.THIS_NETWORK: Reason.SPECIAL_ADDRESS,
    C.MULTICAST: Reason.SPECIAL_ADDRESS,
    C.BROADCAST: Reason.SPECIAL_ADDRESS,
    C.DOCUMENTATION: Reason.SPECIAL_ADDRESS,
    C.BENCHMARKING: Reason.SPECIAL_ADDRESS,
    C.PROTOCOL_ASSIGNMENTS: Reason.SPECIAL_ADDRESS,
    C.RESERVED: Reason.SPECIAL_ADDRESS,
    C.DISCARD: Reason.SPECIAL_ADDRESS,
    C.IPV4_EMBEDDING: Reason.SPECIAL_ADDRESS,
    C.METADATA: Reason.METADATA_ADDRESS,
}


def test_every_non_routable_category_has_a_reason() -> None:
    assert set(REASONS) == set(Category) - ROUTABLE


@pytest.mark.parametrize(("category", "reason"), REASONS.items())
def test_reason_for(category: Category, reason: Reason) -> None:
    assert reason_for(category) is reason


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("127.0.0.1", Reason.PRIVATE_ADDRESS),
        ("10.1.2.3", Reason.PRIVATE_ADDRESS),
        ("100.64.0.1", Reason.PRIVATE_ADDRESS),
        ("169.254.1.1", Reason.PRIVATE_ADDRESS),
        ("169.254.169.254", Reason.METADATA_ADDRESS),
        ("100.100.100.200", Reason.METADATA_ADDRESS),
        ("fd00:ec2::254", Reason.METADATA_ADDRESS),
        ("fec0::1", Reason.PRIVATE_ADDRESS),
        ("fd00::1", Reason.PRIVATE_ADDRESS),
        ("fe80::1", Reason.PRIVATE_ADDRESS),
        ("::1", Reason.PRIVATE_ADDRESS),
        ("0.0.0.0", Reason.SPECIAL_ADDRESS),
        ("224.0.0.1", Reason.SPECIAL_ADDRESS),
        ("192.0.2.1", Reason.SPECIAL_ADDRESS),
        ("240.0.0.1", Reason.SPECIAL_ADDRESS),
        ("255.255.255.255", Reason.SPECIAL_ADDRESS),
        ("2001:db8::1", Reason.SPECIAL_ADDRESS),
        ("100::1", Reason.SPECIAL_ADDRESS),
        ("::ffff:8.8.8.8", Reason.SPECIAL_ADDRESS),
    ],
)
def test_reason_for_addresses(text: str, reason: Reason) -> None:
    assert reason_for(lookup(_ip(text)).category) is reason


# --------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------


@st.composite
def near_boundaries(draw: st.DrawFn) -> IPAddress:
    """Addresses within a few steps of some TABLE entry's first or last address."""
    net = draw(st.sampled_from(TABLE)).network
    edge = int(draw(st.sampled_from([net.network_address, net.broadcast_address])))
    value = edge + draw(st.integers(-3, 3))
    value = min(max(value, 0), (1 << net.max_prefixlen) - 1)
    return _from_int(net.version, value)


@settings(max_examples=1000)
@given(st.one_of(st.ip_addresses(), near_boundaries()))
def test_lookup_is_the_longest_prefix_match(ip: IPAddress) -> None:
    assert lookup(ip) == brute_force(ip)


EMBEDDING_NETWORKS: list[tuple[EmbedKind, ipaddress.IPv6Network]] = [
    (K.MAPPED, ipaddress.IPv6Network("::ffff:0:0/96")),
    (K.TRANSLATED, ipaddress.IPv6Network("::ffff:0:0:0/96")),
    (K.COMPATIBLE, ipaddress.IPv6Network("::/96")),
    (K.NAT64, ipaddress.IPv6Network("64:ff9b::/96")),
    (K.NAT64, ipaddress.IPv6Network("64:ff9b:1::/48")),
    (K.SIX_TO_FOUR, ipaddress.IPv6Network("2002::/16")),
    (K.TEREDO_SERVER, ipaddress.IPv6Network("2001::/32")),
    (K.TEREDO_CLIENT, ipaddress.IPv6Network("2001::/32")),
]
EMBEDDING_CATEGORIES = {C.IPV4_EMBEDDING, C.TRANSLATION, C.TUNNEL}


@settings(max_examples=1000)
@given(st.one_of(st.ip_addresses(), near_boundaries()))
def test_embedding_kinds_follow_the_prefixes(ip: IPAddress) -> None:
    kinds = {kind for kind, _ in embedded_ipv4(ip)}
    if ip.version == 4:
        assert not kinds
        return
    assert isinstance(ip, V6)
    expected = {kind for kind, net in EMBEDDING_NETWORKS if ip in net}
    if ip in (V6("::"), V6("::1")):
        expected.discard(K.COMPATIBLE)
    assert kinds == expected
    # An address carries IPv4 exactly when the table files it as a wrapper.
    assert bool(kinds) is (lookup(ip).category in EMBEDDING_CATEGORIES)


v4_addresses = st.integers(0, 2**32 - 1).map(V4)


@settings(max_examples=500)
@given(v4_addresses)
def test_mapped_compatible_translated_yield_the_v4(v4: V4) -> None:
    assert set(embedded_ipv4(V6(f"::ffff:{v4}"))) == {(K.MAPPED, v4)}
    assert set(embedded_ipv4(V6(f"::ffff:0:{v4}"))) == {(K.TRANSLATED, v4)}
    if int(v4) > 1:
        assert set(embedded_ipv4(V6(f"::{v4}"))) == {(K.COMPATIBLE, v4)}
    assert unwrap_mapped(V6(f"::ffff:{v4}")) == v4


@settings(max_examples=500)
@given(v4_addresses, st.integers(0, 2**80 - 1))
def test_6to4_yields_the_v4(v4: V4, low: int) -> None:
    ip = V6((0x2002 << 112) | (int(v4) << 80) | low)
    assert set(embedded_ipv4(ip)) == {(K.SIX_TO_FOUR, v4)}
    assert lookup(ip).category is C.TUNNEL


@settings(max_examples=500)
@given(v4_addresses)
def test_nat64_well_known_prefix_yields_the_v4(v4: V4) -> None:
    ip = V6((0x64FF9B << 96) | int(v4))
    assert set(embedded_ipv4(ip)) == {(K.NAT64, v4)}
    assert lookup(ip).category is C.TRANSLATION


@settings(max_examples=500)
@given(v4_addresses, st.integers(0, 2**48 - 1), st.integers(0, 2**40 - 1))
def test_nat64_local_prefix_yields_the_v4_in_both_placements(
    v4: V4, operator_bits: int, suffix: int
) -> None:
    prefix = 0x64FF9B0001 << 80
    as_96 = V6(prefix | (operator_bits << 32) | int(v4))
    high, low = int(v4) >> 16, int(v4) & 0xFFFF
    as_48 = V6(prefix | (high << 64) | (low << 40) | suffix)  # u octet (bits 64-71) zero
    for ip in (as_96, as_48):
        assert (K.NAT64, v4) in set(embedded_ipv4(ip))
        assert lookup(ip).category is C.IPV4_EMBEDDING


@settings(max_examples=500)
@given(v4_addresses, v4_addresses, st.integers(0, 0xFFFF), st.integers(0, 0xFFFF))
def test_teredo_yields_server_and_inverted_client(
    server: V4, client: V4, flags: int, port: int
) -> None:
    value = (
        (0x2001_0000 << 96)
        | (int(server) << 64)
        | (flags << 48)
        | ((port ^ 0xFFFF) << 32)
        | (int(client) ^ 0xFFFF_FFFF)
    )
    ip = V6(value)
    assert set(embedded_ipv4(ip)) == {(K.TEREDO_SERVER, server), (K.TEREDO_CLIENT, client)}
    assert lookup(ip).category is C.TUNNEL


# --------------------------------------------------------------------------
# Cloud metadata endpoints: a class of their own
# --------------------------------------------------------------------------

# Written out here, independently of METADATA_ENDPOINTS, with the range each
# address would fall in without its own entry: the table must be exactly this.
METADATA_EXPECTED: dict[str, Category] = {
    "169.254.169.254": C.LINK_LOCAL,  # AWS/GCP/Azure/OCI/OpenStack/DO... IMDS
    "169.254.169.253": C.LINK_LOCAL,  # AWS VPC DNS resolver
    "169.254.170.2": C.LINK_LOCAL,  # AWS ECS task metadata / credentials
    "169.254.170.23": C.LINK_LOCAL,  # AWS EKS Pod Identity Agent
    "169.254.0.23": C.LINK_LOCAL,  # Tencent Cloud
    "169.254.42.42": C.LINK_LOCAL,  # Scaleway
    "100.100.100.200": C.SHARED,  # Alibaba Cloud, inside CGNAT
    "168.63.129.16": C.GLOBAL,  # Azure WireServer, publicly routed
    "192.0.0.192": C.PROTOCOL_ASSIGNMENTS,  # Oracle Cloud Compute Classic
    "fd00:ec2::254": C.PRIVATE,  # AWS IMDS IPv6, a ULA
    "fd00:ec2::253": C.PRIVATE,  # AWS VPC DNS IPv6
    "fd00:ec2::23": C.PRIVATE,  # AWS EKS Pod Identity IPv6
    "fd20:ce::254": C.PRIVATE,  # GCP metadata IPv6
    "fd00:a9fe:a9fe::1": C.PRIVATE,  # Akamai/Linode metadata IPv6
    "fd00:42::42": C.PRIVATE,  # Scaleway IPv6
    "fe80::a9fe:a9fe": C.LINK_LOCAL,  # OpenStack metadata IPv6
}
METADATA_V4 = [V4(text) for text in METADATA_EXPECTED if ":" not in text]


def test_metadata_table_is_exactly_the_documented_endpoints() -> None:
    assert TABLE == SPECIAL_PURPOSE + METADATA_ENDPOINTS
    listed = {entry.network for entry in METADATA_ENDPOINTS}
    assert len(listed) == len(METADATA_ENDPOINTS)
    assert listed == {ipaddress.ip_network(text) for text in METADATA_EXPECTED}
    for entry in METADATA_ENDPOINTS:
        assert entry.category is C.METADATA
        assert entry.network.num_addresses == 1, "single addresses only, never a range"
        assert entry.name
    assert not any(entry.category is C.METADATA for entry in SPECIAL_PURPOSE)


@pytest.mark.parametrize(("text", "underneath"), METADATA_EXPECTED.items())
def test_every_metadata_endpoint_is_classified_metadata(text: str, underneath: Category) -> None:
    ip = _ip(text)
    assert lookup(ip).category is C.METADATA
    assert is_metadata(ip)
    assert reason_for(lookup(ip).category) is Reason.METADATA_ADDRESS
    assert not is_routable(C.METADATA)
    # Without its own entry the address would be in this range: the registries only.
    special = [e for e in SPECIAL_PURPOSE if e.network.version == ip.version and ip in e.network]
    assert max(special, key=lambda e: e.network.prefixlen).category is underneath
    # Its neighbours are ordinary members of that range.
    for value in (int(ip) - 1, int(ip) + 1):
        neighbour = _from_int(ip.version, value)
        if str(neighbour) not in METADATA_EXPECTED:
            assert lookup(neighbour).category is not C.METADATA, neighbour
            assert not is_metadata(neighbour), neighbour


# Every IPv6 form the decision unwraps, built here from the RFC layouts.
def mapped(v4: V4) -> V6:
    return V6((0xFFFF << 32) | int(v4))


def compatible(v4: V4) -> V6:
    return V6(int(v4))


def translated(v4: V4) -> V6:
    return V6((0xFFFF_0000 << 32) | int(v4))


def nat64(v4: V4) -> V6:
    return V6((0x0064_FF9B << 96) | int(v4))


def nat64_local_96(v4: V4, operator_bits: int = 0) -> V6:
    return V6((0x0064_FF9B_0001 << 80) | (operator_bits << 32) | int(v4))


def nat64_local_48(v4: V4, suffix: int = 0) -> V6:
    high, low = int(v4) >> 16, int(v4) & 0xFFFF
    return V6((0x0064_FF9B_0001 << 80) | (high << 64) | (low << 40) | suffix)


def six_to_four(v4: V4, low: int = 0) -> V6:
    return V6((0x2002 << 112) | (int(v4) << 80) | low)


def teredo_server(v4: V4, rest: int = 0) -> V6:
    return V6((0x2001_0000 << 96) | (int(v4) << 64) | rest)


def teredo_client(v4: V4, server: int = 0, flags_port: int = 0) -> V6:
    return V6((0x2001_0000 << 96) | (server << 64) | (flags_port << 32) | (int(v4) ^ 0xFFFF_FFFF))


WRAPPERS = [
    mapped,
    compatible,
    translated,
    nat64,
    nat64_local_96,
    nat64_local_48,
    six_to_four,
    teredo_server,
    teredo_client,
]


@pytest.mark.parametrize("v4", METADATA_V4, ids=str)
@pytest.mark.parametrize("wrap", WRAPPERS, ids=lambda w: w.__name__)
def test_metadata_is_seen_through_every_wrapper(v4: V4, wrap: Callable[[V4], V6]) -> None:
    wrapped = wrap(v4)
    assert lookup(wrapped).category is not C.METADATA  # the wrapper is judged on its own...
    assert is_metadata(wrapped)  # ...and the address it carries as metadata
    assert any(
        inner == v4 and lookup(inner).category is C.METADATA for _, inner in embedded_ipv4(wrapped)
    )


@pytest.mark.parametrize(
    "text",
    [
        "::ffff:169.254.169.254",
        "64:ff9b::a9fe:a9fe",
        "2002:a9fe:a9fe::1",
        "::ffff:100.100.100.200",
        "64:ff9b::a83f:8110",  # NAT64 of 168.63.129.16
        "2001:0:808:808::5601:5601",  # Teredo, client 169.254.169.254 inverted
    ],
)
def test_metadata_spelled_as_wrappers(text: str) -> None:
    assert is_metadata(_ip(text))


# Each wrapper with its free bits (6to4's site bits, Teredo's server, flags
# and port, the operator's bits of a local NAT64 prefix) taken from `bits`.
FILLED_WRAPPERS: dict[str, Callable[[V4, int], V6]] = {
    "mapped": lambda v4, _: mapped(v4),
    "compatible": lambda v4, _: compatible(v4),
    "translated": lambda v4, _: translated(v4),
    "nat64": lambda v4, _: nat64(v4),
    "nat64_local_96": lambda v4, bits: nat64_local_96(v4, bits & (2**48 - 1)),
    "nat64_local_48": lambda v4, bits: nat64_local_48(v4, bits & (2**40 - 1)),
    "6to4": lambda v4, bits: six_to_four(v4, bits & (2**80 - 1)),
    "teredo_server": lambda v4, bits: teredo_server(v4, bits & (2**64 - 1)),
    "teredo_client": lambda v4, bits: teredo_client(
        v4, (bits >> 32) & 0xFFFF_FFFF, bits & 0xFFFF_FFFF
    ),
}


@settings(max_examples=1000)
@given(
    st.sampled_from(METADATA_V4),
    st.sampled_from(sorted(FILLED_WRAPPERS)),
    st.integers(0, 2**128 - 1),
)
def test_property_every_wrapped_metadata_ipv4_is_metadata(v4: V4, form: str, bits: int) -> None:
    wrapped = FILLED_WRAPPERS[form](v4, bits)
    assert is_metadata(wrapped), wrapped
    assert (v4, C.METADATA) in {
        (inner, lookup(inner).category) for _, inner in embedded_ipv4(wrapped)
    }


@settings(max_examples=500)
@given(v4_addresses)
def test_property_no_other_ipv4_is_metadata_in_any_wrapper(v4: V4) -> None:
    if v4 in METADATA_V4:
        return
    assert not is_metadata(v4)
    for wrap in (mapped, translated, nat64, nat64_local_96, nat64_local_48, six_to_four):
        assert not is_metadata(wrap(v4)), wrap.__name__
