"""The policy file: TOML into a frozen, validated, indexed Policy.

Pure apart from reading the file. Every problem is collected (not just the
first) and names its key path and the fix, e.g.
`egress.allow[2]: "*.com" is too broad; ...`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from egressbox.core import limits as lim
from egressbox.core.errors import HostError, PolicyError
from egressbox.core.secrets import (
    RequestRule,
    SecretSpec,
    TlsSettings,
    parse_request_rules,
    parse_secrets,
    parse_tls,
)

if TYPE_CHECKING:
    # Imported where used: rules, hosts and addresses (the compiled core, ipaddress),
    # which load_run_settings() (read by `egressbox run` before its fork) must not pay for.
    from egressbox.core.ip import IPAddress, IPNetwork
    from egressbox.core.rules import CidrIndex, Rule, RuleSet
    from egressbox.core.upstream import UpstreamProxy

N = TypeVar("N", int, float)

ENV_ALLOW = "EGRESSBOX_ALLOW"
ENV_DENY = "EGRESSBOX_DENY"
# Comma-separated networks appended to egress.allow_cidrs (validated like the key's entries):
# what a local registry's entry in EGRESSBOX_ALLOW needs, e.g. 127.0.0.1/32.
ENV_ALLOW_CIDRS = "EGRESSBOX_ALLOW_CIDRS"


class Mode(StrEnum):
    ENFORCE = "enforce"
    REPORT = "report"


class TlsNameCheck(StrEnum):
    """[egress] tls_name_check: a tunnel's ClientHello must name its target (DESIGN §3)."""

    ENFORCE = "enforce"
    OFF = "off"


class DnsSettings(NamedTuple):
    """[dns]: the proxy's resolver."""

    nameservers: tuple[tuple[IPAddress, int], ...] = ()
    timeout: float = lim.DNS_TIMEOUT
    cache_size: int = lim.DNS_CACHE_SIZE
    max_ttl: float = lim.DNS_MAX_TTL


def _rule_set() -> RuleSet:
    from egressbox.core.rules import RuleSet

    return RuleSet()


def _cidr_index() -> CidrIndex[IPNetwork]:
    from egressbox.core.rules import CidrIndex

    return CidrIndex()


# [process], [filesystem] and [env]: defaults for `egressbox run` (flags win or add).
# Current names, then deprecated ones still read (confine/grants.py DEPRECATED_PROFILES).
PROFILES = ("unrestricted", "worktree", "os_hardened", "workspace_paths")
PRESETS = ("system_runtime", "developer_toolchains", "package_manager_config", "user_temp")
ENV_POLICIES = ("inherited", "isolated", "granted")
MAX_TIMEOUT = 7 * 24 * 3600.0
RLIMIT_NOFILE_BOUNDS = (16, 1048576)
MIN_RLIMIT_AS = 64 * 1024 * 1024
_GRANT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ProcessSettings(NamedTuple):
    """[process]; None: not set (run's own default applies)."""

    profile: str | None = None
    timeout: float | None = None
    rlimit_nofile: int | None = None
    rlimit_as: int | None = None
    max_processes: int | None = None  # tasks in the child's PID namespace
    max_memory: int | None = None  # the run's memory budget, bytes (confine/cgroup.py)
    # The command may run and reach its own TCP servers on its private lo (--allow-loopback;
    # Harn's process_sandbox.allow_tcp_loopback).
    allow_tcp_loopback: bool = False


class FilesystemSettings(NamedTuple):
    """[filesystem]; paths as written (`~` is expanded by run against the caller's HOME)."""

    read_roots: tuple[str, ...] = ()
    write_roots: tuple[str, ...] = ()
    presets: tuple[str, ...] = PRESETS
    deny: tuple[str, ...] = ()  # added to the built-in credential list
    # Roots the command's tools need (caches, tool state), granted but not
    # workspaces: no default cwd, TMPDIR, caches or scratch directory there.
    process_read_roots: tuple[str, ...] = ()
    process_write_roots: tuple[str, ...] = ()
    # Directories whose unix sockets the child may connect to (nothing else is there).
    unix_socket_roots: tuple[str, ...] = ()
    # Host-trusted paths inside a writable root that the child may write after all.
    writable_trusted: tuple[str, ...] = ()
    # "read-only": the workspace is readable, nothing in it writable (None: read-write).
    workspace: str | None = None
    # "real": the toolchains' own caches, read+write (None: the run's scratch space).
    toolchain_cache: str | None = None


class EnvSettings(NamedTuple):
    """[env]; grant holds (NAME, VALUE) pairs, VALUE None: pass the caller's value."""

    policy: str | None = None
    grant: tuple[tuple[str, str | None], ...] = ()


class RunSettings(NamedTuple):
    """The tables `egressbox run` needs before its fork (see load_run_settings)."""

    process: ProcessSettings = ProcessSettings()
    filesystem: FilesystemSettings = FilesystemSettings()
    env: EnvSettings = EnvSettings()
    # [[secret]] names (their placeholders go in the child's environment) and whether the
    # proxy terminates any host (the child's view then trusts the run's CA): runner/brokering.py.
    secret_names: tuple[str, ...] = ()
    terminate: bool = False
    # The variables [[secret]] values come from (from_env): held back from the child.
    secret_env: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class Policy:
    """A validated policy. Build it with parse_policy() or load_policy()."""

    allow: RuleSet = field(default_factory=_rule_set)
    deny: RuleSet = field(default_factory=_rule_set)
    allow_cidrs: tuple[IPNetwork, ...] = ()
    deny_cidrs: tuple[IPNetwork, ...] = ()
    allow_private: bool = False
    mode: Mode = Mode.ENFORCE
    tls_name_check: TlsNameCheck = TlsNameCheck.ENFORCE
    # [egress] upstream / upstream_target: chain allowed connections through this proxy.
    upstream: UpstreamProxy | None = None
    dns: DnsSettings = field(default_factory=DnsSettings)
    limits: lim.Limits = field(default_factory=lim.Limits)
    source: str = ""
    warnings: tuple[str, ...] = ()
    process: ProcessSettings = field(default_factory=ProcessSettings)
    filesystem: FilesystemSettings = field(default_factory=FilesystemSettings)
    env: EnvSettings = field(default_factory=EnvSettings)
    # [[secret]], [[request_rule]] and [tls] (core/secrets.py): what the proxy terminates.
    secrets: tuple[SecretSpec, ...] = ()
    request_rules: tuple[RequestRule, ...] = ()
    tls: TlsSettings = field(default_factory=TlsSettings)
    _allow_cidr_index: CidrIndex[IPNetwork] = field(default_factory=_cidr_index, repr=False)
    _deny_cidr_index: CidrIndex[IPNetwork] = field(default_factory=_cidr_index, repr=False)

    def __post_init__(self) -> None:
        for net in self.allow_cidrs:
            self._allow_cidr_index.add(net, net)
        for net in self.deny_cidrs:
            self._deny_cidr_index.add(net, net)

    @property
    def run_settings(self) -> RunSettings:
        return RunSettings(
            self.process,
            self.filesystem,
            self.env,
            tuple(s.name for s in self.secrets),
            bool(self.secrets or self.request_rules),
            tuple(s.where[0] for s in self.secrets if s.source.value == "from_env"),
        )

    def allow_cidr_for(self, ip: IPAddress) -> IPNetwork | None:
        return self._allow_cidr_index.first(ip)

    def deny_cidr_for(self, ip: IPAddress) -> IPNetwork | None:
        return self._deny_cidr_index.first(ip)


EGRESS_KEYS = (
    "allow",
    "deny",
    "allow_cidrs",
    "deny_cidrs",
    "allow_private",
    "mode",
    "tls_name_check",
    "upstream",
    "upstream_target",
)
DNS_KEYS = ("nameservers", "timeout", "cache_size", "max_ttl")
PROCESS_KEYS = (
    "profile",
    "timeout",
    "rlimit_nofile",
    "rlimit_as",
    "max_processes",
    "max_memory",
    "allow_tcp_loopback",
)
# max_processes: the kernel refuses a PID namespace's pid_max below 301 (PID_MAX_MIN).
MAX_PROCESSES_BOUNDS = (300, 4194303)
MIN_MAX_MEMORY = 64 * 1024 * 1024
FILESYSTEM_KEYS = (
    "read_roots",
    "write_roots",
    "presets",
    "deny",
    "process_read_roots",
    "process_write_roots",
    "unix_socket_roots",
    "writable_trusted",
    "workspace",
    "toolchain_cache",
)
WORKSPACE_MODES = ("read-write", "read-only")
TOOLCHAIN_CACHE_MODES = ("scratch", "real")
ENV_KEYS = ("policy", "grant")
TOP_KEYS = (
    "egress",
    "dns",
    "limits",
    "process",
    "filesystem",
    "env",
    "secret",
    "request_rule",
    "tls",
)
RULE_TABLE_KEYS = ("host", "private", "broad")
CIDR_TABLE_KEYS = ("cidr", "broad")


def with_upstream(policy: Policy, upstream: UpstreamProxy | None) -> Policy:
    """The same policy chaining through `upstream` (`run --upstream`); the original is
    untouched. Its CIDR indexes are built afresh (dataclasses.replace would refill the
    original's, see suggest.with_mode)."""
    fresh = {
        f.name: f.default_factory()
        for f in dataclasses.fields(policy)
        if f.name.startswith("_") and f.default_factory is not dataclasses.MISSING
    }
    warnings = tuple(w for w in policy.warnings if w != UPSTREAM_BY_NAME_WARNING)
    if upstream is not None and upstream.pinning != "full":
        warnings += (UPSTREAM_BY_NAME_WARNING,)
    return dataclasses.replace(policy, upstream=upstream, warnings=warnings, **fresh)


def load_policy(path: str, *, env: Mapping[str, str] | None = None) -> Policy:
    """Read and validate a policy file; PolicyError lists every problem."""
    return parse_policy(_read_toml(path), source=path, env=env)


def load_run_settings(path: str) -> RunSettings:
    """Only [process], [filesystem] and [env] of a policy file, validated as load_policy does.

    Cheap (no idna, no rules): `egressbox run` reads them before it forks the
    launcher; the whole policy is loaded (and fully checked) afterwards.
    """
    data = _read_toml(path)
    parser = _Parser(path)
    settings = parser.run_settings(data)
    if parser.problems:
        raise PolicyError(parser.problems, path)
    return settings


def _read_toml(path: str) -> dict[str, Any]:
    import tomllib  # only when a file is read: `run -- CMD` without one skips ~2.5 ms

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise PolicyError([f"cannot read the policy file: {exc.strerror}"], path) from None
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError([f"not valid TOML: {exc}"], path) from None
    except UnicodeDecodeError as exc:
        # TOML is UTF-8 (tomllib decodes before parsing and lets this escape).
        bad = exc.object[exc.start]
        raise PolicyError(
            [
                f"not valid TOML: the file is not UTF-8 text (byte 0x{bad:02x} at offset "
                f"{exc.start}); save it as UTF-8"
            ],
            path,
        ) from None
    return data


def parse_policy(
    data: Mapping[str, Any], *, source: str = "", env: Mapping[str, str] | None = None
) -> Policy:
    """Validate a policy mapping (as read from TOML) into a Policy."""
    parser = _Parser(source)
    policy = parser.policy(data, os.environ if env is None else env)
    if parser.problems:
        raise PolicyError(parser.problems, source)
    return policy


def _brokering_names(
    data: Mapping[str, Any],
) -> tuple[tuple[str, ...], bool, tuple[str, ...]]:
    """RunSettings' secret names, terminate flag and from_env variables, read cheaply (the
    whole policy, loaded after the fork, validates the entries)."""
    entries = data.get("secret", [])
    entries = [
        e for e in (entries if isinstance(entries, list) else [entries]) if isinstance(e, dict)
    ]
    names = tuple(e["name"] for e in entries if isinstance(e.get("name"), str))
    sources = tuple(e["from_env"] for e in entries if isinstance(e.get("from_env"), str))
    return names, bool(entries or data.get("request_rule")), sources


def _type_name(value: object) -> str:
    names = {str: "a string", bool: "a boolean", int: "an integer", float: "a number"}
    names |= {list: "a list", dict: "a table"}
    return names.get(type(value), type(value).__name__)


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source
        self.problems: list[str] = []
        self.warnings: list[str] = []
        # Key path of each kept allow rule (file entries, then EGRESSBOX_ALLOW).
        self.allow_paths: list[str] = []

    def problem(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}")

    def unknown_keys(self, table: Mapping[str, Any], known: Sequence[str], prefix: str) -> None:
        for key in table:
            if key not in known:
                close = _close_match(key, known)
                hint = f'did you mean "{close[0]}"? ' if close else ""
                where = f"{prefix}{key}"
                self.problem(where, f"unknown key; {hint}known keys: {', '.join(known)}")

    def table(self, data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
        value = data.get(key, {})
        if not isinstance(value, dict):
            self.problem(key, f"must be a table ([{key}]), got {_type_name(value)}")
            return {}
        return value

    def policy(self, data: Mapping[str, Any], env: Mapping[str, str]) -> Policy:
        from egressbox.core.rules import RuleSet

        self.unknown_keys(data, TOP_KEYS, "")
        egress = self.table(data, "egress")
        self.unknown_keys(egress, EGRESS_KEYS, "egress.")
        allow = self.rules(egress, "allow", env.get(ENV_ALLOW, ""), ENV_ALLOW)
        deny = self.rules(egress, "deny", env.get(ENV_DENY, ""), ENV_DENY)
        allow_cidrs = self.cidrs(egress, "allow_cidrs", check_breadth=True)
        allow_cidrs += self.env_cidrs(env.get(ENV_ALLOW_CIDRS, ""))
        deny_cidrs = self.cidrs(egress, "deny_cidrs", check_breadth=False)
        allow_private = self.boolean(egress, "allow_private", "egress.allow_private")
        mode = self.mode(egress)
        tls_name_check = self.tls_name_check(egress)
        upstream = self.upstream(egress)
        settings = self.run_settings(data)
        policy = Policy(
            allow=RuleSet.build(allow),
            deny=RuleSet.build(deny),
            allow_cidrs=tuple(allow_cidrs),
            deny_cidrs=tuple(deny_cidrs),
            allow_private=allow_private,
            mode=mode,
            tls_name_check=tls_name_check,
            upstream=upstream,
            dns=self.dns(self.table(data, "dns")),
            limits=self.limits(self.table(data, "limits")),
            process=settings.process,
            filesystem=settings.filesystem,
            env=settings.env,
            source=self.source,
            secrets=parse_secrets(data, self),
            request_rules=parse_request_rules(data, self),
            tls=parse_tls(data, self),
        )
        self.warn_about(policy)
        object.__setattr__(policy, "warnings", tuple(self.warnings))
        return policy

    # -- egress.allow / egress.deny -------------------------------------------------

    def rules(
        self, egress: Mapping[str, Any], key: str, env_text: str, env_name: str
    ) -> list[Rule]:
        path = f"egress.{key}"
        entries = egress.get(key, [])
        if not isinstance(entries, list):
            self.problem(
                path, f'must be a list, got {_type_name(entries)}; e.g. {key} = ["pypi.org:443"]'
            )
            entries = []
        paths = [f"{path}[{i}]" for i in range(len(entries))]
        extra = [item for item in env_text.split(",") if item.strip()]
        paths += [f"{env_name}[{i}]" for i in range(len(extra))]
        parsed = [
            self.rule(entry, at, key) for entry, at in zip([*entries, *extra], paths, strict=True)
        ]
        kept = [(at, rule) for at, rule in zip(paths, parsed, strict=True) if rule is not None]
        if key == "allow":
            self.allow_paths = [at for at, _ in kept]
        return [rule for _, rule in kept]

    def rule(self, entry: object, path: str, key: str) -> Rule | None:
        from egressbox.core.rules import PatternError, parse_pattern

        private = broad = False
        if isinstance(entry, dict):
            self.unknown_keys(entry, RULE_TABLE_KEYS, path + ".")
            private = self.boolean(entry, "private", path + ".private")
            broad = self.boolean(entry, "broad", path + ".broad")
            entry = entry.get("host")
            if not isinstance(entry, str):
                self.problem(
                    path,
                    'a table entry needs host = "PATTERN", e.g. '
                    '{ host = "db.corp", private = true }',
                )
                return None
        if not isinstance(entry, str):
            self.problem(path, f"must be a string or a table, got {_type_name(entry)}")
            return None
        try:
            rule = parse_pattern(entry, private=private, broad=broad)
        except PatternError as exc:
            self.problem(path, str(exc))
            return None
        if key == "allow" and rule.is_too_broad() and not broad:
            self.problem(path, _too_broad(entry.strip(), rule))
        return rule

    # -- egress.allow_cidrs / egress.deny_cidrs -------------------------------------

    def cidrs(self, egress: Mapping[str, Any], key: str, *, check_breadth: bool) -> list[IPNetwork]:
        path = f"egress.{key}"
        entries = egress.get(key, [])
        if not isinstance(entries, list):
            self.problem(
                path, f'must be a list, got {_type_name(entries)}; e.g. {key} = ["10.0.0.0/8"]'
            )
            return []
        found = [self.cidr(e, f"{path}[{i}]", check_breadth) for i, e in enumerate(entries)]
        return [net for net in found if net is not None]

    def env_cidrs(self, text: str) -> list[IPNetwork]:
        """EGRESSBOX_ALLOW_CIDRS: comma-separated, each checked like an allow_cidrs entry
        (a bare address is that one address; a huge range is refused, there being no
        way to write `broad = true` in it)."""
        items = [item for item in text.split(",") if item.strip()]
        found = [self.cidr(e, f"{ENV_ALLOW_CIDRS}[{i}]", True) for i, e in enumerate(items)]
        return [net for net in found if net is not None]

    def cidr(self, entry: object, path: str, check_breadth: bool) -> IPNetwork | None:
        from egressbox.core.rules import PatternError, min_prefix, parse_network

        broad = False
        if isinstance(entry, dict) and check_breadth:
            self.unknown_keys(entry, CIDR_TABLE_KEYS, path + ".")
            broad = self.boolean(entry, "broad", path + ".broad")
            entry = entry.get("cidr")
            if not isinstance(entry, str):
                self.problem(
                    path,
                    'a table entry needs cidr = "NETWORK", e.g. '
                    '{ cidr = "0.0.0.0/0", broad = true }',
                )
                return None
        if not isinstance(entry, str):
            self.problem(
                path, f'must be a CIDR string such as "10.0.0.0/8", got {_type_name(entry)}'
            )
            return None
        text = entry.strip()
        try:
            network = parse_network(text if "/" in text else _host_cidr(text))
        except PatternError as exc:
            # A bare address is read as a host network; name the text as written.
            message = str(exc) if "/" in text else f'"{text}" is not an IP address or network'
            if "/" not in text:
                message += "; write it as ADDRESS/LENGTH, e.g. 10.0.0.0/8 or 2001:db8::/32"
            self.problem(path, message)
            return None
        if check_breadth and not broad and network.prefixlen < min_prefix(network):
            self.problem(
                path,
                f'"{text}" is too broad: it would lift the private-address ban for a huge '
                f"range; list narrower networks, or write "
                f'{{ cidr = "{text}", broad = true }} if you mean it',
            )
        return network

    # -- scalars and other tables ---------------------------------------------------

    def boolean(self, table: Mapping[str, Any], key: str, path: str) -> bool:
        value = table.get(key, False)
        if not isinstance(value, bool):
            self.problem(path, f"must be true or false, got {_type_name(value)}")
            return False
        return value

    def tls_name_check(self, egress: Mapping[str, Any]) -> TlsNameCheck:
        value = egress.get("tls_name_check", "enforce")
        try:
            return TlsNameCheck(value)
        except ValueError:
            self.problem("egress.tls_name_check", f'must be "enforce" or "off", got {value!r}')
            return TlsNameCheck.ENFORCE

    def upstream(self, egress: Mapping[str, Any]) -> UpstreamProxy | None:
        """[egress] upstream = "http://HOST:PORT" | "socks5://HOST:PORT", upstream_target."""
        if "upstream" not in egress and "upstream_target" not in egress:
            return None  # the common case: the upstream parser (and ipaddress) stays unloaded
        from egressbox.core.upstream import UpstreamTarget, parse_upstream

        url, target = egress.get("upstream"), egress.get("upstream_target", "address")
        if not isinstance(target, str) or target not in tuple(UpstreamTarget):
            self.problem("egress.upstream_target", f'must be "address" or "name", got {target!r}')
            target = "address"
        if url is None:
            if "upstream_target" in egress:
                self.problem("egress.upstream_target", "needs egress.upstream")
            return None
        if not isinstance(url, str):
            self.problem("egress.upstream", f"must be a URL string, got {_type_name(url)}")
            return None
        try:
            return parse_upstream(url, target)
        except ValueError as exc:
            # The message never echoes the URL: it could hold a password.
            self.problem("egress.upstream", f'{exc}; e.g. "http://proxy.example:3128"')
            return None

    def mode(self, egress: Mapping[str, Any]) -> Mode:
        value = egress.get("mode", "enforce")
        try:
            return Mode(value)
        except ValueError:
            self.problem("egress.mode", f'must be "enforce" or "report", got {value!r}')
            return Mode.ENFORCE

    def dns(self, table: Mapping[str, Any]) -> DnsSettings:
        self.unknown_keys(table, DNS_KEYS, "dns.")
        servers = table.get("nameservers", [])
        if not isinstance(servers, list):
            self.problem("dns.nameservers", 'must be a list such as ["127.0.0.1:53"]')
            servers = []
        parsed = [self.nameserver(s, f"dns.nameservers[{i}]") for i, s in enumerate(servers)]
        default = DnsSettings()
        return DnsSettings(
            nameservers=tuple(p for p in parsed if p is not None),
            timeout=self.number(
                table, "timeout", "dns", kind=float, bounds=(0.05, 60.0), default=default.timeout
            ),
            cache_size=self.number(
                table, "cache_size", "dns", kind=int, bounds=(0, 10**7), default=default.cache_size
            ),
            max_ttl=self.number(
                table, "max_ttl", "dns", kind=float, bounds=(0.0, 86400.0), default=default.max_ttl
            ),
        )

    def nameserver(self, entry: object, path: str) -> tuple[IPAddress, int] | None:
        from egressbox.core.hosts import parse_ip_endpoint

        if not isinstance(entry, str):
            self.problem(path, f'must be a string "IP[:PORT]", got {_type_name(entry)}')
            return None
        try:
            return parse_ip_endpoint(entry.strip(), 53)
        except HostError:
            self.problem(
                path, f'"{entry}" is not IP[:PORT]; e.g. "1.1.1.1", "[2606:4700::1111]:53"'
            )
            return None

    def limits(self, table: Mapping[str, Any]) -> lim.Limits:
        self.unknown_keys(table, tuple(lim.LIMIT_BOUNDS), "limits.")
        default = lim.Limits()
        values: dict[str, Any] = {}
        for key, (kind, low, high) in lim.LIMIT_BOUNDS.items():
            values[key] = self.number(
                table, key, "limits", kind=kind, bounds=(low, high), default=getattr(default, key)
            )
        return lim.Limits(**values)

    def number(
        self,
        table: Mapping[str, Any],
        key: str,
        prefix: str,
        *,
        kind: Callable[[Any], N],
        bounds: tuple[float, float],
        default: N,
    ) -> N:
        value = table.get(key, default)
        ok_type = isinstance(value, int | float) if kind is float else isinstance(value, int)
        if isinstance(value, bool) or not ok_type:
            wanted = "a number" if kind is float else "a whole number"
            got = repr(value) if isinstance(value, float) else _type_name(value)
            self.problem(f"{prefix}.{key}", f"must be {wanted}, got {got}")
            return default
        if not bounds[0] <= value <= bounds[1]:
            self.problem(
                f"{prefix}.{key}",
                f"must be between {_bound(bounds[0])} and {_bound(bounds[1])}, got {value}",
            )
            return default
        return kind(value)

    # -- [process], [filesystem], [env] ----------------------------------------------

    def run_settings(self, data: Mapping[str, Any]) -> RunSettings:
        """The run tables; needs neither hosts nor rules (see load_run_settings)."""
        return RunSettings(
            self.process(self.table(data, "process")),
            self.filesystem(self.table(data, "filesystem")),
            self.env(self.table(data, "env")),
            *_brokering_names(data),
        )

    def process(self, table: Mapping[str, Any]) -> ProcessSettings:
        self.unknown_keys(table, PROCESS_KEYS, "process.")
        profile = self.choice(table, "profile", "process", PROFILES)
        timeout = self.optional_number(
            table,
            "timeout",
            "process",
            kind=float,
            minimum=0.0,
            maximum=MAX_TIMEOUT,
            exclusive=True,
            unit="seconds (7 days)",
            example="timeout = 600",
        )
        low, high = RLIMIT_NOFILE_BOUNDS
        nofile = self.optional_number(
            table,
            "rlimit_nofile",
            "process",
            kind=int,
            minimum=low,
            maximum=high,
            unit="descriptors",
            example="rlimit_nofile = 4096",
        )
        address_space = self.optional_number(
            table,
            "rlimit_as",
            "process",
            kind=int,
            minimum=MIN_RLIMIT_AS,
            maximum=None,
            unit="bytes (64 MiB)",
            example="rlimit_as = 4294967296 for 4 GiB",
        )
        low, high = MAX_PROCESSES_BOUNDS
        processes = self.optional_number(
            table,
            "max_processes",
            "process",
            kind=int,
            minimum=low,
            maximum=high,
            unit="tasks (processes and threads)",
            example="max_processes = 4096",
        )
        memory = self.optional_number(
            table,
            "max_memory",
            "process",
            kind=int,
            minimum=MIN_MAX_MEMORY,
            maximum=None,
            unit="bytes (64 MiB)",
            example="max_memory = 8589934592 for 8 GiB",
        )
        return ProcessSettings(
            profile=profile,
            timeout=None if timeout is None else float(timeout),
            rlimit_nofile=None if nofile is None else int(nofile),
            rlimit_as=None if address_space is None else int(address_space),
            max_processes=None if processes is None else int(processes),
            max_memory=None if memory is None else int(memory),
            allow_tcp_loopback=self.boolean(
                table, "allow_tcp_loopback", "process.allow_tcp_loopback"
            ),
        )

    def filesystem(self, table: Mapping[str, Any]) -> FilesystemSettings:
        self.unknown_keys(table, FILESYSTEM_KEYS, "filesystem.")
        presets: tuple[str, ...] = PRESETS
        if "presets" in table:
            names = self.string_list(table, "presets", "filesystem", '["system_runtime"]')
            presets = tuple(
                dict.fromkeys(
                    n
                    for i, n in enumerate(names)
                    if self.known_name(n, f"filesystem.presets[{i}]", PRESETS)
                )
            )
        write_roots = self.paths(table, "write_roots")
        read_roots = self.paths(table, "read_roots")
        process_read = self.paths(table, "process_read_roots")
        process_write = self.paths(table, "process_write_roots")
        self.not_workspaces(process_read, "process_read_roots", write_roots, read_roots)
        self.not_workspaces(process_write, "process_write_roots", write_roots, read_roots)
        return FilesystemSettings(
            read_roots=read_roots,
            write_roots=write_roots,
            presets=presets,
            deny=self.paths(table, "deny"),
            process_read_roots=process_read,
            process_write_roots=process_write,
            unix_socket_roots=self.paths(table, "unix_socket_roots"),
            writable_trusted=self.paths(table, "writable_trusted"),
            workspace=self.choice(table, "workspace", "filesystem", WORKSPACE_MODES),
            toolchain_cache=self.choice(
                table, "toolchain_cache", "filesystem", TOOLCHAIN_CACHE_MODES
            ),
        )

    def not_workspaces(
        self,
        roots: Sequence[str],
        key: str,
        write_roots: Sequence[str],
        read_roots: Sequence[str],
    ) -> None:
        """A directory is a workspace (write_roots/read_roots) or a process root, never both."""
        for i, text in enumerate(roots):
            other = next(
                (
                    name
                    for name, listed in (("write_roots", write_roots), ("read_roots", read_roots))
                    if text in listed
                ),
                None,
            )
            if other is not None:
                self.problem(
                    f"filesystem.{key}[{i}]",
                    f"{text!r} is also in filesystem.{other}; a directory is either a workspace "
                    f"root or a process root (tool caches and state): remove it from one list",
                )

    def env(self, table: Mapping[str, Any]) -> EnvSettings:
        self.unknown_keys(table, ENV_KEYS, "env.")
        policy = self.choice(table, "policy", "env", ENV_POLICIES)
        grants: list[tuple[str, str | None]] = []
        for i, text in enumerate(self.string_list(table, "grant", "env", '["CI", "LANG=C"]')):
            name, sep, value = text.partition("=")
            if not _GRANT_NAME.fullmatch(name):
                self.problem(
                    f"env.grant[{i}]",
                    f'{text!r} is not "NAME" or "NAME=VALUE" (NAME: letters, digits and _, '
                    'not starting with a digit); e.g. "CI" or "LANG=C.UTF-8"',
                )
                continue
            grants.append((name, value if sep else None))
        return EnvSettings(policy=policy, grant=tuple(grants))

    def choice(
        self, table: Mapping[str, Any], key: str, prefix: str, names: Sequence[str]
    ) -> str | None:
        if key not in table:
            return None
        value = table[key]
        path = f"{prefix}.{key}"
        if not isinstance(value, str):
            self.problem(
                path, f"must be a string, one of {_quoted(names)}; got {_type_name(value)}"
            )
            return None
        return value if self.known_name(value, path, names) else None

    def known_name(self, value: str, path: str, names: Sequence[str]) -> bool:
        if value in names:
            return True
        close = _close_match(value, names)
        hint = f'did you mean "{close[0]}"? ' if close else ""
        self.problem(path, f"unknown value {value!r}; {hint}use one of {_quoted(names)}")
        return False

    def string_list(
        self, table: Mapping[str, Any], key: str, prefix: str, example: str
    ) -> list[str]:
        value = table.get(key, [])
        path = f"{prefix}.{key}"
        if not isinstance(value, list):
            self.problem(path, f"must be a list, got {_type_name(value)}; e.g. {key} = {example}")
            return []
        found: list[str] = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                found.append(item)
            else:
                self.problem(
                    f"{path}[{i}]",
                    f"must be a string, got {_type_name(item)}; e.g. {key} = {example}",
                )
        return found

    def paths(self, table: Mapping[str, Any], key: str) -> tuple[str, ...]:
        value = table.get(key, [])
        path = f"filesystem.{key}"
        example = f'{key} = ["/srv/data", "~/src"]'
        if not isinstance(value, list):
            self.problem(path, f"must be a list, got {_type_name(value)}; e.g. {example}")
            return ()
        kept: list[str] = []
        for i, text in enumerate(value):
            if not isinstance(text, str):
                self.problem(
                    f"{path}[{i}]", f"must be a string, got {_type_name(text)}; e.g. {example}"
                )
            elif text.startswith("/") or text == "~" or text.startswith("~/"):
                kept.append(text)
            else:
                self.problem(
                    f"{path}[{i}]",
                    f"{text!r} is not an absolute path; write it from / (or ~/ for your home "
                    'directory), e.g. "/srv/data" or "~/src"',
                )
        return tuple(kept)

    def optional_number(
        self,
        table: Mapping[str, Any],
        key: str,
        prefix: str,
        *,
        kind: type,
        minimum: float,
        maximum: float | None,
        unit: str,
        example: str,
        exclusive: bool = False,
    ) -> float | None:
        if key not in table:
            return None
        value = table[key]
        path = f"{prefix}.{key}"
        ok_type = isinstance(value, int | float) if kind is float else isinstance(value, int)
        if isinstance(value, bool) or not ok_type:
            wanted = "a number" if kind is float else "a whole number"
            got = repr(value) if isinstance(value, float) else _type_name(value)
            self.problem(path, f"must be {wanted} of {unit}, got {got}; e.g. {example}")
            return None
        too_low = value <= minimum if exclusive else value < minimum
        if too_low or (maximum is not None and value > maximum):
            low = f"more than {_bound(minimum)}" if exclusive else f"at least {_bound(minimum)}"
            high = "" if maximum is None else f" and at most {_bound(maximum)}"
            self.problem(path, f"must be {low}{high} {unit}, got {value}; e.g. {example}")
            return None
        return float(value)

    # -- warnings -------------------------------------------------------------------

    def warn_about(self, policy: Policy) -> None:
        for path, rule in zip(self.allow_paths, policy.allow.rules, strict=True):
            self.warn_rule(policy, rule, path)
        if not policy.allow.rules:
            self.warnings.append(
                "egress.allow is empty: every destination is denied"
                if policy.mode is Mode.ENFORCE
                else "egress.allow is empty: in report mode every destination is only audited"
            )
        if policy.mode is Mode.REPORT:
            self.warnings.append(REPORT_MODE_WARNING)
        if policy.tls_name_check is TlsNameCheck.OFF:
            self.warnings.append(TLS_NAME_CHECK_OFF_WARNING)
        if policy.upstream is not None and policy.upstream.pinning != "full":
            self.warnings.append(UPSTREAM_BY_NAME_WARNING)

    def warn_rule(self, policy: Policy, rule: Rule, path: str) -> None:
        from egressbox.core.addresses import PRIVATE_LIKE, Category, is_routable, lookup
        from egressbox.core.rules import RuleKind

        if rule.kind in (RuleKind.WILDCARD, RuleKind.ANY_NAME):
            self.warnings.append(
                f'{path}: "{rule.text}" lets a client choose names that the proxy resolves, '
                "so a client can send DNS queries to that zone's servers"
            )
        ip = _rule_address(rule)
        if ip is None:
            self.warn_loopback_name(policy, rule, path)
            return
        entry = lookup(ip)
        category = entry.category
        if category is Category.METADATA:
            exact = rule.kind is RuleKind.IP
            what = f'{path}: "{rule.text}" {"names" if exact else "covers"} {entry.name}, a cloud'
            if exact:
                what += " metadata endpoint: it opens this instance's credentials to every client"
            else:
                what += " metadata endpoint that stays denied unless an entry names it exactly"
            self.warnings.append(what)
            return
        if is_routable(category) or policy.allow_cidr_for(ip) is not None:
            return
        if category in PRIVATE_LIKE and (rule.private or policy.allow_private):
            return
        self.warnings.append(
            f'{path}: "{rule.text}" is a {category.value.replace("_", "-")} address and stays '
            f"denied unless egress.allow_cidrs covers it"
            + (
                ' or the entry is written { host = "...", private = true }'
                if category in PRIVATE_LIKE
                else ""
            )
        )

    def warn_loopback_name(self, policy: Policy, rule: Rule, path: str) -> None:
        """`localhost:PORT` resolves to loopback, which every entry needs a grant for."""
        from egressbox.core.local import LOOPBACK_ADDRESSES, is_loopback_name
        from egressbox.core.rules import RuleKind

        if rule.kind is not RuleKind.NAME or not is_loopback_name(rule.value):
            return
        missing = [ip for ip in LOOPBACK_ADDRESSES if policy.allow_cidr_for(ip) is None]
        if not missing:
            return
        cidrs = ", ".join(f'"{ip}/{ip.max_prefixlen}"' for ip in missing)
        # Every address a name resolves to is checked, and one denied address denies the
        # connection: most hosts files give localhost both 127.0.0.1 and ::1.
        what = "loopback (127.0.0.1, and ::1 in most hosts files)"
        if len(missing) < len(LOOPBACK_ADDRESSES):
            what = f"{', '.join(map(str, missing))} in most hosts files"
        self.warnings.append(
            f'{path}: "{rule.text}" resolves to {what}, which stays denied unless '
            f"egress.allow_cidrs covers it; add {cidrs} to egress.allow_cidrs "
            f"(or set {ENV_ALLOW_CIDRS})"
        )


TLS_NAME_CHECK_OFF_WARNING = (
    'tls_name_check = "off": a tunnel to an allowed name carries any TLS ClientHello, so a client '
    "can name another host served at the same addresses (domain fronting under an allowed CDN)"
)

UPSTREAM_BY_NAME_WARNING = (
    'upstream_target = "name": the upstream proxy is asked for names and resolves them '
    "itself, so it may connect to other addresses than egressbox checked (pinning: partial)"
)

REPORT_MODE_WARNING = (
    'mode = "report": destinations outside the allow list are let through and audited as '
    "would_deny; use it to learn what a trusted program needs, never to confine an untrusted one"
)


def _rule_address(rule: Rule) -> IPAddress | None:
    from egressbox.core.rules import RuleKind

    if rule.kind is RuleKind.IP:
        return ipaddress.ip_address(rule.value)
    if rule.kind is RuleKind.CIDR and rule.network is not None:
        return rule.network.network_address
    return None


def _quoted(names: Sequence[str]) -> str:
    return ", ".join(f'"{n}"' for n in names)


def _bound(value: float) -> str:
    # 1048576, not 1.04858e+06: the user copies the number into the file.
    return str(int(value)) if float(value).is_integer() else str(value)


def _host_cidr(text: str) -> str:
    # A bare address in a CIDR list means that one address.
    return f"{text}/{32 if '.' in text and ':' not in text else 128}"


def _too_broad(text: str, rule: Rule) -> str:
    from egressbox.core.rules import RuleKind

    why = {
        RuleKind.ANY_NAME: "it admits every name",
        RuleKind.WILDCARD: "a one-label suffix admits a whole top-level domain",
        RuleKind.CIDR: "it admits a large part of the Internet",
    }.get(rule.kind, "it admits too much")
    return (
        f'"{text}" is too broad ({why}); list the hosts you need, or write '
        f'{{ host = "{text}", broad = true }} if you mean it'
    )


def _close_match(word: str, choices: Sequence[str]) -> list[str]:
    """The one choice that looks like `word` (for "did you mean"), if any."""
    import difflib  # only on a mistake

    return difflib.get_close_matches(word, choices, n=1)


def load_policy_or_environment(path: str | None) -> Policy | None:
    """The policy of a command: the file plus environment overrides, or none at all."""
    if path is not None:
        return load_policy(path)
    if os.environ.get(ENV_ALLOW) or os.environ.get(ENV_DENY) or os.environ.get(ENV_ALLOW_CIDRS):
        return parse_policy({}, source="environment")
    return None
