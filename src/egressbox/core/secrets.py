"""Secrets the child never holds, and rules for what is sent to a terminated host (pure).

A `[[secret]]` entry names a variable the child sees holding a placeholder; the proxy puts
the real value into requests to the hosts the entry binds (proxy/broker.py reads the value,
proxy/terminate.py speaks TLS). `[[request_rule]]` entries limit the methods, path prefixes,
requests and request bytes sent to a host the proxy terminates. `[tls]` names the extra CAs
that verify origins and, for `serve`, the operator's CA.

This module parses and judges; it reads nothing and holds no value.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

from egressbox.core.errors import EgressboxError, Reason

if TYPE_CHECKING:
    # Imported where used: policy.py imports this module, and load_run_settings() (read by
    # `egressbox run` before its fork) must not pay for the rules module.
    from egressbox.core.rules import Rule

SECRET_KEYS: Final = ("name", "from_env", "from_file", "from_command", "hosts", "header", "format")
REQUEST_RULE_KEYS: Final = (
    "hosts",
    "methods",
    "paths",
    "max_requests",
    "max_request_bytes",
    "window",
)
TLS_KEYS: Final = ("origin_ca", "ca_cert", "ca_key")

# The placeholder the child holds: recognisable in any request head, unique per run (128
# random bits), and useless anywhere else. Letters, digits, `-` and `_` only, so it passes
# through URLs, headers and Basic credentials unescaped.
PLACEHOLDER_PREFIX: Final = "egressbox-placeholder-"
PLACEHOLDER_RE: Final = re.compile(r"egressbox-placeholder-[A-Za-z_][A-Za-z0-9_]*-[0-9a-f]{32}")
VALUE_FIELD: Final = "{value}"
DEFAULT_FORMAT: Final = VALUE_FIELD
# The variable name rules of POSIX shells (what `env` and `export` accept).
_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# RFC 9110 §5.6.2 token: a header field name, an HTTP method.
_TOKEN_RE: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# A budget above this is a typo, not a limit (2**53: what a JSON number keeps exactly).
MAX_BUDGET: Final = 1 << 53
# A budget's window (seconds): a year is longer than any process is meant to serve; a
# window that long is a per-run budget written the long way.
MAX_WINDOW: Final = 366 * 24 * 3600


class SecretError(EgressboxError):
    """A secret's value cannot be had; the message names the entry and its source, never a
    value (`run` and `serve` exit 2 with it before anything is served)."""


class SecretSource(StrEnum):
    ENV = "from_env"
    FILE = "from_file"
    COMMAND = "from_command"


class SecretSpec(NamedTuple):
    """One `[[secret]]` entry, validated: where the value comes from, never the value."""

    name: str
    source: SecretSource
    where: tuple[str, ...]  # the variable's name, the file's path, or the command's argv
    hosts: tuple[Rule, ...]
    header: str | None = None
    format: str = DEFAULT_FORMAT

    def binds(self, host: str, port: int) -> bool:
        return matches(self.hosts, host, port)


class RequestRule(NamedTuple):
    """One `[[request_rule]]` entry: what may be sent to its hosts (empty: anything)."""

    hosts: tuple[Rule, ...]
    methods: frozenset[str] = frozenset()
    paths: tuple[str, ...] = ()
    max_requests: int | None = None
    max_request_bytes: int | None = None
    # Seconds after which the budgets' counters start again (None: once per run / proxy).
    window: int | None = None

    def applies(self, host: str, port: int) -> bool:
        return matches(self.hosts, host, port)


class TlsSettings(NamedTuple):
    """`[tls]`: extra CAs for origins; the operator's CA for `serve`."""

    origin_ca: str | None = None
    ca_cert: str | None = None
    ca_key: str | None = None


def matches(rules: Sequence[Rule], host: str, port: int) -> bool:
    """Does one of `rules` name the normalized `host` on `port`?"""
    from egressbox.core.rules import RuleSet

    table = RuleSet.build(rules)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return table.match_name(host, port) is not None
    return table.match_ip(ip, port) is not None


def terminates(
    secrets: Sequence[SecretSpec], rules: Sequence[RequestRule], host: str, port: int
) -> bool:
    """Is a connection to `host:port` terminated (a bound host or one with request rules)?"""
    return any(s.binds(host, port) for s in secrets) or any(r.applies(host, port) for r in rules)


# -- judging a request on a terminated host ---------------------------------------------


def judge_request(
    rules: Sequence[RequestRule], host: str, port: int, method: str, path: str
) -> tuple[Reason, str] | None:
    """The refusal (reason, detail) for `method path` to `host:port` by the request rules
    that apply, or None when each admits it. The detail names no path and no value."""
    bare = path.split("?", 1)[0]
    for rule in rules:
        if not rule.applies(host, port):
            continue
        if rule.methods and method not in rule.methods:
            allowed = ", ".join(sorted(rule.methods))
            return Reason.METHOD_DENIED, f"method {method} is not among {allowed}"
        if rule.paths and not any(_under(bare, prefix) for prefix in rule.paths):
            return Reason.PATH_DENIED, "the path is under none of the rule's prefixes"
    return None


def _under(path: str, prefix: str) -> bool:
    return path.startswith(prefix)


# -- placeholders in a request head ------------------------------------------------------

Table = Mapping[str, str]  # placeholder -> real value (or -> its secret's name)


def placeholders_in(text: str) -> list[str]:
    """Every placeholder-shaped token in `text`, and those inside a Basic credential."""
    if PLACEHOLDER_PREFIX not in text and "Basic" not in text and "basic" not in text:
        return []
    found = PLACEHOLDER_RE.findall(text)
    decoded = _basic_decoded(text)
    if decoded is not None:
        found += PLACEHOLDER_RE.findall(decoded)
    return found


def head_placeholders(target: str, headers: Iterable[tuple[str, str]]) -> list[str]:
    """Every placeholder-shaped token in a request head's target and field values."""
    found = placeholders_in(target)
    for _, value in headers:
        found += placeholders_in(value)
    return found


def substitute(text: str, table: Table) -> str:
    """`text` with each known placeholder replaced, inside a Basic credential too."""
    if PLACEHOLDER_PREFIX in text:
        text = PLACEHOLDER_RE.sub(lambda m: table.get(m.group(0), m.group(0)), text)
    decoded = _basic_decoded(text)
    if decoded is not None and PLACEHOLDER_PREFIX in decoded:
        replaced = PLACEHOLDER_RE.sub(lambda m: table.get(m.group(0), m.group(0)), decoded)
        scheme = text.split(" ", 1)[0]
        text = f"{scheme} {base64.b64encode(replaced.encode('latin-1')).decode('ascii')}"
    return text


def _basic_decoded(value: str) -> str | None:
    """The user:password of `Basic TOKEN` (RFC 7617), else None."""
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "basic" or not token:
        return None
    try:
        return base64.b64decode(token.strip(), validate=True).decode("latin-1")
    except (binascii.Error, ValueError):
        return None


def format_value(fmt: str, value: str) -> str:
    """The header value of `format` for `value` (only `{value}` is a field)."""
    return fmt.replace(VALUE_FIELD, value)


# -- parsing (called by core/policy.py's parser) -----------------------------------------


class Problems(Protocol):
    def problem(self, path: str, message: str) -> None: ...

    def unknown_keys(self, table: Mapping[str, Any], known: Sequence[str], prefix: str) -> None: ...


def _entries(data: Mapping[str, Any], key: str, problems: Problems) -> list[Mapping[str, Any]]:
    value = data.get(key, [])
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        problems.problem(key, f"must be an array of tables: write each entry under [[{key}]]")
        return []
    return value


def parse_secrets(data: Mapping[str, Any], problems: Problems) -> tuple[SecretSpec, ...]:
    found: list[SecretSpec] = []
    names: set[str] = set()
    for i, entry in enumerate(_entries(data, "secret", problems)):
        at = f"secret[{i}]"
        problems.unknown_keys(entry, SECRET_KEYS, at + ".")
        spec = _secret(entry, at, problems)
        if spec is None:
            continue
        if spec.name in names:
            problems.problem(f"{at}.name", f'"{spec.name}" is named by an earlier [[secret]]')
            continue
        names.add(spec.name)
        found.append(spec)
    return tuple(found)


def _secret(entry: Mapping[str, Any], at: str, problems: Problems) -> SecretSpec | None:
    name = entry.get("name")
    named = isinstance(name, str) and _NAME_RE.fullmatch(name) is not None
    if not named:
        problems.problem(
            f"{at}.name",
            'needs the variable the child sees, letters, digits and _: name = "GITHUB_TOKEN"',
        )
    source = _source(entry, at, problems)
    hosts = _hosts(entry, at, problems)
    header, fmt = _header(entry, at, problems)
    if not isinstance(name, str) or not named or source is None or not hosts:
        return None
    return SecretSpec(name, source[0], source[1], hosts, header, fmt)


def _source(
    entry: Mapping[str, Any], at: str, problems: Problems
) -> tuple[SecretSource, tuple[str, ...]] | None:
    given = [s for s in SecretSource if s.value in entry]
    if len(given) != 1:
        problems.problem(
            at,
            'needs exactly one of from_env = "VAR", from_file = "PATH" or '
            'from_command = ["CMD", "ARG"] (the value itself never goes in the policy)',
        )
        return None
    source = given[0]
    value = entry[source.value]
    if source is SecretSource.COMMAND:
        ok = isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)
        if not ok:
            problems.problem(f"{at}.from_command", 'must be a list of strings: ["CMD", "ARG"]')
            return None
        return source, tuple(value)
    if not isinstance(value, str) or not value:
        problems.problem(f"{at}.{source.value}", "must be a non-empty string")
        return None
    if source is SecretSource.ENV and _NAME_RE.fullmatch(value) is None:
        problems.problem(f"{at}.from_env", f"{value!r} is not a variable name")
        return None
    return source, (value,)


def _hosts(entry: Mapping[str, Any], at: str, problems: Problems) -> tuple[Rule, ...]:
    from egressbox.core.rules import PatternError, parse_pattern

    value = entry.get("hosts")
    if not isinstance(value, list) or not value:
        problems.problem(f"{at}.hosts", 'needs the hosts it is bound to: hosts = ["HOST:443"]')
        return ()
    rules: list[Rule] = []
    for j, text in enumerate(value):
        where = f"{at}.hosts[{j}]"
        if not isinstance(text, str):
            problems.problem(where, 'must be a string such as "api.github.com:443"')
            continue
        try:
            rule = parse_pattern(text)
        except PatternError as exc:
            problems.problem(where, str(exc))
            continue
        if rule.is_too_broad():
            problems.problem(where, f'"{text}" is too broad to bind: name the hosts themselves')
            continue
        rules.append(rule)
    return tuple(rules)


def _header(entry: Mapping[str, Any], at: str, problems: Problems) -> tuple[str | None, str]:
    header, fmt = entry.get("header"), entry.get("format", DEFAULT_FORMAT)
    if header is not None and (not isinstance(header, str) or not _TOKEN_RE.fullmatch(header)):
        problems.problem(f"{at}.header", 'must be a header name such as "Authorization"')
        header = None
    if not isinstance(fmt, str) or VALUE_FIELD not in fmt or _has_control(fmt):
        problems.problem(f"{at}.format", 'must hold {value} once, e.g. "Bearer {value}"')
        fmt = DEFAULT_FORMAT
    elif "format" in entry and header is None:
        problems.problem(f"{at}.format", "needs header = NAME (the header it fills)")
    return header, fmt


def _has_control(text: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


def parse_request_rules(data: Mapping[str, Any], problems: Problems) -> tuple[RequestRule, ...]:
    found: list[RequestRule] = []
    for i, entry in enumerate(_entries(data, "request_rule", problems)):
        at = f"request_rule[{i}]"
        problems.unknown_keys(entry, REQUEST_RULE_KEYS, at + ".")
        hosts = _hosts(entry, at, problems)
        methods = _methods(entry, at, problems)
        paths = _paths(entry, at, problems)
        requests = _budget(entry, "max_requests", at, problems)
        size = _budget(entry, "max_request_bytes", at, problems)
        window = _window(entry, at, problems)
        if window is not None and requests is None and size is None:
            problems.problem(f"{at}.window", "needs max_requests or max_request_bytes to renew")
        if hosts:
            found.append(RequestRule(hosts, methods, paths, requests, size, window))
    return tuple(found)


def _methods(entry: Mapping[str, Any], at: str, problems: Problems) -> frozenset[str]:
    value = entry.get("methods", [])
    ok = isinstance(value, list) and all(
        isinstance(m, str) and _TOKEN_RE.fullmatch(m) for m in value
    )
    if not ok:
        problems.problem(f"{at}.methods", 'must be a list of methods: ["GET", "HEAD"]')
        return frozenset()
    return frozenset(m.upper() for m in value)


def _paths(entry: Mapping[str, Any], at: str, problems: Problems) -> tuple[str, ...]:
    value = entry.get("paths", [])
    ok = isinstance(value, list) and all(
        isinstance(p, str) and p.startswith("/") and not _has_control(p) for p in value
    )
    if not ok:
        problems.problem(f"{at}.paths", 'must be a list of path prefixes: ["/repos/", "/user"]')
        return ()
    return tuple(value)


def _budget(entry: Mapping[str, Any], key: str, at: str, problems: Problems) -> int | None:
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BUDGET:
        problems.problem(f"{at}.{key}", f"must be a whole number from 0 to {MAX_BUDGET}")
        return None
    return value


def _window(entry: Mapping[str, Any], at: str, problems: Problems) -> int | None:
    value = entry.get("window")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WINDOW:
        problems.problem(
            f"{at}.window", f"must be a whole number of seconds from 1 to {MAX_WINDOW} (3600: 1h)"
        )
        return None
    return value


def parse_tls(data: Mapping[str, Any], problems: Problems) -> TlsSettings:
    table = data.get("tls", {})
    if not isinstance(table, dict):
        problems.problem("tls", "must be a table ([tls])")
        return TlsSettings()
    problems.unknown_keys(table, TLS_KEYS, "tls.")
    paths: dict[str, str | None] = {}
    for key in TLS_KEYS:
        value = table.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            problems.problem(f"tls.{key}", "must be a path to a PEM file")
            value = None
        paths[key] = value
    if (paths["ca_cert"] is None) != (paths["ca_key"] is None):
        problems.problem("tls", "ca_cert and ca_key go together (the operator's CA for serve)")
    return TlsSettings(paths["origin_ca"], paths["ca_cert"], paths["ca_key"])


def serve_needs_ca(
    secrets: Sequence[SecretSpec], rules: Sequence[RequestRule], tls: TlsSettings
) -> str | None:
    """`check`'s warning for a policy `serve` would refuse as it stands: it terminates hosts
    ([[secret]], [[request_rule]]) and names no CA (`run` makes its own per run)."""
    if not (secrets or rules) or tls.ca_cert is not None:
        return None
    return (
        "serve needs a CA for [[secret]] and [[request_rule]]: [tls] ca_cert and ca_key, "
        "or --ca-cert and --ca-key (run makes its own)"
    )
