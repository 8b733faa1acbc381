"""The decision: name rules, then every resolved address, into one Decision.

Pure. `egress.check` is the only caller that mixes in DNS; everything that
decides lives here so it can be tested without sockets. The order matters
and is the contract of DESIGN §3:

1. no policy -> deny; deny patterns beat allow patterns;
2. no allow match -> deny *before* any DNS query (report mode: would_deny);
3. every address: deny_cidrs, then the proxy's own listeners, then cloud
   metadata endpoints (lifted only by an allow entry naming that exact
   address), then the private/special-range ban (lifted only by allow_cidrs
   or private = true), each also for an IPv4 address embedded in an IPv6 one;
4. one denied address denies the name (a mixed answer signals rebinding);
5. the decision carries the checked addresses: the dialer uses only these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Final, NamedTuple

from egressbox.core.addresses import (
    PRIVATE_LIKE,
    Category,
    embedded_ipv4,
    is_routable,
    lookup,
    reason_for,
    unwrap_mapped,
)
from egressbox.core.errors import HostError, Reason, Verdict
from egressbox.core.hosts import (
    INVALID_HOST_TEXT,
    Host,
    canonical_ip_text,
    check_port,
    normalize_host,
    parse_port,
)
from egressbox.core.ip import IPAddress
from egressbox.core.policy import Mode, Policy
from egressbox.core.rules import Rule, RuleKind

# Enum members bound once (docs/development.md, "The compiled core's speed rules").
_ALLOW: Final = Verdict.ALLOW
_ALLOWED: Final = Reason.ALLOWED
_BAD_PORT: Final = Reason.BAD_PORT
_DENY: Final = Verdict.DENY
_DENY_CIDR: Final = Reason.DENY_CIDR
_DENY_RULE: Final = Reason.DENY_RULE
_DNS_FAILURE: Final = Reason.DNS_FAILURE
_METADATA_ADDRESS: Final = Reason.METADATA_ADDRESS
_NO_ALLOW_RULE: Final = Reason.NO_ALLOW_RULE
_NO_POLICY: Final = Reason.NO_POLICY
_REPORT: Final = Mode.REPORT
_SELF_CONNECTION: Final = Reason.SELF_CONNECTION
_WOULD_DENY: Final = Verdict.WOULD_DENY


@dataclass(frozen=True, slots=True)
class Decision:
    """The one value every part shares: audit record, reply, log line, explain."""

    verdict: Verdict
    reason: Reason
    host: str  # normalized host, or "(invalid)" when it could not be parsed
    port: int  # 0 when the port itself was bad
    addresses: tuple[IPAddress, ...] = ()  # the checked addresses: dial only these
    rule: str | None = None  # the policy entry that decided, as written canonically
    detail: str = ""  # one sentence for humans; built from normalized parts only

    @property
    def allowed(self) -> bool:
        """True when the connection goes ahead (allow, or would_deny in report mode)."""
        return self.verdict is not _DENY


@dataclass(frozen=True, slots=True)
class Target:
    """A destination as asked for: host and port."""

    host: Host
    port: int


@dataclass(frozen=True, slots=True)
class NamePass:
    """Name rules let the target through; its addresses are still to be checked."""

    target: Target
    rule: Rule | None  # None only in report mode, when no allow entry matched
    would_deny: Reason | None = None


@dataclass(frozen=True, slots=True)
class SelfEndpoints:
    """The proxy's own listeners, so that nobody is proxied back into the proxy."""

    endpoints: frozenset[tuple[IPAddress, int]] = frozenset()
    # Ports of listeners on a wildcard address: every local address reaches them.
    wildcard_ports: frozenset[int] = frozenset()
    local_addresses: frozenset[IPAddress] = frozenset()
    # Every listening port, so that most addresses are cleared with one probe.
    _ports: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ports = self.wildcard_ports | {p for _, p in self.endpoints}
        object.__setattr__(self, "_ports", ports)

    def contains(self, ip: IPAddress, port: int) -> bool:
        if port not in self._ports:
            return False
        addr = unwrap_mapped(ip)
        if (addr, port) in self.endpoints:
            return True
        # Linux connects 0.0.0.0 and :: to the local host.
        if addr.is_unspecified:
            return True
        if port not in self.wildcard_ports:
            return False
        return lookup(addr).category is Category.LOOPBACK or addr in self.local_addresses


NO_SELF = SelfEndpoints()


def deny(
    reason: Reason,
    target: Target,
    detail: str,
    *,
    rule: str | None = None,
    addresses: tuple[IPAddress, ...] = (),
) -> Decision:
    return Decision(_DENY, reason, target.host.text, target.port, addresses, rule, detail)


# Normalized hosts kept for reuse: a proxy sees the same few names over and
# over, and normalization (IDNA, label checks) is most of a name decision's
# cost. normalize_host is pure, so a cached Host is the same answer; errors are
# not cached. 4096 entries (a few hundred bytes each) matches the DNS cache.
NORMALIZE_CACHE_SIZE = 4096
_normalize_host = lru_cache(maxsize=NORMALIZE_CACHE_SIZE)(normalize_host)


def parse_target(host: str, port: int | str) -> Target:
    """Normalize a requested host and port; raises HostError (bad_host/bad_port)."""
    normalized = _normalize_host(host)
    number = parse_port(port) if isinstance(port, str) else check_port(port)
    return Target(normalized, number)


def bad_target(error: HostError, port: int | str = 0) -> Decision:
    """The decision for a target that could not be parsed; never echoes it."""
    number = port if isinstance(port, int) and 1 <= port <= 65535 else 0
    if error.reason is _BAD_PORT:
        number = 0
    return Decision(_DENY, error.reason, INVALID_HOST_TEXT, number, detail=str(error))


def no_policy(target: Target) -> Decision:
    return deny(_NO_POLICY, target, "no policy is loaded: every destination is denied")


def decide_name(policy: Policy | None, target: Target) -> Decision | NamePass:
    """Apply the name rules. A Decision here is final (and no DNS is needed)."""
    if policy is None:
        return no_policy(target)
    host, port = target.host, target.port
    if host.ip is not None:
        denied = policy.deny.match_ip(host.ip, port)
        allowed = policy.allow.match_ip(host.ip, port)
    else:
        denied = policy.deny.match_name(host.text, port)
        allowed = policy.allow.match_name(host.text, port)
    if denied is not None:
        detail = f"{target.host.authority(port)} matches deny entry {denied.text}"
        return deny(_DENY_RULE, target, detail, rule=denied.text)
    if allowed is not None:
        return NamePass(target, allowed)
    what = "IP address" if host.is_ip else "name"
    if policy.mode is _REPORT:
        return NamePass(target, None, _NO_ALLOW_RULE)
    return deny(_NO_ALLOW_RULE, target, _no_rule_detail(policy, target, what))


def _no_rule_detail(policy: Policy, target: Target, what: str) -> str:
    host = target.host
    near = policy.allow.for_any_port(host.text, host.ip)
    if near:
        # The host is admitted, on other ports: say which, not why names and IPs differ.
        ports = ", ".join(sorted({str(r.port) for r in near if r.port is not None}))
        return (
            f"no allow entry admits port {target.port} of {host.text}: "
            f"{', '.join(r.text for r in near[:3])} admit{'s' if len(near) == 1 else ''} "
            f"port{'s' if ',' in ports else ''} {ports} only"
        )
    hint = " (a name entry never admits an IP literal)" if host.is_ip else ""
    return f"no allow entry matches the {what} {host.authority(target.port)}{hint}"


def decide_addresses(
    policy: Policy,
    passed: NamePass,
    addresses: Sequence[IPAddress],
    *,
    names: Sequence[str] = (),
    self_endpoints: SelfEndpoints = NO_SELF,
) -> Decision:
    """Judge every address (and the CNAME chain); one denial denies the target."""
    target, rule = passed.target, passed.rule
    checked = tuple(dict.fromkeys(addresses))
    rule_text = rule.text if rule is not None else None
    if not checked:
        return deny(_DNS_FAILURE, target, "the name has no addresses", rule=rule_text)
    for name in names[1:]:
        hit = policy.deny.match_name(name, target.port)
        if hit is not None:
            detail = (
                f"{target.host.text} is an alias of {name}, which matches deny entry {hit.text}"
            )
            return deny(_DENY_RULE, target, detail, rule=hit.text, addresses=checked)
    for ip in checked:
        refusal = check_address(policy, ip, target.port, rule, self_endpoints)
        if refusal is not None:
            blamed = refusal.rule or rule_text
            return deny(refusal.reason, target, refusal.detail, rule=blamed, addresses=checked)
    if passed.would_deny is not None:
        detail = "report mode: " + _no_rule_detail(
            policy, target, "IP address" if target.host.is_ip else "name"
        )
        return Decision(
            _WOULD_DENY,
            passed.would_deny,
            target.host.text,
            target.port,
            checked,
            None,
            detail,
        )
    detail = f"allowed by {rule_text}"
    return Decision(_ALLOW, _ALLOWED, target.host.text, target.port, checked, rule_text, detail)


class Refusal(NamedTuple):
    reason: Reason
    detail: str
    rule: str | None = None  # the deny entry, when one refused the address


def check_address(
    policy: Policy, ip: IPAddress, port: int, rule: Rule | None, self_endpoints: SelfEndpoints
) -> Refusal | None:
    """Why `ip:port` may not be dialed, or None when it may."""
    addrs = (ip, *(v4 for _, v4 in embedded_ipv4(ip)))
    for addr in addrs:
        net = policy.deny_cidr_for(addr)
        if net is not None:
            return Refusal(_DENY_CIDR, f"{canonical_ip_text(ip)} is inside deny_cidrs entry {net}")
    for addr in addrs:
        # An IP or CIDR deny entry also refuses a name that resolves into it.
        hit = policy.deny.match_ip(addr, port)
        if hit is not None:
            detail = f"{canonical_ip_text(ip)} port {port} matches deny entry {hit.text}"
            return Refusal(_DENY_RULE, detail, hit.text)
    for addr in addrs:
        if self_endpoints.contains(addr, port):
            detail = f"{canonical_ip_text(ip)} port {port} is this proxy's own listener"
            return Refusal(_SELF_CONNECTION, detail)
    # An explicit allow_cidrs entry for the address as resolved lifts the ban;
    # an IPv4 entry never admits an IPv6 form wrapping that IPv4 address.
    granted = policy.allow_cidr_for(ip) is not None
    private_ok = policy.allow_private or (rule is not None and rule.private)
    banned: Refusal | None = None
    for addr in addrs:
        category = lookup(addr).category
        if category is Category.METADATA:
            # Nothing broad lifts this (allow_cidrs, allow_private, a CIDR
            # entry, a name): only the entry naming this very address, which
            # a wrapped form never is. It outranks the wrapper's own ban.
            if not _names_exactly(rule, addr):
                return Refusal(_METADATA_ADDRESS, _metadata_detail(ip, addr))
            continue
        if banned is not None or is_routable(category) or granted:
            continue
        if category in PRIVATE_LIKE and private_ok:
            continue
        banned = Refusal(reason_for(category), _range_detail(canonical_ip_text(ip), addr))
    return banned


def _names_exactly(rule: Rule | None, addr: IPAddress) -> bool:
    """Whether `rule` is an IP-literal allow entry for exactly `addr`.

    Such a rule matched only because the target was that IP literal: names
    never match IP entries, and a CIDR entry is never "exact", even a /32.
    """
    return rule is not None and rule.kind is RuleKind.IP and rule.value == canonical_ip_text(addr)


def _metadata_detail(ip: IPAddress, addr: IPAddress) -> str:
    text = canonical_ip_text(ip)
    inner = "" if addr == ip else f" (it carries {canonical_ip_text(addr)})"
    return (
        f"{text}{inner} is a cloud metadata endpoint ({lookup(addr).name}); only an allow"
        " entry naming exactly that address, asked for as that IP literal, admits it"
        " (allow_cidrs, allow_private, CIDR entries and names never do)"
    )


def _range_detail(text: str, addr: IPAddress) -> str:
    entry = lookup(addr)
    inner = "" if canonical_ip_text(addr) == text else f" (it carries {addr})"
    fix = "add a covering egress.allow_cidrs entry"
    if entry.category in PRIVATE_LIKE:
        fix += ", set allow_private = true, or write the entry with private = true"
    return f"{text}{inner} is in {entry.network}, {entry.name}; to admit it, {fix}"
