"""Suggest a policy from audit records: admit exactly what was observed, nothing more.

The usual workflow: run a trusted program under report mode (``mode = "report"``), then
``egressbox audit --suggest-policy audit.jsonl > policy.toml``, review, and enforce.

What is admitted: every host:port seen ``allow``, ``would_deny`` (report mode), or
``deny`` for ``no_allow_rule`` (an enforcing policy that lacked the entry). Each entry
carries its exact port. Names stay exact unless MIN_SIBLINGS or more distinct names
share a parent domain on one port (see ``_wildcards``). IP literals stay single addresses.

What is never admitted silently: a destination refused for ``private_address``,
``special_address``, ``metadata_address``, ``deny_cidr`` or ``self_connection``, and an IP
literal in a private or special range or naming a cloud metadata endpoint. They appear
commented out, under a ``# WARNING:`` line saying why and what to add if the destination
is intended. Everything else that was refused (DNS failures, deny rules, bad hosts) is
listed in a closing comment.

Pure: no file or network access; the output is checked by ``load_policy`` in the tests.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from egressbox.addresses import (
    PRIVATE_LIKE,
    embedded_ipv4,
    is_metadata,
    is_routable,
    lookup,
    reason_for,
)
from egressbox.audit import SummaryRow, format_ts
from egressbox.errors import Reason
from egressbox.hosts import format_authority
from egressbox.policy import REPORT_MODE_WARNING, Mode, Policy
from egressbox.rules import IPNetwork, PatternError, Rule, RuleKind, min_prefix, parse_pattern

__all__ = [
    "METADATA_DENY_CIDRS",
    "MIN_SIBLINGS",
    "Entry",
    "Ignored",
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

_ADMITTED_BY = frozenset({Reason.ALLOWED, Reason.NO_ALLOW_RULE})

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


@dataclass(frozen=True, slots=True)
class Withheld:
    """A destination shown commented out: refused, or in a private or special range."""

    pattern: str
    reason: Reason
    connections: int


@dataclass(frozen=True, slots=True)
class Ignored:
    """A destination refused for a reason no allow entry changes (DNS, deny rule ...)."""

    target: str
    reasons: tuple[tuple[Reason, int], ...]


@dataclass(frozen=True, slots=True)
class Suggestion:
    allow: tuple[Entry, ...]
    withheld: tuple[Withheld, ...]
    ignored: tuple[Ignored, ...]
    records: int
    first_ts: datetime | None
    last_ts: datetime | None


@dataclass(frozen=True, slots=True)
class _Seen:
    rule: Rule
    row: SummaryRow

    @property
    def admitted(self) -> int:
        return sum(n for reason, n in self.row.reasons.items() if reason in _ADMITTED_BY)

    @property
    def warned(self) -> tuple[tuple[Reason, int], ...]:
        return tuple((r, n) for r, n in self.row.reasons.items() if r in _WARNINGS)


def _destination(row: SummaryRow) -> Rule | None:
    """The row's host:port as an exact name or IP rule, or None if it is not one."""
    try:
        rule = parse_pattern(format_authority(row.host, row.port))
    except PatternError:
        return None
    # A record's host is a normalized name or an IP; "*" or "*.x" in a crafted log must
    # never turn into a wildcard entry.
    return rule if rule.kind in (RuleKind.NAME, RuleKind.IP) else None


def plan_suggestion(
    rows: Iterable[SummaryRow], *, base: Policy | None = None, min_siblings: int = MIN_SIBLINGS
) -> Suggestion:
    """Decide entries from summarize() rows (bounded memory: one row per host:port)."""
    admitted: list[_Seen] = []
    withheld: list[Withheld] = []
    ignored: list[Ignored] = []
    records, first, last = 0, None, None
    for row in rows:
        records += row.total
        first = row.first_ts if first is None else min(first, row.first_ts)
        last = row.last_ts if last is None else max(last, row.last_ts)
        _sort_row(row, base, admitted, withheld, ignored)
    names = [seen for seen in admitted if seen.rule.kind is RuleKind.NAME]
    ips = [seen for seen in admitted if seen.rule.kind is RuleKind.IP]
    allow = _name_entries(names, min_siblings) + [_entry(seen) for seen in _ordered(ips)]
    return Suggestion(
        allow=tuple(allow),
        withheld=tuple(sorted(withheld, key=lambda w: w.pattern)),
        ignored=tuple(sorted(ignored, key=lambda i: i.target)),
        records=records,
        first_ts=first,
        last_ts=last,
    )


def _sort_row(
    row: SummaryRow,
    base: Policy | None,
    admitted: list[_Seen],
    withheld: list[Withheld],
    ignored: list[Ignored],
) -> None:
    rule = _destination(row)
    if rule is None:
        ignored.append(Ignored(f"{row.host!r} port {row.port}: not a host:port", _reasons(row)))
        return
    seen = _Seen(rule, row)
    concern = _address_concern(rule, base)
    if seen.admitted and concern is not None:
        withheld.append(Withheld(rule.text, concern, seen.admitted))
    elif seen.admitted:
        admitted.append(seen)  # any refusals become a note on the entry
    elif seen.warned:
        reason, count = seen.warned[0]
        withheld.append(Withheld(rule.text, reason, count))
    else:
        ignored.append(Ignored(rule.text, _reasons(row)))


def _reasons(row: SummaryRow) -> tuple[tuple[Reason, int], ...]:
    return tuple(row.reasons.items())


def _address_concern(rule: Rule, base: Policy | None) -> Reason | None:
    """For an IP literal in a private or special range: the reason it needs a grant.

    None when it is routable, or when the base policy (carried over into the output)
    grants it through allow_cidrs or allow_private. A cloud metadata endpoint is always a
    concern: the suggested entry itself would be the one grant that admits it.
    """
    if rule.kind is not RuleKind.IP:
        return None
    ip = ipaddress.ip_address(rule.value)
    if is_metadata(ip):  # itself or the IPv4 address it carries, as the decision sees it
        return Reason.METADATA_ADDRESS
    for addr in (ip, *(v4 for _, v4 in embedded_ipv4(ip))):
        category = lookup(addr).category
        if is_routable(category):
            continue
        if base is not None and (
            base.allow_cidr_for(ip) is not None or (base.allow_private and category in PRIVATE_LIKE)
        ):
            continue
        return reason_for(category)
    return None


def _labels_key(seen: _Seen) -> tuple[tuple[str, ...], int]:
    # Reversed labels group related names together: example.com, a.example.com, b...
    return tuple(reversed(seen.rule.value.split("."))), seen.rule.port or 0


def _ordered(seen: Iterable[_Seen]) -> list[_Seen]:
    return sorted(seen, key=_labels_key)


def _entry(seen: _Seen) -> Entry:
    notes = tuple(
        f"{seen.rule.text} was also refused {_plural(count, 'time')} for {reason.value}: "
        "some of its answers pointed where this entry does not reach (a changing answer "
        "can be DNS rebinding); those stay denied."
        for reason, count in seen.warned
    )
    return Entry(seen.rule.text, seen.admitted, notes=notes)


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


def _name_entries(names: Sequence[_Seen], min_siblings: int) -> list[Entry]:
    wildcards = _wildcards(names, min_siblings)
    groups: dict[tuple[str, int], list[_Seen]] = {}
    entries: list[tuple[tuple[tuple[str, ...], int], Entry]] = []
    for seen in _ordered(names):
        port = seen.rule.port or 0
        suffix = _covering(seen.rule.value, port, wildcards)
        if suffix is None:
            entries.append((_labels_key(seen), _entry(seen)))
        else:
            groups.setdefault((suffix, port), []).append(seen)
    for (suffix, port), members in groups.items():
        pattern = f"*.{suffix}:{port}"
        covers = tuple(seen.rule.value for seen in members)
        total = sum(seen.admitted for seen in members)
        notes = tuple(note for seen in members for note in _entry(seen).notes)
        key = ((*reversed(suffix.split(".")), "*"), port)
        entries.append((key, Entry(pattern, total, covers, notes)))
    entries.sort(key=lambda item: item[0])
    return [entry for _, entry in entries]


# --------------------------------------------------------------------------- rendering


def _comment_safe(text: str) -> str:
    """Text for a TOML comment: no control character may end the comment early."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _toml_string(text: str) -> str:
    # JSON string syntax with ensure_ascii is valid TOML basic-string syntax.
    return json.dumps(text, ensure_ascii=True)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _header(suggestion: Suggestion, sources: Sequence[str]) -> list[str]:
    span = "no records"
    if suggestion.first_ts is not None and suggestion.last_ts is not None:
        span = f"{format_ts(suggestion.first_ts)} .. {format_ts(suggestion.last_ts)}"
    lines = [
        "# egressbox policy suggested by `egressbox audit --suggest-policy`.",
        f"# Sources: {_comment_safe(', '.join(sources)) if sources else '(none named)'}",
        f"# Records: {suggestion.records}, {span} (UTC)",
        "#",
        "# It admits exactly the host:port pairs seen allowed, would_deny (report mode) or",
        "# denied for want of an allow entry. Review every entry before enforcing it:",
        "# the log shows what a program did, not what it should do.",
        "# Names are admitted by name: the addresses they resolve to are still checked, and",
        "# a private or special one stays denied unless egress.allow_cidrs covers it.",
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
    lines.append(f"    {_toml_string(entry.pattern)},  # {tail}")
    return lines


def _withheld_lines(item: Withheld) -> list[str]:
    text = (
        f"{item.pattern} is not admitted ({_plural(item.connections, 'connection')}, "
        f"{item.reason.value}): {_WARNINGS[item.reason]}"
    )
    return [*_comment("WARNING: ", text), f"    # {_toml_string(item.pattern)},"]


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
    for item in suggestion.withheld:
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
        lines += ["deny = []", "allow_cidrs = []"]
    else:
        origin = _comment_safe(base.source or "the base policy")
        lines.append(f"# deny, allow_cidrs, deny_cidrs and allow_private kept from {origin}")
        lines.append(_list("deny", (_toml_string(rule.text) for rule in base.deny.rules)))
        lines.append(_list("allow_cidrs", (_network_text(net) for net in base.allow_cidrs)))
        deny_cidrs += [net for net in base.deny_cidrs if net not in deny_cidrs]
        if base.allow_private:
            lines.append("allow_private = true")
    lines.append(_list("deny_cidrs", (_toml_string(str(net)) for net in deny_cidrs)))
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
    return "\n".join(lines) + "\n"


def suggest_policy(
    rows: Iterable[SummaryRow],
    *,
    sources: Sequence[str] = (),
    base: Policy | None = None,
    min_siblings: int = MIN_SIBLINGS,
) -> str:
    """summarize() rows in, TOML text out. ``base`` supplies deny/allow_cidrs to keep."""
    suggestion = plan_suggestion(rows, base=base, min_siblings=min_siblings)
    return render_policy(suggestion, sources=sources, base=base, min_siblings=min_siblings)
