"""Suggest a policy from audit records: admit what was let through, nothing more.

The usual workflow: run a trusted program under report mode (``mode = "report"``), then
``egressbox audit --suggest-policy audit.jsonl > policy.toml``, review, and enforce.

What is admitted: every host:port whose records are ``allow`` or ``would_deny`` (report
mode), with its exact port. Names stay exact unless MIN_SIBLINGS or more distinct names
share a parent domain on one port (see ``_wildcards``). IP literals stay single addresses.
Records of protocol ``tcp`` (captured connections) count like ``connect`` ones.

Local destinations a program was let through to (a registry on ``localhost:5000`` or
``127.0.0.1:8080``, a database on ``10.0.0.5:5432``, typically learned in report mode)
are admitted together with the one-address ``allow_cidrs`` entry each needs, commented
with why (core/local.py): every address is checked, so the entry alone would not work.

What is never admitted: a destination whose records are all ``deny`` (whatever the
reason); one refused as ``self_connection``; an IP literal in a special range or naming a
cloud metadata endpoint, or a local one the log shows only refused (even when a base
policy grants its range: the entry stays for a person to uncomment). Those appear
commented out in the allow list with the reason, the address classes under a
``# WARNING:`` line saying what to add if intended.
Refusals no allow entry changes (DNS failures, deny rules, bad hosts) are listed in a
closing comment. A ``dns`` record (a name question, port 0) never becomes an entry: it is
counted on an entry that admits the name with a port, or else listed as a hint.

Pure: no file or network access; the output is checked by ``load_policy`` in the tests.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import textwrap
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from egressbox.audit.record import AuditProtocol, AuditRecord, format_ts
from egressbox.core.addresses import (
    PRIVATE_LIKE,
    embedded_ipv4,
    is_metadata,
    is_routable,
    lookup,
    reason_for,
)
from egressbox.core.errors import Reason, Verdict
from egressbox.core.hosts import format_authority
from egressbox.core.ip import IPNetwork
from egressbox.core.local import Grant, grants_needed, local_category
from egressbox.core.policy import REPORT_MODE_WARNING, Mode, Policy
from egressbox.core.rules import PatternError, Rule, RuleKind, min_prefix, parse_pattern

__all__ = [
    "METADATA_DENY_CIDRS",
    "MIN_SIBLINGS",
    "Entry",
    "Ignored",
    "Lookup",
    "Suggestion",
    "Withheld",
    "plan_suggestion",
    "render_policy",
    "suggest_policy",
    "with_mode",
]

# A *.parent wildcard replaces exact names only when at least this many distinct names
# directly under one parent domain were seen on the same port. Two names (www + api) are
# often a coincidence and stay exact; three or more siblings (shard1/2/3.cdn.example.com,
# per-region endpoints) show a naming pattern that the next run is likely to extend, and
# the wildcard is still confined to that one parent and port.
MIN_SIBLINGS = 3

# Cloud metadata endpoints (AWS/GCP/Azure IPv4, AWS IPv6): kept in every suggestion, as in
# the example policies, so that an allow_cidrs entry added later cannot open them.
METADATA_DENY_CIDRS = ("169.254.169.254/32", "fd00:ec2::254/128")

# Second-level labels that, under a two-letter country code, form a public suffix
# (co.uk, com.au, ac.jp ...). Without a public suffix list this heuristic keeps a
# wildcard from ever covering a whole registry such as *.co.uk.
_PUBLIC_SECOND_LEVEL = frozenset(
    {"ac", "co", "com", "edu", "gob", "go", "gov", "mil", "ne", "net", "or", "org"}
)

# Covered names listed in the comment next to a wildcard, and refused destinations
# listed in the closing comment; the rest is counted, to keep the file readable.
_SHOW_COVERED = 5
_SHOW_IGNORED = 50
_COMMENT_WIDTH = 96  # the project's line length is 100

# Denials an allow entry would have turned around: shown as commented-out entries.
_ENTRY_REASONS = frozenset({Reason.NO_ALLOW_RULE, Reason.NO_POLICY})
# Address classes an IP literal is withheld for, whatever the log says of it.
_ADDRESS_CLASSES = frozenset(
    {Reason.PRIVATE_ADDRESS, Reason.SPECIAL_ADDRESS, Reason.METADATA_ADDRESS}
)

# Why a refused destination is not admitted, and what to add if it is intended.
_WARNINGS: Mapping[Reason, str] = {
    Reason.PRIVATE_ADDRESS: (
        "it is or resolved to a private address (RFC 1918, loopback, link-local, ULA). "
        "If intended, uncomment it and add an egress.allow_cidrs entry covering that "
        "address (for RFC 1918 and ULA ranges, private = true on the entry also works)."
    ),
    Reason.SPECIAL_ADDRESS: (
        "it is or resolved to a special-purpose address (reserved, documentation, "
        "multicast, CGNAT ...). If intended, uncomment it and add an egress.allow_cidrs "
        "entry covering that address."
    ),
    Reason.METADATA_ADDRESS: (
        "it is or resolved to a cloud metadata endpoint, which hands out this instance's "
        "credentials. If intended, uncomment it as the exact IP literal the client asks for "
        "and drop any egress.deny_cidrs entry covering it; nothing broader admits it."
    ),
    Reason.DENY_CIDR: (
        "its address is in egress.deny_cidrs (by default the cloud metadata service), "
        "which beats every allow entry; it stays denied unless that deny_cidrs entry goes."
    ),
    Reason.SELF_CONNECTION: (
        "it is this proxy's own listener; a connection back into the proxy is always "
        "refused, so the entry could never take effect."
    ),
}


def with_mode(policy: Policy, mode: Mode) -> Policy:
    """The same policy in another mode (``--report-only``); the original is untouched.

    ``dataclasses.replace`` would hand the new Policy the old one's CIDR indexes, which
    ``__post_init__`` would then fill a second time (mutating the original's). Every
    derived field (an ``_``-prefixed one with a default factory) is therefore passed fresh.
    """
    fresh = {
        f.name: f.default_factory()
        for f in dataclasses.fields(policy)
        if f.name.startswith("_") and f.default_factory is not dataclasses.MISSING
    }
    warnings = tuple(w for w in policy.warnings if w != REPORT_MODE_WARNING)
    if mode is Mode.REPORT:
        warnings += (REPORT_MODE_WARNING,)
    return dataclasses.replace(policy, mode=mode, warnings=warnings, **fresh)


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class Entry:
    """One allow entry: an exact host:port, or a wildcard standing for ``covers``."""

    pattern: str
    connections: int
    covers: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # warnings shown above an entry that is still admitted
    lookups: int = 0  # dns records (allow or would_deny) for the names it admits


@dataclass(frozen=True, slots=True)
class Withheld:
    """A destination shown commented out: denied, or in a class that needs a grant."""

    pattern: str
    reason: Reason  # why it is withheld: a _WARNINGS reason or an _ENTRY_REASONS one
    let_through: int  # records allow or would_deny
    denied: tuple[tuple[Reason, int], ...]  # deny records by reason
    grant: str | None = None  # what in the base policy already covers the address


@dataclass(frozen=True, slots=True)
class Ignored:
    """A destination refused for a reason no allow entry changes (DNS, deny rule ...)."""

    target: str
    reasons: tuple[tuple[Reason, int], ...]


@dataclass(frozen=True, slots=True)
class Lookup:
    """A name only asked of the DNS (no record with a port admits it): a hint."""

    name: str
    outcomes: tuple[tuple[Verdict, Reason, int], ...]


@dataclass(frozen=True, slots=True)
class Suggestion:
    """Allow entries suggested from an audit log, with what was left out and why."""

    allow: tuple[Entry, ...]
    withheld: tuple[Withheld, ...]
    ignored: tuple[Ignored, ...]
    records: int
    first_ts: datetime | None
    last_ts: datetime | None
    lookups: tuple[Lookup, ...] = ()
    grants: tuple[Grant, ...] = ()  # allow_cidrs the admitted local destinations need

    @property
    def commented(self) -> int:
        """Destinations seen but not admitted (each is a commented line in the file)."""
        return len(self.withheld) + len(self.ignored) + len(self.lookups)


@dataclass(slots=True)
class _Tally:
    """Counts by (decision, reason) for one destination, in first-seen order."""

    outcomes: Counter[tuple[Verdict, Reason]] = field(default_factory=Counter)

    @property
    def let_through(self) -> int:
        return sum(n for (verdict, _), n in self.outcomes.items() if verdict is not Verdict.DENY)

    def reasons(self, verdict: Verdict) -> tuple[tuple[Reason, int], ...]:
        counts: Counter[Reason] = Counter()
        for (seen, reason), n in self.outcomes.items():
            if seen is verdict:
                counts[reason] += n
        return tuple(counts.items())


@dataclass(slots=True)
class _Log:
    """What the records showed: tallies per host:port, and per name asked of the DNS."""

    destinations: dict[tuple[str, int], _Tally] = field(default_factory=dict)
    lookups: dict[str, _Tally] = field(default_factory=dict)
    records: int = 0
    first_ts: datetime | None = None
    last_ts: datetime | None = None

    def add(self, record: AuditRecord) -> None:
        self.records += 1
        self.first_ts = record.ts if self.first_ts is None else min(self.first_ts, record.ts)
        self.last_ts = record.ts if self.last_ts is None else max(self.last_ts, record.ts)
        if record.protocol is AuditProtocol.DNS:  # a question: its port 0 is no port
            tally = self.lookups.setdefault(record.host, _Tally())
        else:
            tally = self.destinations.setdefault((record.host, record.port), _Tally())
        tally.outcomes[record.decision, record.reason] += 1


@dataclass(frozen=True, slots=True)
class _Seen:
    """A suggested rule and the records it would have admitted."""

    rule: Rule
    tally: _Tally

    @property
    def admitted(self) -> int:
        return self.tally.let_through

    @property
    def denied(self) -> tuple[tuple[Reason, int], ...]:
        return self.tally.reasons(Verdict.DENY)

    @property
    def warned(self) -> tuple[tuple[Reason, int], ...]:
        return tuple((r, n) for r, n in self.denied if r in _WARNINGS)


def _destination(host: str, port: int) -> Rule | None:
    """The host:port as an exact name or IP rule, or None if it is not one."""
    try:
        rule = parse_pattern(format_authority(host, port))
    except PatternError:
        return None
    # A record's host is a normalized name or an IP; "*" or "*.x" in a crafted log must
    # never turn into a wildcard entry, and port 0 (a dns question's) is no port.
    if rule.port is None or rule.kind not in (RuleKind.NAME, RuleKind.IP):
        return None
    return rule


def plan_suggestion(
    records: Iterable[AuditRecord],
    *,
    base: Policy | None = None,
    min_siblings: int = MIN_SIBLINGS,
) -> Suggestion:
    """Decide entries from audit records (bounded memory: one tally per destination)."""
    log = _Log()
    for record in records:
        log.add(record)
    sorting = _Sorted(base)
    for (host, port), tally in log.destinations.items():
        sorting.add(host, port, tally)
    names = [seen for seen in sorting.admitted if seen.rule.kind is RuleKind.NAME]
    ips = [seen for seen in sorting.admitted if seen.rule.kind is RuleKind.IP]
    asked = {name: tally.let_through for name, tally in log.lookups.items()}
    allow = _name_entries(names, min_siblings, asked) + [_entry(seen) for seen in _ordered(ips)]
    return Suggestion(
        allow=tuple(allow),
        withheld=tuple(sorted(sorting.withheld, key=lambda w: w.pattern)),
        ignored=tuple(sorted(sorting.ignored, key=lambda i: i.target)),
        records=log.records,
        first_ts=log.first_ts,
        last_ts=log.last_ts,
        lookups=_hints(log.lookups, {seen.rule.value for seen in names}),
        grants=_grants(sorting.admitted, base),
    )


def _grants(admitted: Iterable[_Seen], base: Policy | None) -> tuple[Grant, ...]:
    """One allow_cidrs entry per local address an admitted destination needs, unless
    the base policy (kept in the output) already covers it."""
    found: dict[IPNetwork, list[Grant]] = {}
    for seen in _ordered(admitted):
        for grant in grants_needed(seen.rule.value, seen.rule.port or 0):
            if base is None or not _base_covers(base, grant.network):
                found.setdefault(grant.network, []).append(grant)
    merged = [Grant(net, "; ".join(g.why for g in grants)) for net, grants in found.items()]
    return tuple(sorted(merged, key=lambda g: (g.network.version, g.network)))


def _base_covers(base: Policy, network: IPNetwork) -> bool:
    ip = network.network_address
    if base.allow_cidr_for(ip) is not None:
        return True
    return base.allow_private and lookup(ip).category in PRIVATE_LIKE


@dataclass(slots=True)
class _Sorted:
    """Destinations sorted into admitted, withheld (commented out) and ignored."""

    base: Policy | None
    admitted: list[_Seen] = field(default_factory=list)
    withheld: list[Withheld] = field(default_factory=list)
    ignored: list[Ignored] = field(default_factory=list)

    def add(self, host: str, port: int, tally: _Tally) -> None:
        rule = _destination(host, port)
        if rule is None:
            target = f"{host!r} port {port}: not a host:port"
            self.ignored.append(Ignored(target, _all_reasons(tally)))
            return
        seen = _Seen(rule, tally)
        reason = _withheld_for(seen)
        if reason is not None:
            grant = _base_grant(rule, self.base) if reason in _ADDRESS_CLASSES else None
            self.withheld.append(Withheld(rule.text, reason, seen.admitted, seen.denied, grant))
        elif seen.admitted or _held_back_by_address(seen):
            self.admitted.append(seen)  # any refusals become a note on the entry
        else:
            self.ignored.append(Ignored(rule.text, seen.denied))


def _withheld_for(seen: _Seen) -> Reason | None:
    """Why the destination is shown commented out, or None (admitted, or ignored)."""
    if any(reason is Reason.SELF_CONNECTION for reason, _ in seen.denied):
        return Reason.SELF_CONNECTION  # the proxy's own listener: never an entry
    local = _held_back_by_address(seen) or (seen.admitted and _grantable(seen.rule))
    concern = _address_concern(seen.rule)
    if concern is not None and not local:
        return concern
    if seen.admitted or local:
        return None
    if seen.warned:
        return seen.warned[0][0]
    return next((reason for reason, _ in seen.denied if reason in _ENTRY_REASONS), None)


def _grantable(rule: Rule) -> bool:
    """An IP literal a one-address allow_cidrs entry may open (loopback, private ...)."""
    return rule.kind is RuleKind.IP and local_category(ipaddress.ip_address(rule.value)) is not None


def _held_back_by_address(seen: _Seen) -> bool:
    """A local destination (localhost, a loopback or private literal) the log shows refused
    for private_address: its name rules passed (or report mode let them), only the address
    class stopped it, even in report mode. That is what learning a local registry looks
    like, and exactly what the one-address grant written for it lifts."""
    refused = any(reason is Reason.PRIVATE_ADDRESS for reason, _ in seen.denied)
    return refused and bool(grants_needed(seen.rule.value, seen.rule.port or 0))


def _all_reasons(tally: _Tally) -> tuple[tuple[Reason, int], ...]:
    counts: Counter[Reason] = Counter()
    for (_, reason), n in tally.outcomes.items():
        counts[reason] += n
    return tuple(counts.items())


def _address_concern(rule: Rule) -> Reason | None:
    """For an IP literal in a private or special range or a metadata endpoint: which.

    Whatever a base policy grants, such a literal is never admitted uncommented: a log
    shows what a program did, and a learned entry must not open an internal address.
    """
    if rule.kind is not RuleKind.IP:
        return None
    ip = ipaddress.ip_address(rule.value)
    if is_metadata(ip):  # itself or the IPv4 address it carries, as the decision sees it
        return Reason.METADATA_ADDRESS
    for addr in (ip, *(v4 for _, v4 in embedded_ipv4(ip))):
        category = lookup(addr).category
        if not is_routable(category):
            return reason_for(category)
    return None


def _base_grant(rule: Rule, base: Policy | None) -> str | None:
    """What of the base policy (kept in the output) admits the literal's address, if any."""
    if base is None or rule.kind is not RuleKind.IP:
        return None
    ip = ipaddress.ip_address(rule.value)
    if is_metadata(ip):  # only an exact allow entry admits a metadata endpoint
        return None
    net = base.allow_cidr_for(ip)
    if net is not None:
        return f"the base policy's allow_cidrs entry {net} (kept below) covers it"
    categories = [lookup(a).category for a in (ip, *(v4 for _, v4 in embedded_ipv4(ip)))]
    private = [c for c in categories if not is_routable(c)]
    if base.allow_private and all(c in PRIVATE_LIKE for c in private):
        return "allow_private = true, kept from the base policy, covers it"
    return None


def _hints(lookups: Mapping[str, _Tally], admitted: set[str]) -> tuple[Lookup, ...]:
    """Names asked of the DNS that no admitted entry names: hints, never entries."""
    hints = [
        Lookup(name, tuple((v, r, n) for (v, r), n in tally.outcomes.items()))
        for name, tally in lookups.items()
        if name not in admitted
    ]
    return tuple(sorted(hints, key=lambda hint: hint.name))


def _labels_key(seen: _Seen) -> tuple[tuple[str, ...], int]:
    # Reversed labels group related names together: example.com, a.example.com, b...
    return tuple(reversed(seen.rule.value.split("."))), seen.rule.port or 0


def _ordered(seen: Iterable[_Seen]) -> list[_Seen]:
    return sorted(seen, key=_labels_key)


def _notes(seen: _Seen) -> tuple[str, ...]:
    """Warnings for an admitted destination that the log also shows refused."""
    target = seen.rule.text
    # A local destination's private_address refusals are what its allow_cidrs grant lifts.
    granted = {Reason.PRIVATE_ADDRESS} if grants_needed(seen.rule.value, 0) else set()
    notes = [
        f"{target} was also refused {_plural(count, 'time')} for {reason.value}: "
        "some of its answers pointed where this entry does not reach (a changing answer "
        "can be DNS rebinding); those stay denied."
        for reason, count in seen.warned
        if reason not in granted
    ]
    lifted = sum(n for r, n in seen.denied if r in granted)
    if lifted:
        notes.append(
            f"{target} was refused {_plural(lifted, 'time')} for private_address (a local "
            "address is denied even in report mode); the allow_cidrs entry written for it "
            "below is what admits it."
        )
    other = [(r, n) for r, n in seen.denied if r not in _WARNINGS]
    if other:
        notes.append(
            f"{target} was also denied in the log ({_counts(other)}); the entry is here for "
            "the connections that were let through."
        )
    late = [
        (r, n)
        for r, n in seen.tally.reasons(Verdict.WOULD_DENY)
        if r not in _ENTRY_REASONS and r not in granted
    ]
    if late:
        notes.append(
            f"{target} was let through in report mode although {_counts(late)} closes such "
            "a connection in enforce mode, entry or not."
        )
    return tuple(notes)


def _entry(seen: _Seen, asked: Mapping[str, int] | None = None) -> Entry:
    lookups = (asked or {}).get(seen.rule.value, 0) if seen.rule.kind is RuleKind.NAME else 0
    return Entry(seen.rule.text, seen.admitted, notes=_notes(seen), lookups=lookups)


def _parent(name: str) -> str | None:
    _, dot, parent = name.partition(".")
    return parent if dot else None


def _wildcard_worthy(suffix: str) -> bool:
    """Never a one-label suffix (*.com) nor a public-suffix-looking one (*.co.uk)."""
    labels = suffix.split(".")
    if len(labels) < 2:
        return False
    looks_public = len(labels) == 2 and len(labels[1]) == 2 and labels[0] in _PUBLIC_SECOND_LEVEL
    return not looks_public


def _wildcards(names: Sequence[_Seen], min_siblings: int) -> set[tuple[str, int]]:
    """(parent, port) pairs that become ``*.parent:port``, outermost only."""
    children: dict[tuple[str, int], set[str]] = {}
    for seen in names:
        parent = _parent(seen.rule.value)
        if parent is not None and seen.rule.port is not None:
            children.setdefault((parent, seen.rule.port), set()).add(seen.rule.value)
    chosen = {
        key
        for key, kids in children.items()
        if len(kids) >= min_siblings and _wildcard_worthy(key[0])
    }
    # *.a.example.com inside *.example.com on the same port adds nothing.
    return {(suffix, port) for suffix, port in chosen if _covering(suffix, port, chosen) is None}


def _covering(name: str, port: int, wildcards: set[tuple[str, int]]) -> str | None:
    """The outermost chosen suffix that ``*.suffix:port`` would match ``name`` with."""
    found = None
    parent = _parent(name)
    while parent is not None:
        if (parent, port) in wildcards:
            found = parent
        parent = _parent(parent)
    return found


def _name_entries(
    names: Sequence[_Seen], min_siblings: int, asked: Mapping[str, int]
) -> list[Entry]:
    wildcards = _wildcards(names, min_siblings)
    groups: dict[tuple[str, int], list[_Seen]] = {}
    entries: list[tuple[tuple[tuple[str, ...], int], Entry]] = []
    for seen in _ordered(names):
        port = seen.rule.port or 0
        suffix = _covering(seen.rule.value, port, wildcards)
        if suffix is None:
            entries.append((_labels_key(seen), _entry(seen, asked)))
        else:
            groups.setdefault((suffix, port), []).append(seen)
    for (suffix, port), members in groups.items():
        key = ((*reversed(suffix.split(".")), "*"), port)
        entries.append((key, _wildcard_entry(suffix, port, members, asked)))
    entries.sort(key=lambda item: item[0])
    return [entry for _, entry in entries]


def _wildcard_entry(
    suffix: str, port: int, members: Sequence[_Seen], asked: Mapping[str, int]
) -> Entry:
    return Entry(
        pattern=f"*.{suffix}:{port}",
        connections=sum(seen.admitted for seen in members),
        covers=tuple(seen.rule.value for seen in members),
        notes=tuple(note for seen in members for note in _notes(seen)),
        lookups=sum(asked.get(seen.rule.value, 0) for seen in members),
    )


# --------------------------------------------------------------------------- rendering


def _comment_safe(text: str) -> str:
    """Text for a TOML comment: no control character may end the comment early."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _toml_string(text: str) -> str:
    # JSON string syntax with ensure_ascii is valid TOML basic-string syntax.
    return json.dumps(text, ensure_ascii=True)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _counts(reasons: Iterable[tuple[Reason, int]]) -> str:
    """``no_allow_rule`` for one record, ``no_allow_rule x3`` for more."""
    return ", ".join(reason.value + (f" x{n}" if n > 1 else "") for reason, n in reasons)


def _header(suggestion: Suggestion, sources: Sequence[str]) -> list[str]:
    span = "no records"
    if suggestion.first_ts is not None and suggestion.last_ts is not None:
        span = f"{format_ts(suggestion.first_ts)} .. {format_ts(suggestion.last_ts)}"
    lines = [
        "# egressbox policy suggested by `egressbox audit --suggest-policy`.",
        f"# Sources: {_comment_safe(', '.join(sources)) if sources else '(none named)'}",
        f"# Records: {suggestion.records}, {span} (UTC)",
        "#",
        "# It admits exactly the host:port pairs the log shows allowed or would_deny (report",
        "# mode). Destinations denied in the log, and special, metadata or the proxy's own",
        "# addresses, are commented out with the reason. Review every entry before enforcing",
        "# it: the log shows what a program did, not what it should do.",
        "# Names are admitted by name: the addresses they resolve to are still checked, and",
        "# a private or special one stays denied unless egress.allow_cidrs covers it. A local",
        "# destination let through (localhost, loopback or private addresses) gets the",
        "# one-address allow_cidrs entry it needs, with why.",
        "# Validate with: egressbox check FILE",
        "",
    ]
    return lines


def _comment(label: str, text: str) -> list[str]:
    """A wrapped comment inside the allow list: ``# LABEL: text`` then indented lines."""
    return textwrap.wrap(
        _comment_safe(text),
        width=_COMMENT_WIDTH,
        initial_indent=f"    # {label}",
        subsequent_indent="    #   ",
        break_on_hyphens=False,
    )


def _entry_lines(entry: Entry) -> list[str]:
    lines = [line for note in entry.notes for line in _comment("NOTE: ", note)]
    if entry.covers:
        shown = ", ".join(entry.covers[:_SHOW_COVERED])
        more = len(entry.covers) - _SHOW_COVERED
        text = f"{entry.pattern} stands for {len(entry.covers)} names seen: {shown}"
        lines += _comment("", text + (f" and {more} more" if more > 0 else ""))
    tail = _plural(entry.connections, "connection")
    if entry.lookups:
        tail += f", {_plural(entry.lookups, 'lookup')}"
    lines.append(f"    {_toml_string(entry.pattern)},  # {tail}")
    return lines


def _withheld_lines(item: Withheld) -> list[str]:
    lines: list[str] = []
    if item.reason in _WARNINGS:
        text = f"{item.pattern} is not admitted ({item.reason.value}): {_WARNINGS[item.reason]}"
        if item.grant is not None:
            text += f" Here {item.grant}: uncommenting is enough."
        lines += _comment("WARNING: ", text)
    parts = []
    if item.let_through:
        parts.append(f"{_plural(item.let_through, 'connection')} let through in the log")
    if item.denied:
        parts.append(f"denied in the log: {_counts(item.denied)}")
    tail = _comment_safe("; ".join(parts))
    lines.append(f"    # {_toml_string(item.pattern)},  # {tail}")
    return lines


def _allow_lines(suggestion: Suggestion, min_siblings: int) -> list[str]:
    lines = ["allow = ["]
    if any(entry.covers for entry in suggestion.allow):
        lines += [
            f"    # A *.parent:port entry replaces {min_siblings} or more names seen directly",
            "    # under one parent domain on one port; fewer stay exact names. A one-label",
            "    # suffix (*.com) or a public-suffix-looking one (*.co.uk) is never used.",
        ]
    for entry in suggestion.allow:
        lines += _entry_lines(entry)
    warned = [item for item in suggestion.withheld if item.reason in _WARNINGS]
    denied = [item for item in suggestion.withheld if item.reason not in _WARNINGS]
    for item in warned:
        lines += _withheld_lines(item)
    if denied:
        lines.append("    # Denied in the log: uncomment an entry only if the program needs it.")
    for item in denied:
        lines += _withheld_lines(item)
    lines.append("]")
    return lines


def _network_text(net: IPNetwork) -> str:
    text = _toml_string(str(net))
    if net.prefixlen < min_prefix(net):
        return f"{{ cidr = {text}, broad = true }}"
    return text


def _list(key: str, items: Iterable[str]) -> str:
    return f"{key} = [{', '.join(items)}]"


def _egress_lines(suggestion: Suggestion, base: Policy | None, min_siblings: int) -> list[str]:
    lines = ["[egress]", 'mode = "enforce"', *_allow_lines(suggestion, min_siblings)]
    deny_cidrs = [ipaddress.ip_network(text) for text in METADATA_DENY_CIDRS]
    if base is None:
        lines += ["deny = []", *_allow_cidrs_lines((), suggestion.grants)]
    else:
        origin = _comment_safe(base.source or "the base policy")
        lines.append(f"# deny, allow_cidrs, deny_cidrs and allow_private kept from {origin}")
        lines.append(_list("deny", (_toml_string(rule.text) for rule in base.deny.rules)))
        lines += _allow_cidrs_lines(base.allow_cidrs, suggestion.grants)
        deny_cidrs += [net for net in base.deny_cidrs if net not in deny_cidrs]
        if base.allow_private:
            lines.append("allow_private = true")
    lines.append(_list("deny_cidrs", (_toml_string(str(net)) for net in deny_cidrs)))
    return lines


def _allow_cidrs_lines(kept: Sequence[IPNetwork], grants: Sequence[Grant]) -> list[str]:
    """allow_cidrs: the base policy's entries, then each grant with why above it."""
    if not grants:
        return [_list("allow_cidrs", (_network_text(net) for net in kept))]
    lines = ["allow_cidrs = ["]
    lines += [f"    {_network_text(net)}," for net in kept]
    for grant in grants:
        lines += _comment("", f"{grant.network}: {grant.why}.")
        lines.append(f"    {_network_text(grant.network)},")
    lines.append("]")
    return lines


def _ignored_lines(suggestion: Suggestion) -> list[str]:
    if not suggestion.ignored:
        return []
    lines = [
        "",
        "# Seen but not admitted: refused for reasons an allow entry does not change",
        "# (DNS failures, deny rules, malformed targets, limits).",
    ]
    for item in suggestion.ignored[:_SHOW_IGNORED]:
        counts = ", ".join(f"{reason.value} x{count}" for reason, count in item.reasons)
        lines.append(f"#   {_comment_safe(item.target)}: {counts}")
    more = len(suggestion.ignored) - _SHOW_IGNORED
    if more > 0:
        lines.append(f"#   ... and {more} more")
    return lines


def _outcome_text(verdict: Verdict, reason: Reason, count: int) -> str:
    """``allow``, ``deny no_allow_rule x3``: the reason only where the verdict lacks it."""
    text = verdict.value if reason is Reason.ALLOWED else f"{verdict.value} {reason.value}"
    return text + (f" x{count}" if count > 1 else "")


def _lookup_lines(suggestion: Suggestion) -> list[str]:
    if not suggestion.lookups:
        return []
    lines = [
        "",
        "# Names only asked of the DNS: a question has no port, so none is an entry. If the",
        '# program connects to one, add "NAME:PORT" for the port it uses.',
    ]
    for hint in suggestion.lookups[:_SHOW_IGNORED]:
        counts = ", ".join(_outcome_text(*outcome) for outcome in hint.outcomes)
        lines.append(f"#   {_comment_safe(hint.name)}: {counts}")
    more = len(suggestion.lookups) - _SHOW_IGNORED
    if more > 0:
        lines.append(f"#   ... and {more} more")
    return lines


def render_policy(
    suggestion: Suggestion,
    *,
    sources: Sequence[str] = (),
    base: Policy | None = None,
    min_siblings: int = MIN_SIBLINGS,
) -> str:
    """The suggestion as a TOML policy file that ``egressbox check`` accepts."""
    lines = _header(suggestion, sources)
    lines += _egress_lines(suggestion, base, min_siblings)
    lines += _ignored_lines(suggestion)
    lines += _lookup_lines(suggestion)
    return "\n".join(lines) + "\n"


def suggest_policy(
    records: Iterable[AuditRecord],
    *,
    sources: Sequence[str] = (),
    base: Policy | None = None,
    min_siblings: int = MIN_SIBLINGS,
) -> str:
    """Audit records in, TOML text out. ``base`` supplies deny/allow_cidrs to keep."""
    suggestion = plan_suggestion(records, base=base, min_siblings=min_siblings)
    return render_policy(suggestion, sources=sources, base=base, min_siblings=min_siblings)
