"""Policy entries and their indexes: parse one pattern, match in O(labels).

Pure. A pattern is a host name, `*.suffix` (subdomains only), an IP literal
(`[v6]` bracketed when a port follows) or a CIDR, each with an optional
`:port`. Matching never scans the rule list: names are looked up by exact
name and by each parent suffix, addresses by each prefix length in use, so
the cost grows with the number of labels, not the number of rules.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from egressbox.core.errors import HostError
from egressbox.core.hosts import canonical_ip_text, format_authority, normalize_host, parse_port
from egressbox.core.ip import IPAddress, IPNetwork

# "Too broad" (DESIGN §3): CIDRs shorter than these admit a large part of
# the Internet at once and need the explicit long form.
MIN_IPV4_PREFIX = 8
MIN_IPV6_PREFIX = 32


class RuleKind(StrEnum):
    NAME = "name"
    WILDCARD = "wildcard"  # *.suffix: subdomains only
    ANY_NAME = "any_name"  # * : every name (long form only)
    IP = "ip"
    CIDR = "cidr"


class PatternError(ValueError):
    """A pattern that cannot be used; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One allow or deny entry, normalized."""

    kind: RuleKind
    value: str  # normalized name, suffix without "*.", IP text or network text
    port: int | None = None
    private: bool = False  # lifts the private-range ban for this rule's addresses
    broad: bool = False  # written in the explicit long form for a broad entry
    network: IPNetwork | None = None

    @property
    def text(self) -> str:
        """The canonical spelling, as shown in decisions and `check` output."""
        if self.kind is RuleKind.WILDCARD:
            host = f"*.{self.value}"
        elif self.kind is RuleKind.ANY_NAME:
            host = "*"
        elif self.kind is RuleKind.CIDR and ":" in self.value:
            return f"[{self.value}]:{self.port}" if self.port else self.value
        else:
            host = self.value
        return format_authority(host, self.port)

    def is_too_broad(self) -> bool:
        if self.kind is RuleKind.ANY_NAME:
            return True
        if self.kind is RuleKind.WILDCARD:
            return "." not in self.value
        if self.kind is RuleKind.CIDR and self.network is not None:
            return self.network.prefixlen < min_prefix(self.network)
        return False

    def admits_port(self, port: int) -> bool:
        return self.port is None or self.port == port


def min_prefix(network: IPNetwork) -> int:
    return MIN_IPV4_PREFIX if network.version == 4 else MIN_IPV6_PREFIX


def parse_network(text: str) -> IPNetwork:
    """A CIDR with host bits clear, or PatternError naming the fix."""
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError:
        pass
    try:
        loose = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise PatternError(f'"{text}" is not a network{_network_hint(text)}') from None
    raise PatternError(f'"{text}" has host bits set; use "{loose}"')


def _network_hint(text: str) -> str:
    # "10.0.0/8" is a classic typo: suggest the padded form if it parses.
    addr, sep, length = text.partition("/")
    parts = addr.split(".")
    if sep and ":" not in addr and 1 <= len(parts) < 4 and all(p.isdigit() for p in parts):
        padded = ".".join(parts + ["0"] * (4 - len(parts))) + "/" + length
        try:
            return f'; use "{ipaddress.ip_network(padded, strict=False)}"'
        except ValueError:
            return ""
    return "; write it as ADDRESS/LENGTH, e.g. 10.0.0.0/8 or 2001:db8::/32"


def parse_pattern(raw: str, *, private: bool = False, broad: bool = False) -> Rule:
    """Parse one allow/deny pattern into a Rule, or raise PatternError."""
    text = raw.strip()
    if not text:
        raise PatternError("empty pattern; write a host name, *.suffix, IP or CIDR")
    host_text, port = _split_port(text)
    kind, value, network = _classify_host(host_text)
    return Rule(kind, value, port, private, broad, network)


def _split_port(text: str) -> tuple[str, int | None]:
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise PatternError(f'"{text}" has an unbalanced "["')
        host, rest = text[1:end], text[end + 1 :]
        if ":" not in host:
            raise PatternError(
                f'"{text}": brackets are only for IPv6 addresses, as in "[2001:db8::1]:443"'
            )
        if rest and not rest.startswith(":"):
            raise PatternError(f'"{text}": only ":PORT" may follow "]"')
        return host, _port(rest[1:], text) if rest else None
    if text.count(":") > 1:
        return text, None  # a bare IPv6 address or network, no port
    host, sep, port = text.partition(":")
    return host, _port(port, text) if sep else None


def _port(text: str, pattern: str) -> int:
    try:
        return parse_port(text)
    except HostError:
        raise PatternError(f'"{pattern}": the port must be a number from 1 to 65535') from None


def _classify_host(text: str) -> tuple[RuleKind, str, IPNetwork | None]:
    if text == "*":
        return RuleKind.ANY_NAME, "*", None
    if "/" in text:
        network = parse_network(text)
        return RuleKind.CIDR, str(network), network
    if "*" in text:
        return RuleKind.WILDCARD, _wildcard_suffix(text), None
    try:
        host = normalize_host(text)
    except HostError as exc:
        raise PatternError(f'"{text}" is not a valid host ({exc})') from None
    if host.ip is not None:
        return RuleKind.IP, canonical_ip_text(host.ip), None
    return RuleKind.NAME, host.text, None


def _wildcard_suffix(text: str) -> str:
    if not text.startswith("*.") or "*" in text[2:]:
        raise PatternError(
            f'"{text}": "*" may only be the whole first label, as in "*.example.com"'
        )
    try:
        host = normalize_host(text[2:])
    except HostError as exc:
        raise PatternError(f'"{text}" is not a valid wildcard ({exc})') from None
    if host.ip is not None:
        raise PatternError(f'"{text}": a wildcard needs a domain name; use a CIDR for addresses')
    return host.text


T = TypeVar("T")


class CidrIndex(Generic[T]):
    """Networks grouped by prefix length: a lookup costs one dict probe per length in use."""

    __slots__ = ("_by_len", "_v4", "_v6")

    def __init__(self) -> None:
        self._by_len: dict[tuple[int, int], dict[int, list[T]]] = {}
        # Per family, (mask, bucket) with the longest prefix first, so the
        # most specific match comes first; rebuilt only when a length is added.
        self._v4: list[tuple[int, dict[int, list[T]]]] = []
        self._v6: list[tuple[int, dict[int, list[T]]]] = []

    def add(self, network: IPNetwork, value: T) -> None:
        key = (network.version, network.prefixlen)
        bucket = self._by_len.get(key)
        if bucket is None:
            bucket = self._by_len[key] = {}
            self._plan()
        bucket.setdefault(int(network.network_address), []).append(value)

    def _plan(self) -> None:
        plans: dict[int, list[tuple[int, dict[int, list[T]]]]] = {4: [], 6: []}
        for (version, prefixlen), bucket in sorted(self._by_len.items(), key=lambda kv: -kv[0][1]):
            bits = 32 if version == 4 else 128
            mask = ((1 << bits) - 1) ^ ((1 << (bits - prefixlen)) - 1)
            plans[version].append((mask, bucket))
        self._v4, self._v6 = plans[4], plans[6]

    def lookup_all(self, ip: IPAddress) -> list[list[T]]:
        value = int(ip)
        found = []
        for mask, bucket in self._v4 if ip.version == 4 else self._v6:
            hit = bucket.get(value & mask)
            if hit is not None:
                found.append(hit)
        return found

    def first(self, ip: IPAddress) -> T | None:
        value = int(ip)
        for mask, bucket in self._v4 if ip.version == 4 else self._v6:
            hit = bucket.get(value & mask)
            if hit:
                return hit[0]
        return None


@dataclass(slots=True)
class RuleSet:
    """An index over rules: exact names, wildcard suffixes, IPs, CIDRs."""

    rules: tuple[Rule, ...] = ()
    _names: dict[str, list[Rule]] = field(default_factory=dict)
    _suffixes: dict[str, list[Rule]] = field(default_factory=dict)
    _any: list[Rule] = field(default_factory=list)
    _ips: dict[IPAddress, list[Rule]] = field(default_factory=dict)
    _cidrs: CidrIndex[Rule] = field(default_factory=CidrIndex)

    @classmethod
    def build(cls, rules: Iterable[Rule]) -> RuleSet:
        built = cls(tuple(rules))
        for rule in built.rules:
            built._add(rule)
        return built

    def _add(self, rule: Rule) -> None:
        if rule.kind is RuleKind.NAME:
            self._names.setdefault(rule.value, []).append(rule)
        elif rule.kind is RuleKind.WILDCARD:
            self._suffixes.setdefault(rule.value, []).append(rule)
        elif rule.kind is RuleKind.ANY_NAME:
            self._any.append(rule)
        elif rule.kind is RuleKind.IP:
            self._ips.setdefault(ipaddress.ip_address(rule.value), []).append(rule)
        elif rule.network is not None:
            self._cidrs.add(rule.network, rule)

    def match_name(self, name: str, port: int) -> Rule | None:
        """The most specific rule admitting `name:port`: exact, then longest suffix."""
        found = _first_for_port(self._names.get(name), port)
        if found is not None:
            return found
        suffixes = self._suffixes
        if suffixes:
            # "*.example.com" matches "a.example.com" and "a.b.example.com",
            # never "example.com" itself: start from the parent of `name`,
            # longest suffix first.
            dot = name.find(".")
            while dot >= 0:
                found = _first_for_port(suffixes.get(name[dot + 1 :]), port)
                if found is not None:
                    return found
                dot = name.find(".", dot + 1)
        return _first_for_port(self._any, port)

    def match_ip(self, ip: IPAddress, port: int) -> Rule | None:
        found = _first_for_port(self._ips.get(ip), port)
        if found is not None:
            return found
        for rules in self._cidrs.lookup_all(ip):
            found = _first_for_port(rules, port)
            if found is not None:
                return found
        return None

    def for_any_port(self, name: str, ip: IPAddress | None) -> list[Rule]:
        """Rules that would match the host on some port (for a denial's explanation)."""
        if ip is not None:
            found = list(self._ips.get(ip, ()))
            for rules in self._cidrs.lookup_all(ip):
                found += rules
            return found
        found = list(self._names.get(name, ()))
        dot = name.find(".")
        while dot >= 0:
            found += self._suffixes.get(name[dot + 1 :], ())
            dot = name.find(".", dot + 1)
        return found + self._any


def _first_for_port(rules: list[Rule] | None, port: int) -> Rule | None:
    if rules:
        for rule in rules:
            if rule.admits_port(port):
                return rule
    return None
