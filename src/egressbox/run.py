"""Run a command behind a managed proxy, confined so the proxy is all it can reach.

The parent (this module) plans, forks the launcher (confine/launcher.py),
receives the listening sockets the launcher bound inside the child's network
namespace, verifies they live there, serves them with EgressProxy, passes
signals on, and returns the command's exit code with the run's audit
records and an enforcement report.

`egressbox run` forks before asyncio or dnspython are imported (they are
imported only once the launcher is on its way), so the launcher starts from
a small, single-threaded process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from egressbox.confine import netns
from egressbox.confine.env import (
    PORT_TEMPLATES,
    EnvPolicy,
    Scratch,
    child_environment,
    proxy_variables,
)
from egressbox.confine.executable import CommandNotFoundError, resolve_command
from egressbox.confine.launcher import LaunchPlan
from egressbox.confine.plan import (
    ADMIT_HINT,
    CREDENTIALS,
    DEFAULT_PRESETS,
    HOST_NEEDS,
    Enforcement,
    HostFacts,
    Mechanism,
    Profile,
    Refusal,
    choose_mechanisms,
    expand_user,
    host_trusted,
    is_under,
    plan_filesystem,
    strictest,
    wanted,
)
from egressbox.confine.world import WorldSpec
from egressbox.errors import EgressboxError
from egressbox.exitcodes import EXIT_CANNOT_CONFINE, EXIT_NOT_FOUND, EXIT_TIMEOUT
from egressbox.stderr_tee import DRAIN_TIMEOUT, FINAL_READS, StderrTee, TerminalRelay, open_stdio

if TYPE_CHECKING:
    from egressbox.audit import AuditRecord, AuditSink
    from egressbox.confine.refusal import HostPath, PathPlan, RefusalRecord
    from egressbox.policy import Policy, RunSettings
    from egressbox.server import EgressProxy

# How long the launcher may take to bind its listeners (measured: 34-50 ms).
LAUNCHER_TIMEOUT = 10.0
SCRATCH_DIR = ".egressbox"
ENV_SANDBOX = "EGRESSBOX_SANDBOX"
ENV_PROFILE = "EGRESSBOX_PROFILE"
# --timeout: the run's exit code when it expires (as coreutils timeout), and
# how long the command has after SIGTERM before it is killed.
KILL_GRACE = 5.0
# Tasks (processes and threads) in the child's PID namespace: a fork bomb stops there, and a
# parallel build (cargo -j, a test runner's workers) stays far below it.
DEFAULT_MAX_PROCESSES = 4096


def __getattr__(name: str) -> Any:
    # RefusalRecord lives in confine/refusal.py, imported only when a run fails.
    if name == "RefusalRecord":
        from egressbox.confine.refusal import RefusalRecord

        return RefusalRecord
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class RunRefusedError(EgressboxError):
    """Confinement the profile requires is unavailable (exit 126)."""

    def __init__(self, refusals: Sequence[Refusal], *, message: str = "") -> None:
        self.refusals = list(refusals)
        self.messages = [r.message() for r in self.refusals] + ([message] if message else [])
        super().__init__("; ".join(self.messages))


@dataclass(frozen=True)
class RunOptions:
    argv: tuple[str, ...]
    policy: Policy | None
    profile: Profile = Profile.WORKSPACE_PATHS
    write_roots: tuple[str, ...] = ()
    read_roots: tuple[str, ...] = ()
    env_policy: EnvPolicy = EnvPolicy.INHERITED
    grants: Mapping[str, str | None] = field(default_factory=dict)
    allow_loopback: bool = False
    pass_fds: tuple[int, ...] = ()
    cwd: str | None = None
    base_env: Mapping[str, str] | None = None
    nameservers: tuple[tuple[str, int], ...] = ()
    timeout: float | None = None  # seconds; then SIGTERM, SIGKILL after KILL_GRACE, exit 124
    presets: tuple[str, ...] = DEFAULT_PRESETS
    deny: tuple[str, ...] = ()  # read-denied paths beyond CREDENTIALS (`~` allowed)
    rlimit_nofile: int | None = None
    rlimit_as: int | None = None
    # Granted to the command's tools (caches, state), never treated as workspaces.
    process_read_roots: tuple[str, ...] = ()
    process_write_roots: tuple[str, ...] = ()
    # Directories whose unix sockets exist for the child (read-only binds).
    unix_socket_roots: tuple[str, ...] = ()
    # Files the host trusts (the policy file, the audit log): read-only or absent for the child.
    trusted_files: tuple[str, ...] = ()
    # Host-trusted paths in a writable root (HOST_TRUSTED) the child may write after all.
    writable_trusted: tuple[str, ...] = ()
    max_processes: int | None = DEFAULT_MAX_PROCESSES
    max_memory: int | None = None  # None: half the host's memory, per process
    # A run whose network boundary would be `none` refuses unless this is set.
    allow_direct_network: bool = False


@dataclass(frozen=True)
class MechanismReport:
    mechanism: str
    enforcement: Enforcement
    detail: str


@dataclass(frozen=True)
class RootReport:
    """One granted root and its kind, as the launcher applies it."""

    kind: str  # workspace | read | process_read | process_write | executable
    path: str
    detail: str


ROOT_DETAIL = {
    "workspace": "read+write; TMPDIR and tool caches live in the first one",
    "read": "read-only",
    "process_read": "read-only, for the command's tools; not a workspace",
    "process_write": "read+write, for the command's tools; not a workspace (no TMPDIR, "
    "caches or scratch directory)",
    "executable": "read+execute: the command, its interpreter or venv",
    "unix_socket": "read-only; its unix sockets may be connected to",
}


@dataclass
class RunResult:
    exit_code: int
    records: list[AuditRecord]
    report: list[MechanismReport]
    refusal: RefusalRecord | None = None
    stdout: bytes | None = None
    stderr: bytes | None = None
    warnings: list[str] = field(default_factory=list)
    roots: list[RootReport] = field(default_factory=list)
    created_trusted: list[str] = field(default_factory=list)


@dataclass
class Prepared:
    """Everything decided before the fork."""

    plan: LaunchPlan
    report: list[MechanismReport]
    host_listeners: list[socket.socket]
    network_boundary: Enforcement
    warnings: list[str] = field(default_factory=list)
    homes: tuple[str, ...] = ()  # the caller's home and the child's, for refusal records
    roots: list[RootReport] = field(default_factory=list)
    profile: Profile = Profile.WORKSPACE_PATHS
    # Host-trusted paths absent before the run: one that appears was made by the command.
    created_watch: tuple[str, ...] = ()


# -- planning --------------------------------------------------------------------------


def host_facts() -> HostFacts:
    """What this host supports: probed once per boot, kernel and user, then cached."""
    cached = _load_facts()
    if cached is not None:
        return cached
    from egressbox.confine.probe import probe_host

    support = probe_host()
    status = {m.name: m.status.value for m in support.mechanisms()}
    available = frozenset(name for name, value in status.items() if value == "available")
    abi = support.landlock.abi or 0
    facts = HostFacts(available, status, abi, os.geteuid())
    _store_facts(facts)
    return facts


def _cache_dir() -> str:
    from egressbox.confine import cache

    return cache.directory()


def _compiled_seccomp() -> bytes:
    """The seccomp filter as a cached BPF program (empty: the launcher builds it)."""
    import json

    from egressbox.confine import cache

    # Read the cache without importing the seccomp module (~7 ms with hashlib).
    path = cache.path(f"seccomp-{os.uname().machine}-{os.uname().release}.json")
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        data = json.loads(cache.read(path) or b"{}")
        if data.get("status") == "full":
            return bytes.fromhex(data["program"])
    from egressbox.confine.seccomp import Status, compile_filter

    compiled = compile_filter()
    if compiled.status is not Status.FULL:
        return b""
    cache.write(path, json.dumps({"status": "full", "program": compiled.program.hex()}).encode())
    return compiled.program


def _facts_path() -> str | None:
    from egressbox.confine import cache

    # Keyed by boot, kernel and euid: any of them changes what is available.
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        return None
    return cache.path(f"probe-{boot}-{os.uname().release}-{os.geteuid()}.json")


def _load_facts() -> HostFacts | None:
    import json

    from egressbox.confine import cache

    path = _facts_path()
    if path is None:
        return None
    try:
        data = json.loads(cache.read(path) or b"null")
        return HostFacts(
            frozenset(data["available"]), dict(data["status"]), int(data["abi"]), os.geteuid()
        )
    except (ValueError, KeyError, TypeError):
        return None


def _store_facts(facts: HostFacts) -> None:
    import json

    from egressbox.confine import cache

    path = _facts_path()
    if path is None:
        return
    data: dict[str, object] = {
        "available": sorted(facts.available),
        "status": dict(facts.status),
        "abi": facts.landlock_abi,
    }
    cache.write(path, json.dumps(data).encode())


def effective_profile(requested: Profile, env: Mapping[str, str]) -> Profile:
    """Nesting picks the strictest of the requested and the inherited profile."""
    inherited = env.get(ENV_PROFILE)
    try:
        outer = Profile(inherited) if inherited else None
    except ValueError:
        outer = None
    return strictest(requested, outer)


def prepare(options: RunOptions, facts: HostFacts) -> Prepared:
    base = dict(os.environ if options.base_env is None else options.base_env)
    profile = effective_profile(options.profile, base)
    chosen, refusals = choose_mechanisms(profile, facts)
    extra, warnings = _sandbox_fallback(profile, chosen, facts, base)
    if refusals or extra:
        raise RunRefusedError(refusals + extra)
    _refuse_open_network(chosen, options)
    home = base.get("HOME", os.path.expanduser("~"))
    cwd = os.path.realpath(options.cwd or os.getcwd())
    write_roots = _real_roots(options.write_roots, home)
    if not write_roots:
        _refuse_wide_workspace(cwd, home)
        write_roots = (cwd,)
    read_roots = _real_roots(options.read_roots, home)
    process_read = _real_roots(options.process_read_roots, home)
    process_write = _real_roots(options.process_write_roots, home)
    socket_roots = _real_roots(options.unix_socket_roots, home)
    _refuse_cwd_outside(cwd, (*write_roots, *read_roots, *process_read, *process_write))
    executable = resolve_command(options.argv[0], base, cwd)
    mounts = Mechanism.MOUNT_NAMESPACE in chosen
    scratch = scratch_paths(write_roots[0]) if mounts else make_scratch(write_roots[0])
    env = child_environment(
        base,
        policy=options.env_policy,
        grants=options.grants,
        proxy=PORT_TEMPLATES,
        scratch=scratch,
        profile=profile.value,
    )
    templates = {name: env.pop(name) for name in proxy_variables(PORT_TEMPLATES)}
    if options.allow_loopback and not {"NO_PROXY", "no_proxy"} & set(options.grants):
        # The child's own servers on its private lo are reached directly.
        env["NO_PROXY"] = env["no_proxy"] = "localhost,127.0.0.1,::1"
    extra_deny = tuple(os.path.normpath(expand_user(p, home)) for p in options.deny)
    trusted = _trusted_paths(options, write_roots, process_write, home)
    fs = plan_filesystem(
        home=home,
        write_roots=write_roots,
        read_roots=read_roots,
        executables=executable.grants,
        presets=options.presets,
        deny=_credential_paths(home, env.get("HOME")) + extra_deny,
        protected_files=trusted,
        process_read_roots=process_read,
        process_write_roots=process_write,
    )
    if options.allow_loopback and Mechanism.NETWORK_NAMESPACE not in chosen:
        raise EgressboxError("--allow-loopback needs a network namespace, which is unavailable")
    listeners = [] if Mechanism.NETWORK_NAMESPACE in chosen else _host_listeners()
    writable = (*write_roots, *process_write)
    # A read grant inside a writable root adds nothing (a venv in the workspace stays
    # writable); read-only roots nested in writable ones are fs.read_only_inside_write.
    readable = [p for p in (*fs.read, *socket_roots) if not any(is_under(p, w) for w in writable)]
    world = WorldSpec(
        grants=(*((p, False) for p in readable), *((p, True) for p in writable)),
        read_only=fs.read_only_inside_write,
        mask=fs.deny,
        socket_roots=socket_roots,
        scratch=(scratch.tmp, scratch.cache) if scratch is not None and mounts else (),
        cwd=cwd,
        protect_kernel=os.getuid() == 0,
        max_processes=options.max_processes,
    )
    plan = LaunchPlan(
        argv=options.argv,
        executable=executable.path,
        cwd=cwd,
        env=env,
        mechanisms=tuple(sorted(m.value for m in chosen)),
        uid=os.getuid(),
        gid=os.getgid(),
        host_ports=tuple(s.getsockname()[1] for s in listeners),
        read=(*fs.read, *socket_roots),
        write=fs.write,
        deny=fs.deny,
        read_only_inside_write=fs.read_only_inside_write,
        allow_loopback=options.allow_loopback,
        pass_fds=options.pass_fds,
        rlimit_nofile=options.rlimit_nofile,
        rlimit_as=options.rlimit_as,
        rlimit_nproc=options.max_processes,
        rlimit_data=options.max_memory or _half_the_memory(),
        best_effort=profile is not Profile.OS_HARDENED,
        env_ports=templates,
        parent_pid=os.getpid(),
        world=world if mounts else None,
    )
    if Mechanism.SECCOMP in chosen:
        plan = dataclasses.replace(plan, seccomp_program=_compiled_seccomp())
    report, network = enforcement_report(profile, chosen)
    homes = tuple(dict.fromkeys(h for h in (home, env.get("HOME")) if h and os.path.isabs(h)))
    roots = [
        RootReport(kind, path, ROOT_DETAIL[kind])
        for kind, paths in (
            ("workspace", write_roots),
            ("read", read_roots),
            ("process_read", process_read),
            ("process_write", process_write),
            ("unix_socket", socket_roots),
            ("executable", executable.grants),
        )
        for path in dict.fromkeys(paths)
    ]
    prepared = Prepared(plan, report, listeners, network, warnings, homes, roots)
    prepared.profile = profile
    prepared.created_watch = tuple(p for p in trusted if not os.path.lexists(p))
    return prepared


def _real_roots(paths: Sequence[str], home: str) -> tuple[str, ...]:
    return tuple(os.path.realpath(expand_user(p, home)) for p in paths)


def _half_the_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (OSError, ValueError):
        return None


def _refuse_open_network(chosen: frozenset[Mechanism], options: RunOptions) -> None:
    """No network namespace and no Landlock TCP rules: the child would reach the world."""
    if _network_boundary(chosen) is not Enforcement.NONE or options.allow_direct_network:
        return
    raise RunRefusedError(
        [],
        message="refused: this host offers neither a network namespace nor Landlock TCP "
        "rules with seccomp, so the command could reach the network directly; "
        "run as root or allow user namespaces, or pass --allow-direct-network to run it "
        "with its network unconfined",
    )


def _refuse_wide_workspace(cwd: str, home: str) -> None:
    """The current directory as the workspace, when it is `/` or the home directory itself."""
    wide = {"/", os.path.realpath(home)} if home else {"/"}
    if cwd in wide:
        what = "the whole file system" if cwd == "/" else "your whole home directory"
        raise EgressboxError(
            f"the workspace would be {cwd} ({what}): every file there would be writable by "
            "the command; run it from a project directory, or pass --write-root "
            f"{cwd} to mean it"
        )


def _refuse_cwd_outside(cwd: str, roots: Sequence[str]) -> None:
    if any(is_under(cwd, root) for root in roots):
        return
    raise EgressboxError(
        f"the working directory {cwd} is outside every root, so it would not exist for the "
        f"command; run from inside a root, or add --read-root {cwd} (or --write-root {cwd})"
    )


def _trusted_paths(
    options: RunOptions, write_roots: Sequence[str], process_write: Sequence[str], home: str
) -> tuple[str, ...]:
    """What the host trusts that a writable root may hold: read-only for the child."""
    trusted = list(host_trusted((*write_roots, *process_write)))
    policy_source = options.policy.source if options.policy is not None else ""
    files = [*options.trusted_files, *([policy_source] if policy_source else [])]
    for path in files:
        real = os.path.realpath(expand_user(path, home))
        trusted.append(real)
        trusted += _rotated_siblings(real)
    trusted.append(os.path.realpath(_cache_dir()))
    lifted = {os.path.realpath(expand_user(p, home)) for p in options.writable_trusted}
    return tuple(p for p in dict.fromkeys(trusted) if p not in lifted)


def _rotated_siblings(path: str) -> list[str]:
    """An audit log's rotated generations (log.1, log.2.gz...) beside it."""
    folder, name = os.path.split(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if n.startswith(name + ".")]


def _credential_paths(home: str, child_home: str | None) -> tuple[str, ...]:
    """The credential list under the caller's home and, when --grant moves it, the child's.

    Tools in the child look for keys under the child's $HOME: a granted
    HOME=/home/alice must not make /home/alice/.ssh readable.
    """
    paths = tuple(expand_user(p, home) for p in CREDENTIALS)
    if child_home and os.path.isabs(child_home) and os.path.normpath(child_home) != home:
        paths += tuple(expand_user(p, os.path.normpath(child_home)) for p in CREDENTIALS)
    return paths


def _sandbox_fallback(
    profile: Profile,
    chosen: frozenset[Mechanism],
    facts: HostFacts,
    env: Mapping[str, str],
) -> tuple[list[Refusal], list[str]]:
    """worktree is best effort; EGRESSBOX_SANDBOX=off|warn|enforce picks what a gap means."""
    missing = sorted(wanted(profile) - chosen)
    if profile is not Profile.WORKTREE or not missing:
        return [], []
    mode = env.get(ENV_SANDBOX, "warn")
    if mode == "enforce":
        return [
            Refusal(m, facts.status.get(HOST_NEEDS[m], "absent_on_host"), profile, ADMIT_HINT[m])
            for m in missing
        ], []
    if mode == "off":
        return [], []
    names = ", ".join(m.value for m in missing)
    return [], [
        f"profile worktree runs without {names} (unavailable here; "
        f"{ENV_SANDBOX}=enforce refuses instead)"
    ]


def scratch_paths(root: str) -> Scratch:
    """The scratch space inside the first writable root (made inside the child's view)."""
    base = os.path.join(root, SCRATCH_DIR)
    return Scratch(os.path.join(base, "tmp"), os.path.join(base, "cache"))


def make_scratch(root: str) -> Scratch | None:
    """Without a mount namespace: the scratch space made on the host, never through a link.

    An earlier child could have left `.egressbox` (or `tmp` in it) as a symlink to any
    directory of the invoker's: every step opens the next name with O_NOFOLLOW.
    """
    try:
        top = os.open(root, os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        base = _subdir(top, SCRATCH_DIR)
        try:
            for name in ("tmp", "cache"):
                os.close(_subdir(base, name))
            _write_ignore(base)
        finally:
            os.close(base)
    except OSError:
        return None
    finally:
        os.close(top)
    return scratch_paths(root)


def _subdir(parent: int, name: str) -> int:
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o755, dir_fd=parent)
    return os.open(name, os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)


def _write_ignore(base: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(".gitignore", flags, 0o644, dir_fd=base)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write("# egressbox scratch space (temp files and caches)\n*\n")


def _host_listeners() -> list[socket.socket]:
    # No network namespace: the proxy listens on the host's loopback and
    # Landlock ports plus seccomp hold the child to those port numbers.
    listeners: list[socket.socket] = []
    try:
        for _ in range(2):
            listeners.append(netns.bind_listener("127.0.0.1", 0))
    except OSError as exc:
        for sock in listeners:
            sock.close()
        # e.g. inside another run's Landlock domain, which refuses every bind
        raise EgressboxError(
            f"cannot listen on 127.0.0.1 for the proxy: {exc.strerror or exc}"
        ) from None
    return listeners


def enforcement_report(
    profile: Profile, chosen: frozenset[Mechanism]
) -> tuple[list[MechanismReport], Enforcement]:
    rows = []
    for mechanism in sorted(wanted(profile) | chosen):
        on = mechanism in chosen
        rows.append(
            MechanismReport(
                mechanism.value,
                Enforcement.FULL if on else Enforcement.NONE,
                "applied" if on else "unavailable on this host",
            )
        )
    network = _network_boundary(chosen)
    rows.append(MechanismReport("network_boundary", network, _NETWORK_DETAIL[network]))
    return rows, network


_NETWORK_DETAIL = {
    Enforcement.FULL: "a private network namespace: the proxy is the only endpoint",
    Enforcement.PARTIAL: "no network namespace: TCP only, to the proxy's port numbers, "
    "but on any address",
    Enforcement.NONE: "the child could reach the network directly",
}


def _network_boundary(chosen: frozenset[Mechanism]) -> Enforcement:
    if Mechanism.NETWORK_NAMESPACE in chosen:
        return Enforcement.FULL
    if Mechanism.LANDLOCK_NET in chosen and Mechanism.SECCOMP in chosen:
        return Enforcement.PARTIAL
    return Enforcement.NONE


def applied_report(
    profile: Profile, chosen: frozenset[Mechanism], applied: Mapping[str, Any] | None
) -> tuple[list[MechanismReport], Enforcement]:
    """The report from what the launcher says it applied, never from the plan.

    No word from the launcher (it failed before exec): nothing is reported as applied.
    """
    held = _held(applied or {})
    rows = []
    for mechanism in sorted(wanted(profile) | chosen):
        state, detail = held.get(mechanism, (Enforcement.NONE, ""))
        if mechanism not in chosen:
            detail = "unavailable on this host"
        elif state is Enforcement.NONE:
            detail = detail or "planned, but not applied"
        rows.append(MechanismReport(mechanism.value, state, detail or "applied"))
    applied_set = frozenset(m for m, (state, _) in held.items() if state is Enforcement.FULL)
    network = _network_boundary(applied_set)
    rows.append(MechanismReport("network_boundary", network, _NETWORK_DETAIL[network]))
    return rows, network


def _held(applied: Mapping[str, Any]) -> dict[Mechanism, tuple[Enforcement, str]]:
    full, none = Enforcement.FULL, Enforcement.NONE
    ns = set(applied.get("namespaces") or ())
    ll = applied.get("landlock") or {}
    world = applied.get("world") or {}
    skipped = "; ".join(f"{what}: {why}" for what, why in world.get("skipped") or ())
    seccomp = str(applied.get("seccomp", "none"))
    detail = f"constructed root ({len(world.get('steps') or ())} steps)"
    return {
        Mechanism.NETWORK_NAMESPACE: (full if "net" in ns else none, ""),
        Mechanism.MOUNT_NAMESPACE: (
            full if "mnt" in ns and world else none,
            f"{detail}; not done: {skipped}" if skipped else detail,
        ),
        Mechanism.PID_NAMESPACE: (full if "pid" in ns else none, ""),
        Mechanism.LANDLOCK_FS: (full if ll.get("fs") else none, f"ABI {ll.get('abi', 0)}"),
        Mechanism.LANDLOCK_NET: (full if ll.get("net") else none, ""),
        Mechanism.LANDLOCK_SCOPE: (full if ll.get("scopes") else none, ""),
        Mechanism.SECCOMP: (Enforcement(seccomp) if seccomp in {"full", "partial"} else none, ""),
        Mechanism.CAPABILITIES: (full if applied.get("capabilities") else none, ""),
    }


def confirm(prepared: Prepared, launched: Launched, options: RunOptions) -> None:
    """Replace the planned report with what the launcher applied; say a gap on stderr."""
    chosen = frozenset(Mechanism(m) for m in prepared.plan.mechanisms)
    applied = launched.read_applied()
    if applied is None:
        return  # the command never ran: its exit code and message say why
    prepared.report, prepared.network_boundary = applied_report(prepared.profile, chosen, applied)
    gaps = [
        row.mechanism
        for row in prepared.report
        if row.enforcement is not Enforcement.FULL
        and row.mechanism != "network_boundary"
        and not (options.allow_loopback and row.mechanism == Mechanism.LANDLOCK_NET.value)
    ]
    if gaps or prepared.network_boundary is not Enforcement.FULL:
        line = (
            f"confinement is partial: network boundary {prepared.network_boundary.value}; "
            f"not applied: {', '.join(gaps) or '-'} (--report for details)"
        )
        prepared.warnings.append(line)
        write_err(f"warning: {line}")


# -- spawning ---------------------------------------------------------------------------


@dataclass
class Launched:
    pid: int
    listeners: list[socket.socket]
    stdout_fd: int | None = None
    stderr_fd: int | None = None
    chan: socket.socket | None = None  # to the launcher, until go() or abandon()
    # The command's stderr through us, or its new terminal relayed by us (None: neither).
    tee: StderrTee | TerminalRelay | None = None
    report_fd: int | None = None  # what the launcher applied, until read_applied()
    applied: dict[str, Any] | None = None
    # --timeout: when the next step is due (time.monotonic()), and whether it expired.
    due: float | None = None
    timeout: float | None = None
    timed_out: bool = False

    def start_timer(self, timeout: float | None) -> None:
        if timeout is not None:
            self.timeout = timeout
            self.due = time.monotonic() + timeout

    def expire(self) -> float | None:
        """Send the timeout's signal when due (SIGTERM, then SIGKILL after KILL_GRACE).

        Returns the seconds until the next step, None when none is pending.
        Call it only while the launcher is not yet reaped (its pid is ours).
        """
        if self.due is None:
            return None
        left = self.due - time.monotonic()
        if left > 0:
            return left
        if self.timed_out:
            signum, self.due = signal.SIGKILL, None
        else:
            signum, self.due, self.timed_out = signal.SIGTERM, time.monotonic() + KILL_GRACE, True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)
        return None if self.due is None else KILL_GRACE

    def read_applied(self, timeout: float = LAUNCHER_TIMEOUT) -> dict[str, Any] | None:
        """What the launcher applied, sent just before exec; None if it never got there."""
        if self.report_fd is None:
            return self.applied
        import json
        import select

        data = b""
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0:
                if not select.select([self.report_fd], [], [], left)[0]:
                    break
                chunk = os.read(self.report_fd, 65536)
                if not chunk:
                    break
                data += chunk
        except InterruptedError:
            pass
        finally:
            os.close(self.report_fd)
            self.report_fd = None
        with contextlib.suppress(ValueError):
            loaded = json.loads(data) if data else None
            self.applied = loaded if isinstance(loaded, dict) else None
        return self.applied

    def go(self) -> None:
        """Let the launcher start the command."""
        if self.chan is not None:
            with contextlib.suppress(OSError):
                self.chan.send(b"go")
            self.chan.close()
            self.chan = None

    def abandon(self) -> None:
        """The command must not start (say, a bad policy): stop the launcher."""
        if self.chan is not None:
            self.chan.close()
            self.chan = None
        for sock in self.listeners:
            sock.close()
        _kill_and_reap(self.pid)
        self.stderr_tail()

    def stderr_tail(self) -> bytes | None:
        """Once the launcher has exited: the end of the command's stderr (bounded wait)."""
        if self.tee is None:
            return None
        return self.tee.finish()

    def forward(self, signum: int) -> None:
        """Pass a signal on to the launcher (a new window size reaches the pty first)."""
        if signum == signal.SIGWINCH and self.tee is not None:
            self.tee.resize()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)


class LaunchFailedError(EgressboxError):
    def __init__(self, message: str, code: int = EXIT_CANNOT_CONFINE) -> None:
        super().__init__(message)
        self.code = code


def spawn(prepared: Prepared, *, capture_output: bool = False) -> Launched:
    """Fork the launcher and receive the listeners it bound (or use the host's)."""
    from egressbox.confine.launcher import launcher_main

    parent_chan, child_chan = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # What the launcher applied arrives on this pipe just before exec, which closes it.
    report_r, report_w = os.pipe()
    plan = dataclasses.replace(prepared.plan, report_fd=report_w)
    pipes = (os.pipe(), os.pipe()) if capture_output else None
    # Not captured: the command's stderr still passes through us (refusal records). It never
    # gets our terminal: a new pty takes the place of each of our std fds that is one.
    tee = open_stdio(capture_output=capture_output)
    if isinstance(tee, TerminalRelay):
        plan = dataclasses.replace(plan, controlling_tty=True)
    try:
        pid = os.fork()
    except BaseException:
        if tee is not None:
            tee.abandon()
        os.close(report_r)
        os.close(report_w)
        raise
    if pid == 0:  # the launcher
        parent_chan.close()
        os.close(report_r)
        if pipes is not None:
            os.dup2(pipes[0][1], 1)
            os.dup2(pipes[1][1], 2)
        if tee is not None:
            for target, source in tee.child_fds().items():
                os.dup2(source, target)
            tee.close_in_child()
        launcher_main(plan, child_chan.detach())
    child_chan.close()
    os.close(report_w)
    if tee is not None:
        tee.start()
    out_fd = err_fd = None
    if pipes is not None:
        os.close(pipes[0][1])
        os.close(pipes[1][1])
        out_fd, err_fd = pipes[0][0], pipes[1][0]
    try:
        listeners = _receive(parent_chan, prepared)
    except BaseException:
        parent_chan.close()
        os.close(report_r)
        _kill_and_reap(pid)
        if tee is not None:
            tee.finish()
        raise
    parent_chan.settimeout(None)
    launched = Launched(pid, listeners, out_fd, err_fd, parent_chan, tee=tee)
    launched.report_fd = report_r
    return launched


def _receive(chan: socket.socket, prepared: Prepared) -> list[socket.socket]:
    chan.settimeout(LAUNCHER_TIMEOUT)
    try:
        message, fds = netns.recv_message(chan)
    except TimeoutError:
        raise LaunchFailedError("the launcher did not start in time") from None
    if message.get("event") == "refused":
        raise LaunchFailedError(str(message.get("message", "confinement failed")))
    if message.get("event") != "listening":
        raise LaunchFailedError("the launcher ended before it was ready")
    if not fds:
        return prepared.host_listeners
    listeners = [socket.socket(fileno=fd) for fd in fds]
    own = netns.own_namespace_inode()
    if any(netns.namespace_inode(s) == own for s in listeners):
        for sock in listeners:
            sock.close()
        raise LaunchFailedError("the child's listeners are not in a private network namespace")
    return listeners


def _kill_and_reap(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


# -- serving while the command runs -------------------------------------------------------


async def supervise(
    launched: Launched,
    options: RunOptions,
    prepared: Prepared,
    *,
    audit: AuditSink | None = None,
    log: Any = None,
) -> RunResult:
    """Serve the child's listeners until the launcher exits; return the result.

    However the run ends, nothing of it outlives it: on cancellation, an
    error, or its event loop closing under it, the launcher is killed (the
    command's PID namespace with it) and reaped, the proxy closed and every
    descriptor of the run released; then the exception goes on.
    """
    hold = _Hold(launched)
    try:
        hold.proxy = _make_proxy(launched, options, audit=audit, log=log)
    except BaseException:
        hold.abandon()
        raise
    return await _supervise(hold, prepared)


def _make_proxy(
    launched: Launched, options: RunOptions, *, audit: AuditSink | None = None, log: Any = None
) -> EgressProxy:
    """The proxy for the launcher's listeners (not started: _supervise() starts it)."""
    from egressbox.resolve import DnsResolver
    from egressbox.server import EgressProxy

    http, socks = launched.listeners[0], launched.listeners[1]
    for sock in launched.listeners:
        sock.setblocking(False)
    resolver = DnsResolver(list(options.nameservers)) if options.nameservers else None
    return EgressProxy(
        options.policy,
        http_sockets=[http],
        socks_sockets=[socks],
        resolver=resolver,
        audit=audit,
        keep_records=True,
        log=log,
    )


class _Hold:
    """What a run holds until it ends; let go of once, whatever ends it."""

    def __init__(self, launched: Launched, proxy: EgressProxy | None = None) -> None:
        self.launched = launched
        self.proxy = proxy
        self.readers: list[_Collector] = []
        self.reaped = False
        self.released = False

    def reap(self) -> int:
        """The launcher has exited: reap it; its exit code as a shell reports it."""
        _, status = os.waitpid(self.launched.pid, 0)
        self.reaped = True
        return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

    def stop(self) -> None:
        """SIGKILL the launcher and its reaper and reap it; return once they are gone.

        Only while it is unreaped: until then nobody else can have its pid.
        """
        if not self.reaped:
            self.reaped = True
            _kill_tree(self.launched.pid)
            # Nobody reads what it applied now: close that pipe too.
            self.launched.read_applied(0)

    def release(self) -> None:
        """Close the run's own descriptors (after the proxy let go of the listeners)."""
        if self.released:
            return
        self.released = True
        for reader in self.readers:
            reader.close()
        launched = self.launched
        if not self.readers:  # torn down before _supervise made them
            for fd in (launched.stdout_fd, launched.stderr_fd):
                if fd is not None:
                    os.close(fd)
            launched.stdout_fd = launched.stderr_fd = None
        launched.stderr_tail()
        for sock in launched.listeners:
            sock.close()  # served ones are closed already; unserved ones are not

    def abandon(self) -> None:
        """Tear the run down awaiting nothing: its loop is closing, or it never ran."""
        if self.released:
            return
        self.stop()
        if self.proxy is not None:
            self.proxy.abort()
        self.release()

    def after(self, task: Any) -> None:
        # A Task cancelled before its first step never ran _supervise's clean-up.
        del task
        self.abandon()


# A run torn down (cancelled) waits at most this long for its killed PID namespace to
# empty (milliseconds, unless a process is stuck in the kernel).
TREE_GONE_TIMEOUT = 2.0


def _kill_tree(pid: int) -> None:
    """SIGKILL the launcher and its children (the reaper, pid 1 of the command's PID
    namespace), reap the launcher, and wait (bounded) for the children to be gone.

    The reaper would die of its parent-death signal anyway, but only after we
    returned: waiting on it means nothing of the command runs once the run is
    torn down (when pid 1 of a namespace is gone, so is everything in it).
    """
    children = _child_pidfds(pid)
    try:
        for fd in children:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        _kill_and_reap(pid)
        _wait_exited(children, TREE_GONE_TIMEOUT)
    finally:
        for fd in children:
            os.close(fd)


def _child_pidfds(pid: int) -> list[int]:
    """pidfds on `pid`'s children (a child's pid stays its own while `pid` holds it)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            pids = [int(text) for text in f.read().split()]
    except (OSError, ValueError):
        return []  # no CONFIG_PROC_CHILDREN: the reaper's parent-death signal must do
    fds = []
    for child in pids:
        with contextlib.suppress(OSError):
            fds.append(os.pidfd_open(child))
    return fds


def _wait_exited(pidfds: Sequence[int], timeout: float) -> None:
    import select

    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    left = set(pidfds)
    while left and (remaining := deadline - time.monotonic()) > 0:
        with contextlib.suppress(InterruptedError):
            for fd, _ in poller.poll(remaining * 1000):
                left.discard(fd)
                poller.unregister(fd)


async def _supervise(hold: _Hold, prepared: Prepared) -> RunResult:
    import asyncio

    launched, proxy = hold.launched, hold.proxy
    assert proxy is not None
    loop = asyncio.get_running_loop()
    try:
        hold.readers = [_Collector(loop, fd) for fd in (launched.stdout_fd, launched.stderr_fd)]
        await proxy.start()
        await _wait_forwarding(loop, launched)
        code = hold.reap()
        outputs = await asyncio.gather(*(r.finish(DRAIN_TIMEOUT) for r in hold.readers))
    except GeneratorExit:
        # The coroutine is being finalized (its loop closed with the run in
        # flight): nothing may be awaited any more.
        hold.abandon()
        raise
    except BaseException:
        hold.stop()
        try:
            await proxy.close(0)
        finally:
            hold.release()
        raise
    tail = launched.stderr_tail()
    try:
        await proxy.close(0)
    finally:
        hold.release()
    stderr = outputs[1] if outputs[1] is not None else tail
    result = _result(code, list(proxy.records), prepared, launched, stderr)
    result.warnings = prepared.warnings
    result.stdout, result.stderr = outputs
    return result


class _Collector:
    """Reads a captured stream to its end; after the command exits, waits only so long
    (a grandchild outside a PID namespace may hold the pipe open)."""

    def __init__(self, loop: Any, fd: int | None) -> None:
        self.loop = loop
        self.fd = fd
        self.chunks: list[bytes] = []
        self.captured = fd is not None
        self.done = loop.create_future()
        if fd is None:
            self.done.set_result(None)
            return
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        assert self.fd is not None
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.chunks.append(data)
            return
        self.close()

    async def finish(self, timeout: float) -> bytes | None:
        import asyncio

        if not self.captured:
            return None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.done), timeout)
        if self.fd is not None:  # still open: take what is there now, then let go
            with contextlib.suppress(OSError):
                for _ in range(FINAL_READS):
                    data = os.read(self.fd, 65536)
                    if not data:
                        break
                    self.chunks.append(data)
            self.close()
        return b"".join(self.chunks)

    def close(self) -> None:
        # Also from a coroutine being finalized after its loop closed, which
        # refuses to schedule anything: the descriptor is closed regardless.
        if self.fd is not None:
            with contextlib.suppress(RuntimeError):
                self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = None
        if not self.done.done():
            with contextlib.suppress(RuntimeError):
                self.done.set_result(None)


async def _wait_forwarding(loop: Any, launched: Launched) -> None:
    """Wait until the launcher exits (pidfd; the caller reaps it), passing
    SIGINT/SIGTERM/SIGHUP on to it."""
    from egressbox.confine.launcher import FORWARDED

    pid = launched.pid
    timer: list[Any] = []

    def expire() -> None:
        delay = launched.expire()
        if delay is not None:
            timer[:] = [loop.call_later(delay, expire)]

    def forward(signum: int) -> None:
        launched.forward(signum)

    installed = []
    for signum in FORWARDED:
        with contextlib.suppress(RuntimeError, ValueError):
            loop.add_signal_handler(signum, forward, signum)
            installed.append(signum)
    pidfd = os.pidfd_open(pid)
    exited = loop.create_future()
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    expire()
    try:
        await exited
    finally:
        # Also when the loop closed under the run (see _Collector.close).
        for handle in timer:
            handle.cancel()
        with contextlib.suppress(RuntimeError):
            loop.remove_reader(pidfd)
        os.close(pidfd)
        for signum in installed:
            with contextlib.suppress(RuntimeError, ValueError):
                loop.remove_signal_handler(signum)


def classify_refusal(
    records: Sequence[AuditRecord],
    code: int,
    stderr: bytes | None = None,
    plan: PathPlan | None = None,
    lookup: Callable[[str], HostPath] | None = None,
) -> RefusalRecord:
    """Which boundary most likely refused a failing child.

    The proxy's denials come first (egress); then the command's own error
    output (`stderr`, its tail) judged against the run's `plan`
    (confine/refusal.py); no evidence: unknown.
    """
    from egressbox.confine.refusal import SOURCE_AUDIT, Boundary, RefusalRecord, classify_output

    denied = [r for r in records if r.decision.value == "deny"]
    if denied:
        seen = dict.fromkeys(f"{r.host}:{r.port} ({r.reason.value})" for r in denied)
        return RefusalRecord(Boundary.EGRESS, tuple(seen), source=SOURCE_AUDIT)
    del code
    if stderr and plan is not None:
        text = stderr.decode("utf-8", "replace")
        found = classify_output(text, plan, lookup or host_path)
        if found is not None:
            return found
    return RefusalRecord(Boundary.UNKNOWN)


def path_plan(prepared: Prepared) -> PathPlan:
    """The filesystem side of the plan the launcher applied, for judging refusals."""
    from egressbox.confine.refusal import PathPlan

    plan = prepared.plan
    mounts = plan.has(Mechanism.MOUNT_NAMESPACE)
    landlock = plan.has(Mechanism.LANDLOCK_FS)
    kernel: tuple[str, ...] = ()
    if mounts and plan.uid == 0:
        from egressbox.confine.world import KERNEL_READ_ONLY

        kernel = KERNEL_READ_ONLY
    return PathPlan(
        homes=prepared.homes,
        read=plan.read,
        write=plan.write,
        # Masks and nested read-only roots are mounts, or (without a mount
        # namespace) Landlock grants that leave them out.
        deny=(*plan.deny, *_etc_hidden()) if mounts else plan.deny if landlock else (),
        read_only=plan.read_only_inside_write if mounts or landlock else (),
        always_read_only=kernel,
        # The constructed root: nothing of the host exists but the grants.
        hidden=("/",) if mounts else (),
        bound_back=_visible(plan) if mounts else (),
        landlock_fs=landlock,
        abstract_isolated=plan.has(Mechanism.NETWORK_NAMESPACE)
        or plan.has(Mechanism.LANDLOCK_SCOPE),
    )


def _etc_hidden() -> list[str]:
    """The /etc entries the child's view covers (walked again only when a run failed)."""
    from egressbox.confine.world import unreadable_to_others

    return unreadable_to_others("/etc")


def _visible(plan: LaunchPlan) -> tuple[tuple[str, bool], ...]:
    """What exists in the child's view, and whether it may be written there."""
    from egressbox.confine.world import CONSTRUCTED

    # The private /tmp, /var/tmp and /run are not the host's: a host path there is absent.
    grants = plan.world.grants if plan.world is not None else ()
    made = tuple((p, p not in ("/proc", "/sys")) for p in CONSTRUCTED)
    return (*made, *((os.path.realpath(p), w) for p, w in grants))


def host_path(path: str) -> HostPath:
    """What the host says about a path the command named (stat only, never opened)."""
    import stat

    from egressbox.confine.refusal import HostPath

    parent = os.path.isdir(os.path.dirname(path))
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return HostPath(False, parent_exists=parent)
    return HostPath(
        True,
        is_socket=stat.S_ISSOCK(st.st_mode),
        is_dir=stat.S_ISDIR(st.st_mode),
        parent_exists=parent,
        readable=_mode_allows_read(st),
    )


def _mode_allows_read(st: os.stat_result) -> bool:
    # By the permission bits alone: a confined root keeps uid 0 but has no
    # capabilities, so it cannot read another user's private files either.
    import stat

    if st.st_uid == os.geteuid():
        return bool(st.st_mode & stat.S_IRUSR)
    if st.st_gid == os.getegid() or st.st_gid in os.getgroups():
        return bool(st.st_mode & stat.S_IRGRP)
    return bool(st.st_mode & stat.S_IROTH)


# -- the whole run -----------------------------------------------------------------------


def options_for(
    cmd: Sequence[str],
    *,
    policy: Policy | None,
    profile: Profile | str | None = None,
    write_roots: Sequence[str] = (),
    read_roots: Sequence[str] = (),
    process_read_roots: Sequence[str] = (),
    process_write_roots: Sequence[str] = (),
    env: EnvPolicy | str | None = None,
    grants: Mapping[str, str | None] | None = None,
    allow_loopback: bool = False,
    pass_fds: Sequence[int] = (),
    cwd: str | None = None,
    base_env: Mapping[str, str] | None = None,
    nameservers: Sequence[tuple[str, int]] = (),
    timeout: float | None = None,
    allow_direct_network: bool = False,
    unix_socket_roots: Sequence[str] = (),
) -> RunOptions:
    """RunOptions from the keyword arguments of run() / run_sync() / spawn_confined().

    The policy's [process], [filesystem] and [env] tables are the defaults:
    `profile`, `env` and `timeout` win over them, roots and grants add to them.
    """
    if not cmd:
        raise ValueError("cmd must name a program")
    return RunOptions(
        argv=tuple(cmd),
        policy=policy,
        allow_loopback=allow_loopback,
        allow_direct_network=allow_direct_network,
        pass_fds=tuple(pass_fds),
        cwd=cwd,
        base_env=base_env,
        nameservers=tuple(nameservers),
        **with_settings(
            policy.run_settings if policy is not None else None,
            profile=profile,
            env=env,
            write_roots=write_roots,
            read_roots=read_roots,
            process_read_roots=process_read_roots,
            process_write_roots=process_write_roots,
            unix_socket_roots=unix_socket_roots,
            grants=grants or {},
            timeout=timeout,
        ),
    )


def with_settings(
    settings: RunSettings | None,
    *,
    profile: Profile | str | None,
    env: EnvPolicy | str | None,
    write_roots: Sequence[str],
    read_roots: Sequence[str],
    grants: Mapping[str, str | None],
    timeout: float | None,
    process_read_roots: Sequence[str] = (),
    process_write_roots: Sequence[str] = (),
    unix_socket_roots: Sequence[str] = (),
    writable_trusted: Sequence[str] = (),
) -> dict[str, Any]:
    """RunOptions fields from the policy's run tables and the caller's choices.

    The caller's profile, environment policy and timeout win; its roots come
    first (the first writable root holds the scratch space) and its grants
    override the table's for the same name.
    """
    if settings is None:
        from egressbox.policy import RunSettings

        settings = RunSettings()
    process, fs, table_env = settings.process, settings.filesystem, settings.env
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be more than 0 seconds, got {timeout}")
    return {
        "profile": Profile(profile or process.profile or Profile.WORKSPACE_PATHS),
        "env_policy": EnvPolicy(env or table_env.policy or EnvPolicy.INHERITED),
        "write_roots": tuple(dict.fromkeys((*write_roots, *fs.write_roots))),
        "read_roots": tuple(dict.fromkeys((*read_roots, *fs.read_roots))),
        "process_read_roots": tuple(dict.fromkeys((*process_read_roots, *fs.process_read_roots))),
        "process_write_roots": tuple(
            dict.fromkeys((*process_write_roots, *fs.process_write_roots))
        ),
        "grants": dict(table_env.grant) | dict(grants),
        "timeout": timeout if timeout is not None else process.timeout,
        "presets": fs.presets,
        "deny": fs.deny,
        "rlimit_nofile": process.rlimit_nofile,
        "rlimit_as": process.rlimit_as,
        "unix_socket_roots": tuple(dict.fromkeys((*unix_socket_roots, *fs.unix_socket_roots))),
        "writable_trusted": tuple(dict.fromkeys((*writable_trusted, *fs.writable_trusted))),
        "max_processes": process.max_processes or DEFAULT_MAX_PROCESSES,
        "max_memory": process.max_memory,
    }


def _warn(prepared: Prepared) -> None:
    """A best-effort profile running with less than it wants says so, once, before the command."""
    for text in prepared.warnings:
        write_err(f"warning: {text}")


def _exit_before_first_connection(launched: Launched) -> int | None:
    """Wait (without asyncio) until the child connects or exits.

    A command that never connects then never pays for starting the proxy;
    one that does waits in the listen backlog for a few milliseconds.
    """
    import select

    def forward(signum: int, _frame: object) -> None:
        launched.forward(signum)

    from egressbox.confine.launcher import FORWARDED

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED}
    pidfd = os.pidfd_open(launched.pid)
    try:
        while True:
            try:
                watched = [pidfd, *(sock.fileno() for sock in launched.listeners)]
                ready, _, _ = select.select(watched, [], [], launched.expire())
                if ready:
                    break
            except InterruptedError:
                continue
    finally:
        os.close(pidfd)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if any(sock.fileno() in ready for sock in launched.listeners):
        return None
    _, status = os.waitpid(launched.pid, 0)
    for sock in launched.listeners:
        sock.close()
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _result(
    code: int,
    records: list[AuditRecord],
    prepared: Prepared,
    launched: Launched,
    stderr: bytes | None = None,
) -> RunResult:
    if launched.timed_out:
        from egressbox.confine.refusal import Boundary, RefusalRecord

        result = RunResult(EXIT_TIMEOUT, records, prepared.report, roots=prepared.roots)
        result.refusal = RefusalRecord(Boundary.TIMEOUT, timeout=launched.timeout)
        return result
    result = RunResult(code, records, prepared.report, roots=prepared.roots)
    result.created_trusted = _created_trusted(prepared)
    result.warnings = list(prepared.warnings) + result.created_trusted
    if code != 0:
        result.refusal = classify_refusal(records, code, stderr, path_plan(prepared))
    return result


def _created_trusted(prepared: Prepared) -> list[str]:
    """Host-trusted files the command created: read-only binds need them to exist first."""
    return [
        f"the command created {path}, which the host trusts (it may run code at your next "
        "git command, shell or editor start): review it before you use it"
        for path in prepared.created_watch
        if os.path.lexists(path)
    ]


def _start(
    options: RunOptions, facts: HostFacts | None, capture_output: bool
) -> tuple[Prepared, Launched]:
    prepared = prepare(options, facts or host_facts())
    _warn(prepared)
    launched = spawn(prepared, capture_output=capture_output)
    launched.go()
    launched.start_timer(options.timeout)
    confirm(prepared, launched, options)
    return prepared, launched


def run_options_sync(
    options: RunOptions,
    *,
    audit: AuditSink | None = None,
    capture_output: bool = False,
    log: Any = None,
    facts: HostFacts | None = None,
    policy_loader: Callable[[], Policy | None] | None = None,
) -> RunResult:
    """Plan, fork the launcher, serve until the command exits (blocking).

    With `policy_loader`, the policy is loaded while the launcher sets the
    sandbox up (start-up time); if loading raises, the command never starts.
    """
    prepared = prepare(options, facts or host_facts())
    _warn(prepared)
    launched = spawn(prepared, capture_output=capture_output)
    if policy_loader is not None:
        try:
            options = dataclasses.replace(options, policy=policy_loader())
        except BaseException:
            launched.abandon()
            raise
    launched.go()
    launched.start_timer(options.timeout)
    confirm(prepared, launched, options)
    if not capture_output:
        early = _exit_before_first_connection(launched)
        if early is not None:
            return _result(early, [], prepared, launched, launched.stderr_tail())
    from egressbox.serve import run_loop

    holder: list[RunResult] = []

    async def main() -> int:
        holder.append(await supervise(launched, options, prepared, audit=audit, log=log))
        return 0

    run_loop(main)
    return holder[0]


async def run_options(
    options: RunOptions,
    *,
    audit: AuditSink | None = None,
    capture_output: bool = False,
    log: Any = None,
    facts: HostFacts | None = None,
) -> RunResult:
    """The async twin of run_options_sync (forks from the running loop's thread)."""
    prepared, launched = _start(options, facts, capture_output)
    return await supervise(launched, options, prepared, audit=audit, log=log)


async def run(
    cmd: Sequence[str],
    *,
    policy: Policy | None,
    audit: AuditSink | None = None,
    capture_output: bool = False,
    **kwargs: Any,
) -> RunResult:
    """Run `cmd` confined behind a managed proxy; see options_for() for the keywords.

    result = await egressbox.run(["curl", "https://pypi.org"], policy=policy)
    result.exit_code, result.records, result.report, result.refusal
    """
    options = options_for(cmd, policy=policy, **kwargs)
    return await run_options(options, audit=audit, capture_output=capture_output)


def run_sync(
    cmd: Sequence[str],
    *,
    policy: Policy | None,
    audit: AuditSink | None = None,
    capture_output: bool = False,
    **kwargs: Any,
) -> RunResult:
    """The blocking twin of run() (starts its own event loop)."""
    options = options_for(cmd, policy=policy, **kwargs)
    return run_options_sync(options, audit=audit, capture_output=capture_output)


class ConfinedProcess:
    """A Popen-like handle on a confined command that is running now (spawn_confined)."""

    def __init__(self, hold: _Hold, task: Any, proxy: EgressProxy) -> None:
        self._hold = hold
        self._task = task
        self._proxy = proxy

    @property
    def pid(self) -> int:
        """The launcher's pid: signals sent here reach the command."""
        return self._hold.launched.pid

    def send_signal(self, signum: int) -> None:
        # Not once the launcher is reaped: its pid may be someone else's by then.
        if not self._hold.reaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._hold.launched.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    @property
    def policy(self) -> Policy | None:
        """The policy the run's proxy decides with now."""
        return self._proxy.policy

    def set_policy(self, policy: Policy, *, close_denied: bool = False) -> int:
        """Change the running command's egress policy: decisions from now on use it.

        With `close_denied`, open tunnels and forwarding connections that the
        new policy would not admit are closed too (EgressProxy.close_denied);
        returns how many. Only the [egress], [dns] and [limits] tables can
        change under a running command: its sandbox stays as it started.
        """
        return self._proxy.set_policy(policy, close_denied=close_denied)

    async def wait(self) -> RunResult:
        """The run's result, once the command has exited.

        Cancelling wait() cancels the run (the command is killed); wrap it in
        asyncio.shield() to wait with a timeout and leave the command running.
        """
        result: RunResult = await self._task
        return result


async def spawn_confined(
    cmd: Sequence[str],
    *,
    policy: Policy | None,
    audit: AuditSink | None = None,
    capture_output: bool = False,
    **kwargs: Any,
) -> ConfinedProcess:
    """Start `cmd` confined and return its handle as soon as the command is started.

    A coroutine, to await on the event loop that is to serve the run: the
    proxy runs there, in a Task, until the command exits (`await
    handle.wait()` for the RunResult). The keywords are options_for()'s.
    """
    import asyncio

    options = options_for(cmd, policy=policy, **kwargs)
    loop = asyncio.get_running_loop()  # before the fork: no loop, no run
    prepared, launched = _start(options, None, capture_output)
    hold = _Hold(launched)
    try:
        proxy = _make_proxy(launched, options, audit=audit)
    except BaseException:
        hold.abandon()
        raise
    hold.proxy = proxy
    task = loop.create_task(_supervise(hold, prepared))
    task.add_done_callback(hold.after)
    return ConfinedProcess(hold, task, proxy)


def exit_code_for(error: BaseException) -> int:
    if isinstance(error, CommandNotFoundError):
        return EXIT_NOT_FOUND
    return EXIT_CANNOT_CONFINE


def write_err(line: str) -> None:
    sys.stderr.write(f"egressbox: {line}\n")
    sys.stderr.flush()


def run_command(args: Any, argv: list[str]) -> int:
    """`egressbox run`: the CLI front of run_sync (no asyncio imported before the fork)."""
    from egressbox.errors import AuditError
    from egressbox.exitcodes import EXIT_USAGE

    settings = _cli_run_settings(args)
    if isinstance(settings, int):
        return settings
    options = _cli_options(args, argv, settings)
    if options is None:
        return EXIT_USAGE
    audit: AuditSink | None = None
    try:
        if args.audit_log:
            from egressbox.audit import JsonlFileSink  # only then: it costs ~5 ms

            audit = JsonlFileSink(args.audit_log)
    except AuditError as exc:
        write_err(f"--audit-log: {exc}")
        return EXIT_USAGE
    try:
        result = _run_reporting_errors(options, audit, args)
    finally:
        if audit is not None:
            audit.close()
    if isinstance(result, int):
        return result
    if args.report:
        for row in result.report:
            write_err(f"enforcement: {row.mechanism}: {row.enforcement.value} ({row.detail})")
        for root in result.roots:
            write_err(f"root: {root.kind}: {root.path} ({root.detail})")
    for line in result.created_trusted:
        write_err(f"warning: {line}")
    if result.refusal is not None:
        write_err(result.refusal.line(result.exit_code))
    return result.exit_code


def _cli_policy(args: Any) -> Policy | None:
    """The command line's policy (loaded while the launcher starts)."""
    from egressbox.policy import load_policy_or_environment

    policy = load_policy_or_environment(args.policy)
    if policy is not None and args.report_only:
        from egressbox.policy import Mode
        from egressbox.suggest import with_mode

        policy = with_mode(policy, Mode.REPORT)
        write_err("warning: report mode lets names outside the allow list through")
    return policy


def _cli_run_settings(args: Any) -> RunSettings | int | None:
    """--policy's [process], [filesystem] and [env], read before the fork (they shape
    the sandbox); the rest of the policy loads while the launcher starts."""
    if not args.policy:
        return None
    from egressbox.errors import PolicyError
    from egressbox.policy import load_run_settings

    try:
        return load_run_settings(args.policy)
    except PolicyError as exc:
        from egressbox.errors import print_policy_error
        from egressbox.exitcodes import EXIT_USAGE

        print_policy_error(exc, sys.stderr)
        return EXIT_USAGE


def _cli_options(
    args: Any, argv: list[str], settings: RunSettings | None = None
) -> RunOptions | None:
    from egressbox.confine.env import parse_grant

    try:
        grants = dict(parse_grant(text) for text in args.grant)
        servers = _nameservers(args.nameserver)
        chosen = with_settings(
            settings,
            profile=args.profile,
            env=args.env_policy,
            write_roots=args.write_root,
            read_roots=args.read_root,
            process_read_roots=args.process_read_root,
            process_write_roots=args.process_write_root,
            unix_socket_roots=args.unix_socket_root,
            writable_trusted=args.writable_trusted,
            grants=grants,
            timeout=args.timeout,
        )
    except ValueError as exc:
        write_err(str(exc))
        return None
    for path in chosen["writable_trusted"]:
        write_err(f"warning: {path} is host-trusted; the command may write it (--writable-trusted)")
    trusted = tuple(p for p in (args.policy, args.audit_log) if p and p != "-")
    return RunOptions(
        argv=tuple(argv),
        policy=None,
        allow_loopback=args.allow_loopback,
        allow_direct_network=args.allow_direct_network,
        pass_fds=tuple(args.pass_fd),
        nameservers=servers,
        trusted_files=trusted,
        **chosen,
    )


def _nameservers(texts: Sequence[str]) -> tuple[tuple[str, int], ...]:
    if not texts:
        return ()
    # Imported only when asked for: it loads dnspython (~45 ms).
    from egressbox.resolve import parse_nameserver

    return tuple(parse_nameserver(text) for text in texts)


def _diagnostic(line: str) -> None:
    write_err(line)


def _run_reporting_errors(
    options: RunOptions, audit: AuditSink | None, args: Any
) -> RunResult | int:
    from egressbox.errors import PolicyError

    try:
        return run_options_sync(
            options,
            audit=audit,
            log=None if args.quiet else _diagnostic,
            policy_loader=lambda: _cli_policy(args),
        )
    except PolicyError as exc:
        from egressbox.errors import print_policy_error
        from egressbox.exitcodes import EXIT_USAGE

        print_policy_error(exc, sys.stderr)
        return EXIT_USAGE
    except RunRefusedError as exc:
        for message in exc.messages:
            write_err(message)
        return EXIT_CANNOT_CONFINE
    except CommandNotFoundError as exc:
        write_err(str(exc))
        return EXIT_NOT_FOUND
    except EgressboxError as exc:
        write_err(str(exc))
        return EXIT_CANNOT_CONFINE
