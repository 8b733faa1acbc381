"""Classify IP addresses: a closed table of the IANA special-purpose registries.

Pure. Python's `ipaddress.is_global` and friends are not used: they call
`::127.0.0.1`, `64:ff9b::7f00:1` and `2002:7f00:1::` global. Instead every
address is looked up here by longest prefix, and IPv6 forms that carry an
IPv4 address (mapped, compatible, translated, NAT64, 6to4, Teredo) yield the
embedded address so that it is judged as well.

Cloud metadata and instance-identity endpoints are a class of their own
(`metadata`, DESIGN §3 "Cloud metadata"): single addresses listed on top of
the registries, each with the provider's documentation as its source, so that
the most specific match names them whatever range they sit in (link-local,
CGNAT, ULA, even publicly routed).

Sources: IANA IPv4 and IPv6 Special-Purpose Address Registries (RFC 6890
and later additions), RFC 6052 (NAT64 embedding), RFC 3056 (6to4),
RFC 4380 (Teredo); the providers' documents named in METADATA_ENDPOINTS.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from egressbox.core.errors import Reason
from egressbox.core.ip import IPAddress, IPNetwork

# Enum members bound once (docs/development.md, "The compiled core's speed rules").
_METADATA_ADDRESS: Final = Reason.METADATA_ADDRESS
_PRIVATE_ADDRESS: Final = Reason.PRIVATE_ADDRESS
_SPECIAL_ADDRESS: Final = Reason.SPECIAL_ADDRESS


class Category(StrEnum):
    GLOBAL = "global"
    LOOPBACK = "loopback"
    PRIVATE = "private"  # RFC 1918, RFC 4193 ULA
    SHARED = "shared"  # RFC 6598 carrier-grade NAT
    SITE_LOCAL = "site_local"  # RFC 3879 deprecated fec0::/10
    LINK_LOCAL = "link_local"
    UNSPECIFIED = "unspecified"
    THIS_NETWORK = "this_network"
    MULTICAST = "multicast"
    BROADCAST = "broadcast"
    DOCUMENTATION = "documentation"
    BENCHMARKING = "benchmarking"
    PROTOCOL_ASSIGNMENTS = "protocol_assignments"
    RESERVED = "reserved"
    DISCARD = "discard"
    IPV4_EMBEDDING = "ipv4_embedding"  # mapped/compatible/translated/local NAT64
    TRANSLATION = "translation"  # well-known NAT64 prefix: global wrapper
    TUNNEL = "tunnel"  # 6to4 and Teredo: global wrappers
    METADATA = "metadata"  # a cloud metadata / instance-identity endpoint (METADATA_ENDPOINTS)


# Categories whose addresses may be dialed without an explicit grant.
ROUTABLE = frozenset({Category.GLOBAL, Category.TRANSLATION, Category.TUNNEL})
# What `allow_private = true` (or a rule's `private = true`) lifts. Loopback
# and link-local need an explicit allow_cidrs; neither lifts METADATA.
PRIVATE_LIKE = frozenset({Category.PRIVATE, Category.SHARED, Category.SITE_LOCAL})
# Reported as private_address; metadata is metadata_address; every other
# non-routable category is special_address.
_LOCAL = PRIVATE_LIKE | {Category.LOOPBACK, Category.LINK_LOCAL}


@dataclass(frozen=True, slots=True)
class Range:
    """One row of the address table: a network and its category."""

    network: IPNetwork
    category: Category
    name: str


def _r(cidr: str, category: Category, name: str) -> Range:
    return Range(ipaddress.ip_network(cidr), category, name)


C = Category
SPECIAL_PURPOSE: tuple[Range, ...] = (
    # IPv4 (IANA IPv4 Special-Purpose Address Registry)
    _r("0.0.0.0/0", C.GLOBAL, "global unicast"),
    _r("0.0.0.0/8", C.THIS_NETWORK, "this network (RFC 791)"),
    _r("0.0.0.0/32", C.UNSPECIFIED, "unspecified (this host)"),
    _r("10.0.0.0/8", C.PRIVATE, "private use (RFC 1918)"),
    _r("100.64.0.0/10", C.SHARED, "shared address space / CGNAT (RFC 6598)"),
    _r("127.0.0.0/8", C.LOOPBACK, "loopback (RFC 1122)"),
    _r("169.254.0.0/16", C.LINK_LOCAL, "link-local (RFC 3927)"),
    _r("172.16.0.0/12", C.PRIVATE, "private use (RFC 1918)"),
    _r("192.0.0.0/24", C.PROTOCOL_ASSIGNMENTS, "IETF protocol assignments (RFC 6890)"),
    _r("192.0.0.9/32", C.GLOBAL, "port control protocol anycast (RFC 7723)"),
    _r("192.0.0.10/32", C.GLOBAL, "TURN anycast (RFC 8155)"),
    _r("192.0.2.0/24", C.DOCUMENTATION, "documentation TEST-NET-1 (RFC 5737)"),
    _r("192.88.99.0/24", C.RESERVED, "deprecated 6to4 relay anycast (RFC 7526)"),
    _r("192.168.0.0/16", C.PRIVATE, "private use (RFC 1918)"),
    _r("198.18.0.0/15", C.BENCHMARKING, "benchmarking (RFC 2544)"),
    _r("198.51.100.0/24", C.DOCUMENTATION, "documentation TEST-NET-2 (RFC 5737)"),
    _r("203.0.113.0/24", C.DOCUMENTATION, "documentation TEST-NET-3 (RFC 5737)"),
    _r("224.0.0.0/4", C.MULTICAST, "multicast (RFC 5771)"),
    _r("233.252.0.0/24", C.DOCUMENTATION, "MCAST-TEST-NET documentation (RFC 6676)"),
    _r("240.0.0.0/4", C.RESERVED, "reserved (RFC 1112)"),
    _r("255.255.255.255/32", C.BROADCAST, "limited broadcast (RFC 919)"),
    # IPv6 (IANA IPv6 Special-Purpose Address Registry). Only 2000::/3 is
    # allocated global unicast; everything else is reserved unless listed.
    _r("::/0", C.RESERVED, "reserved by IETF (outside 2000::/3)"),
    _r("2000::/3", C.GLOBAL, "global unicast"),
    _r("::/128", C.UNSPECIFIED, "unspecified (RFC 4291)"),
    _r("::1/128", C.LOOPBACK, "loopback (RFC 4291)"),
    _r("::/96", C.IPV4_EMBEDDING, "IPv4-compatible, deprecated (RFC 4291)"),
    _r("::ffff:0:0/96", C.IPV4_EMBEDDING, "IPv4-mapped (RFC 4291)"),
    _r("::ffff:0:0:0/96", C.IPV4_EMBEDDING, "IPv4-translated (RFC 2765)"),
    _r("64:ff9b::/96", C.TRANSLATION, "NAT64 well-known prefix (RFC 6052)"),
    _r("64:ff9b:1::/48", C.IPV4_EMBEDDING, "local-use IPv4/IPv6 translation (RFC 8215)"),
    _r("100::/64", C.DISCARD, "discard-only (RFC 6666)"),
    _r("100:0:0:1::/64", C.DISCARD, "dummy IPv6 prefix (RFC 9780)"),
    _r("2001::/23", C.PROTOCOL_ASSIGNMENTS, "IETF protocol assignments (RFC 2928)"),
    _r("2001::/32", C.TUNNEL, "Teredo (RFC 4380)"),
    _r("2001:1::1/128", C.GLOBAL, "port control protocol anycast (RFC 7723)"),
    _r("2001:1::2/128", C.GLOBAL, "TURN anycast (RFC 8155)"),
    _r("2001:1::3/128", C.GLOBAL, "DNS-SD service registration anycast (RFC 9665)"),
    _r("2001:2::/48", C.BENCHMARKING, "benchmarking (RFC 5180)"),
    _r("2001:3::/32", C.GLOBAL, "AMT (RFC 7450)"),
    _r("2001:4:112::/48", C.GLOBAL, "AS112-v6 (RFC 7535)"),
    _r("2001:10::/28", C.RESERVED, "deprecated ORCHID (RFC 4843)"),
    _r("2001:20::/28", C.GLOBAL, "ORCHIDv2 (RFC 7343)"),
    _r("2001:30::/28", C.GLOBAL, "drone remote ID (RFC 9374)"),
    _r("2001:db8::/32", C.DOCUMENTATION, "documentation (RFC 3849)"),
    _r("2002::/16", C.TUNNEL, "6to4 (RFC 3056)"),
    _r("3fff::/20", C.DOCUMENTATION, "documentation (RFC 9637)"),
    _r("5f00::/16", C.RESERVED, "segment routing SIDs (RFC 9602)"),
    _r("fc00::/7", C.PRIVATE, "unique local (RFC 4193)"),
    _r("fe80::/10", C.LINK_LOCAL, "link-local unicast (RFC 4291)"),
    _r("fec0::/10", C.SITE_LOCAL, "site-local, deprecated (RFC 3879)"),
    _r("ff00::/8", C.MULTICAST, "multicast (RFC 4291)"),
)
# Cloud metadata and instance-identity endpoints: what a workload on that
# instance can read there (role credentials, tokens, user data) belongs to the
# instance. Closed on purpose: only addresses a provider documents, each with
# its source; a provider's *names* (metadata.google.internal ...) need no entry,
# as whatever they resolve to is judged here.
METADATA_ENDPOINTS: tuple[Range, ...] = (
    # IPv4
    # AWS EC2 Instance Metadata Service (EC2 User Guide, "Instance metadata");
    # the same address serves GCP ("View and query VM metadata"), Azure IMDS (Microsoft
    # Learn, "Azure Instance Metadata Service"), Oracle OCI ("Getting Instance
    # Metadata"), OpenStack Nova, DigitalOcean, Akamai/Linode and others.
    _r("169.254.169.254/32", C.METADATA, "instance metadata service of AWS, GCP, Azure, OCI..."),
    # AWS Route 53 Resolver in every VPC (VPC User Guide, "Amazon DNS server").
    _r("169.254.169.253/32", C.METADATA, "AWS VPC DNS resolver (Route 53 Resolver)"),
    # AWS ECS task metadata and task-role credentials, v2 and later
    # (ECS Developer Guide, "Amazon ECS task IAM role"; the AWS SDKs' container
    # credential provider).
    _r("169.254.170.2/32", C.METADATA, "AWS ECS task metadata and credentials endpoint"),
    # AWS EKS Pod Identity Agent (EKS User Guide, "Set up the Amazon EKS Pod Identity Agent").
    _r("169.254.170.23/32", C.METADATA, "AWS EKS Pod Identity Agent (pod credentials)"),
    # Tencent Cloud CVM metadata: metadata.tencentyun.com (Tencent Cloud docs,
    # "Querying Instance Metadata") answers at this address, which is what
    # DataDog's agent (pkg/util/cloudproviders/tencent) queries directly.
    _r("169.254.0.23/32", C.METADATA, "Tencent Cloud CVM instance metadata"),
    # Scaleway Instances metadata API (cloud-init docs, "Scaleway" datasource).
    _r("169.254.42.42/32", C.METADATA, "Scaleway instance metadata"),
    # Alibaba Cloud ECS instance metadata, inside CGNAT space (Alibaba Cloud ECS
    # docs, "Instance metadata"; cloud-init docs, "Alibaba Cloud (AliYun)" datasource).
    _r("100.100.100.200/32", C.METADATA, "Alibaba Cloud ECS instance metadata"),
    # Azure WireServer, a publicly routed address: VM agent, DHCP, DNS, health
    # probes (Microsoft Learn, "What is IP address 168.63.129.16?").
    _r("168.63.129.16/32", C.METADATA, "Azure WireServer (platform channel)"),
    # Oracle Cloud Infrastructure Compute Classic instance metadata (Oracle docs,
    # "Retrieving Instance Metadata": http://192.0.0.192/{version}/metadata).
    _r("192.0.0.192/32", C.METADATA, "Oracle Cloud Compute Classic instance metadata"),
    # IPv6
    # AWS IMDS on Nitro instances (EC2 User Guide; AWS whitepaper "IPv6 on AWS",
    # "Supporting Amazon VPC services").
    _r("fd00:ec2::254/128", C.METADATA, "AWS EC2 instance metadata service (IPv6)"),
    # AWS Route 53 Resolver over IPv6 (VPC User Guide, "Amazon DNS server").
    _r("fd00:ec2::253/128", C.METADATA, "AWS VPC DNS resolver (IPv6)"),
    # AWS EKS Pod Identity Agent over IPv6 (EKS User Guide, as above).
    _r("fd00:ec2::23/128", C.METADATA, "AWS EKS Pod Identity Agent (IPv6)"),
    # Google Compute Engine metadata server for IPv6 (used as GCE_METADATA_HOST
    # "[fd20:ce::254]" in GoogleCloudPlatform/k8s-config-connector).
    _r("fd20:ce::254/128", C.METADATA, "Google Compute Engine metadata server (IPv6)"),
    # Akamai/Linode Metadata service (Akamai TechDocs, "Access the Metadata service API").
    _r("fd00:a9fe:a9fe::1/128", C.METADATA, "Akamai (Linode) metadata service (IPv6)"),
    # Scaleway Instances metadata API over IPv6 (cloud-init docs, "Scaleway" datasource).
    _r("fd00:42::42/128", C.METADATA, "Scaleway instance metadata (IPv6)"),
    # OpenStack Neutron metadata over IPv6 (neutron-specs, Ussuri, "IPv6 support
    # in Metadata service"): the link-local twin of 169.254.169.254.
    _r("fe80::a9fe:a9fe/128", C.METADATA, "OpenStack metadata service (IPv6)"),
)
del C
# Longest prefix wins, so an endpoint is metadata whatever range holds it.
TABLE: tuple[Range, ...] = SPECIAL_PURPOSE + METADATA_ENDPOINTS


def _index(table: tuple[Range, ...], version: int) -> dict[int, dict[int, Range]]:
    by_len: dict[int, dict[int, Range]] = {}
    for entry in table:
        if entry.network.version == version:
            by_len.setdefault(entry.network.prefixlen, {})[int(entry.network.network_address)] = (
                entry
            )
    return dict(sorted(by_len.items(), reverse=True))


_V4 = _index(TABLE, 4)
_V6 = _index(TABLE, 6)


def _mask(bits: int, prefixlen: int) -> int:
    return ((1 << bits) - 1) ^ ((1 << (bits - prefixlen)) - 1)


def lookup(ip: IPAddress) -> Range:
    """The most specific table entry that contains `ip` (always one)."""
    bits = ip.max_prefixlen
    value = int(ip)
    for prefixlen, entries in (_V4 if ip.version == 4 else _V6).items():
        entry = entries.get(value & _mask(bits, prefixlen))
        if entry is not None:
            return entry
    raise AssertionError("the table has a /0 entry for each family")


class EmbedKind(StrEnum):
    MAPPED = "ipv4_mapped"
    COMPATIBLE = "ipv4_compatible"
    TRANSLATED = "ipv4_translated"
    NAT64 = "nat64"
    SIX_TO_FOUR = "6to4"
    TEREDO_SERVER = "teredo_server"
    TEREDO_CLIENT = "teredo_client"


def _v4(value: int) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(value & 0xFFFFFFFF)


def embedded_ipv4(ip: IPAddress) -> Iterator[tuple[EmbedKind, ipaddress.IPv4Address]]:
    """Yield every IPv4 address an IPv6 address carries, with how it is carried."""
    if ip.version == 4:
        return
    value = int(ip)
    top96 = value >> 32
    if top96 == 0xFFFF:
        yield EmbedKind.MAPPED, _v4(value)
    elif top96 == 0xFFFF_0000:
        yield EmbedKind.TRANSLATED, _v4(value)
    elif top96 == 0 and value > 1:
        yield EmbedKind.COMPATIBLE, _v4(value)
    yield from _translation_embedding(value)
    if value >> 112 == 0x2002:
        yield EmbedKind.SIX_TO_FOUR, _v4(value >> 80)
    if value >> 96 == 0x2001_0000:
        yield EmbedKind.TEREDO_SERVER, _v4(value >> 64)
        # The client address is stored inverted (RFC 4380 §4).
        yield EmbedKind.TEREDO_CLIENT, _v4(~value)


def _translation_embedding(value: int) -> Iterator[tuple[EmbedKind, ipaddress.IPv4Address]]:
    if value >> 32 == 0x0064_FF9B_0000_0000_0000_0000:
        yield EmbedKind.NAT64, _v4(value)
    elif value >> 80 == 0x0064_FF9B_0001:
        # Local-use prefix: the operator picks the prefix length (RFC 6052
        # §2.2), so judge both the /96 and the /48 placements.
        yield EmbedKind.NAT64, _v4(value)
        high = (value >> 64) & 0xFFFF
        low = (value >> 40) & 0xFFFF
        yield EmbedKind.NAT64, _v4((high << 16) | low)


def unwrap_mapped(ip: IPAddress) -> IPAddress:
    """The IPv4 address behind an IPv4-mapped IPv6 address, else `ip` itself.

    Used where the kernel itself treats the two as one endpoint (a dual-stack
    socket connecting to ::ffff:127.0.0.1 reaches 127.0.0.1).
    """
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_routable(category: Category) -> bool:
    return category in ROUTABLE


def is_metadata(ip: IPAddress) -> bool:
    """True when `ip`, or an IPv4 address it carries, is a cloud metadata endpoint."""
    if lookup(ip).category is Category.METADATA:
        return True
    return any(lookup(v4).category is Category.METADATA for _, v4 in embedded_ipv4(ip))


def reason_for(category: Category) -> Reason:
    """The denial reason for a non-routable category."""
    if category is Category.METADATA:
        return _METADATA_ADDRESS
    return _PRIVATE_ADDRESS if category in _LOCAL else _SPECIAL_ADDRESS
