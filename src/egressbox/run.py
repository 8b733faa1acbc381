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
from egressbox.confine.launcher import EXIT_CANNOT_CONFINE, EXIT_NOT_FOUND, LaunchPlan
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
    is_under,
    plan_filesystem,
    strictest,
    wanted,
)
from egressbox.errors import EgressboxError
from egressbox.stderr_tee import DRAIN_TIMEOUT, FINAL_READS, StderrTee

if TYPE_CHECKING:
    from egressbox.audit import AuditRecord, AuditSink
    from egressbox.confine.refusal import HostPath, PathPlan, RefusalRecord
    from egressbox.policy import Policy, RunSettings

# Directories hidden behind a private tmpfs in the child's mount namespace.
HIDDEN_DIRS = ("/tmp", "/var/tmp", "/run", "/dev/shm")
# How long the launcher may take to bind its listeners (measured: 34-50 ms).
LAUNCHER_TIMEOUT = 10.0
SCRATCH_DIR = ".egressbox"
ENV_SANDBOX = "EGRESSBOX_SANDBOX"
ENV_PROFILE = "EGRESSBOX_PROFILE"
# --timeout: the run's exit code when it expires (as coreutils timeout), and
# how long the command has after SIGTERM before it is killed.
EXIT_TIMEOUT = 124
KILL_GRACE = 5.0


def __getattr__(name: str) -> Any:
    # RefusalRecord lives in confine/refusal.py, imported only when a run fails.
    if name == "RefusalRecord":
        from egressbox.confine.refusal import RefusalRecord

        return RefusalRecord
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class RunRefusedError(EgressboxError):
    """Confinement the profile requires is unavailable (exit 126)."""

    def __init__(self, refusals: Sequence[Refusal]) -> None:
        self.refusals = list(refusals)
        super().__init__("; ".join(r.message() for r in self.refusals))


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
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "egressbox")


def _compiled_seccomp() -> bytes:
    """The seccomp filter as a cached BPF program (empty: the launcher builds it)."""
    import json

    # Read the cache without importing the seccomp module (~7 ms with hashlib).
    name = f"seccomp-v1-{os.uname().machine}-{os.uname().release}.json"
    path = os.path.join(_cache_dir(), name)
    try:
        with open(path, encoding="ascii") as f:
            data = json.load(f)
        if data.get("status") == "full":
            return bytes.fromhex(data["program"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    from egressbox.confine.seccomp import Status, cached_filter

    compiled = cached_filter(_cache_dir(), path=path)
    return compiled.program if compiled.status is Status.FULL else b""


def _facts_path() -> str | None:
    # Keyed by boot, kernel and euid: any of them changes what is available.
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        return None
    name = f"probe-{boot}-{os.uname().release}-{os.geteuid()}.json"
    return os.path.join(_cache_dir(), name)


def _load_facts() -> HostFacts | None:
    import json

    path = _facts_path()
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return HostFacts(
            frozenset(data["available"]), dict(data["status"]), int(data["abi"]), os.geteuid()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store_facts(facts: HostFacts) -> None:
    import json

    path = _facts_path()
    if path is None:
        return
    data: dict[str, object] = {
        "available": sorted(facts.available),
        "status": dict(facts.status),
        "abi": facts.landlock_abi,
    }
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)


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
    home = base.get("HOME", os.path.expanduser("~"))
    cwd = os.path.realpath(options.cwd or os.getcwd())
    write_roots = tuple(os.path.realpath(expand_user(p, home)) for p in options.write_roots)
    write_roots = write_roots or (cwd,)
    read_roots = tuple(os.path.realpath(expand_user(p, home)) for p in options.read_roots)
    process_read = tuple(os.path.realpath(expand_user(p, home)) for p in options.process_read_roots)
    process_write = tuple(
        os.path.realpath(expand_user(p, home)) for p in options.process_write_roots
    )
    executable = resolve_command(options.argv[0], base, cwd)
    scratch = make_scratch(write_roots[0])
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
    fs = plan_filesystem(
        home=home,
        write_roots=write_roots,
        read_roots=read_roots,
        executables=executable.grants,
        presets=options.presets,
        deny=_credential_paths(home, env.get("HOME")) + extra_deny,
        process_read_roots=process_read,
        process_write_roots=process_write,
    )
    if options.allow_loopback and Mechanism.NETWORK_NAMESPACE not in chosen:
        raise EgressboxError("--allow-loopback needs a network namespace, which is unavailable")
    listeners = [] if Mechanism.NETWORK_NAMESPACE in chosen else _host_listeners()
    bind_back = _bind_back(
        (*write_roots, *process_write), (*read_roots, *process_read, *executable.grants, cwd)
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
        read=fs.read,
        write=fs.write,
        deny=fs.deny,
        read_only_inside_write=fs.read_only_inside_write,
        bind_back=bind_back,
        allow_loopback=options.allow_loopback,
        pass_fds=options.pass_fds,
        rlimit_nofile=options.rlimit_nofile,
        rlimit_as=options.rlimit_as,
        best_effort=profile is not Profile.OS_HARDENED,
        env_ports=templates,
        parent_pid=os.getpid(),
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
            ("executable", executable.grants),
        )
        for path in dict.fromkeys(paths)
    ]
    return Prepared(plan, report, listeners, network, warnings, homes, roots)


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


def make_scratch(root: str) -> Scratch | None:
    """Self-ignoring temp and cache directories inside the first writable root."""
    base = os.path.join(root, SCRATCH_DIR)
    try:
        os.makedirs(os.path.join(base, "tmp"), exist_ok=True)
        os.makedirs(os.path.join(base, "cache"), exist_ok=True)
        ignore = os.path.join(base, ".gitignore")
        if not os.path.exists(ignore):
            with open(ignore, "w", encoding="ascii") as f:
                f.write("# egressbox scratch space (temp files and caches)\n*\n")
    except OSError:
        return None
    return Scratch(os.path.join(base, "tmp"), os.path.join(base, "cache"))


def _bind_back(
    write_roots: Sequence[str], read_paths: Sequence[str]
) -> tuple[tuple[str, bool], ...]:
    """Granted paths that live under a directory the mount namespace hides."""
    found: dict[str, bool] = {}
    for path, writable in [(p, True) for p in write_roots] + [(p, False) for p in read_paths]:
        if any(is_under(path, hidden) for hidden in HIDDEN_DIRS) and os.path.exists(path):
            found[path] = found.get(path, False) or writable
    return tuple(found.items())


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


# -- spawning ---------------------------------------------------------------------------


@dataclass
class Launched:
    pid: int
    listeners: list[socket.socket]
    stdout_fd: int | None = None
    stderr_fd: int | None = None
    chan: socket.socket | None = None  # to the launcher, until go() or abandon()
    tee: StderrTee | None = None  # the command's stderr, through us (None: captured)
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
    pipes = (os.pipe(), os.pipe()) if capture_output else None
    # Not captured: the command's stderr still passes through us (refusal records).
    tee = None if capture_output else StderrTee.open()
    try:
        pid = os.fork()
    except BaseException:
        if tee is not None:
            tee.abandon()
        raise
    if pid == 0:  # the launcher
        parent_chan.close()
        if pipes is not None:
            os.dup2(pipes[0][1], 1)
            os.dup2(pipes[1][1], 2)
        if tee is not None:
            os.dup2(tee.child_fd, 2)
            tee.close_in_child()
        launcher_main(prepared.plan, child_chan.detach())
    child_chan.close()
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
        _kill_and_reap(pid)
        if tee is not None:
            tee.finish()
        raise
    parent_chan.settimeout(None)
    return Launched(pid, listeners, out_fd, err_fd, parent_chan, tee=tee)


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
    """Serve the child's listeners until the launcher exits; return the result."""
    import asyncio

    from egressbox.resolve import DnsResolver
    from egressbox.server import EgressProxy

    http, socks = launched.listeners[0], launched.listeners[1]
    for sock in launched.listeners:
        sock.setblocking(False)
    resolver = DnsResolver(list(options.nameservers)) if options.nameservers else None
    proxy = EgressProxy(
        options.policy,
        http_sockets=[http],
        socks_sockets=[socks],
        resolver=resolver,
        audit=audit,
        keep_records=True,
        log=log,
    )
    await proxy.start()
    loop = asyncio.get_running_loop()
    readers = [_Collector(loop, fd) for fd in (launched.stdout_fd, launched.stderr_fd)]
    try:
        code = await _wait_forwarding(loop, launched)
        outputs = await asyncio.gather(*(r.finish(DRAIN_TIMEOUT) for r in readers))
        tail = launched.stderr_tail()
    finally:
        for reader in readers:
            reader.close()
        await proxy.close(0)
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
        if self.fd is not None:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = None
        if not self.done.done():
            self.done.set_result(None)


async def _wait_forwarding(loop: Any, launched: Launched) -> int:
    """Wait for the launcher (pidfd), passing SIGINT/SIGTERM/SIGHUP on to it."""
    import asyncio

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
        for handle in timer:
            handle.cancel()
        loop.remove_reader(pidfd)
        os.close(pidfd)
        for signum in installed:
            loop.remove_signal_handler(signum)
    _, status = os.waitpid(pid, 0)
    del asyncio
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


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
        from egressbox.confine.mounts import KERNEL_READ_ONLY

        kernel = KERNEL_READ_ONLY
    return PathPlan(
        homes=prepared.homes,
        read=plan.read,
        write=plan.write,
        # Masks and nested read-only roots are mounts, or (without a mount
        # namespace) Landlock grants that leave them out.
        deny=plan.deny if mounts or landlock else (),
        read_only=plan.read_only_inside_write if mounts or landlock else (),
        always_read_only=kernel,
        hidden=HIDDEN_DIRS if mounts else (),
        bound_back=plan.bind_back if mounts else (),
        landlock_fs=landlock,
        abstract_isolated=plan.has(Mechanism.NETWORK_NAMESPACE)
        or plan.has(Mechanism.LANDLOCK_SCOPE),
    )


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
    if code != 0:
        result.refusal = classify_refusal(records, code, stderr, path_plan(prepared))
    return result


def _start(
    options: RunOptions, facts: HostFacts | None, capture_output: bool
) -> tuple[Prepared, Launched]:
    prepared = prepare(options, facts or host_facts())
    _warn(prepared)
    launched = spawn(prepared, capture_output=capture_output)
    launched.go()
    launched.start_timer(options.timeout)
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
    """A Popen-like handle on a confined command that is running now."""

    def __init__(self, launched: Launched, task: Any) -> None:
        self._launched = launched
        self._task = task

    @property
    def pid(self) -> int:
        """The launcher's pid: signals sent here reach the command."""
        return self._launched.pid

    def send_signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._launched.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def wait(self) -> RunResult:
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
    """Start `cmd` confined and return at once with a handle (stream by polling wait())."""
    import asyncio

    options = options_for(cmd, policy=policy, **kwargs)
    prepared, launched = _start(options, None, capture_output)
    task = asyncio.get_running_loop().create_task(
        supervise(launched, options, prepared, audit=audit)
    )
    return ConfinedProcess(launched, task)


def exit_code_for(error: BaseException) -> int:
    if isinstance(error, CommandNotFoundError):
        return EXIT_NOT_FOUND
    return EXIT_CANNOT_CONFINE


def write_err(line: str) -> None:
    sys.stderr.write(f"egressbox: {line}\n")
    sys.stderr.flush()


def run_command(args: Any, argv: list[str]) -> int:
    """`egressbox run`: the CLI front of run_sync (no asyncio imported before the fork)."""
    from egressbox.cli import EXIT_USAGE
    from egressbox.errors import AuditError

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
    if result.refusal is not None:
        write_err(result.refusal.line(result.exit_code))
    return result.exit_code


def _cli_policy(args: Any) -> Policy | None:
    """The command line's policy (loaded while the launcher starts)."""
    from egressbox.cli import load_cli_policy

    policy = load_cli_policy(args.policy)
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
        from egressbox.cli import EXIT_USAGE, print_policy_error

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
            grants=grants,
            timeout=args.timeout,
        )
    except ValueError as exc:
        write_err(str(exc))
        return None
    return RunOptions(
        argv=tuple(argv),
        policy=None,
        allow_loopback=args.allow_loopback,
        pass_fds=tuple(args.pass_fd),
        nameservers=servers,
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
        from egressbox.cli import EXIT_USAGE, print_policy_error

        print_policy_error(exc, sys.stderr)
        return EXIT_USAGE
    except RunRefusedError as exc:
        for refusal in exc.refusals:
            write_err(refusal.message())
        return EXIT_CANNOT_CONFINE
    except CommandNotFoundError as exc:
        write_err(str(exc))
        return EXIT_NOT_FOUND
    except EgressboxError as exc:
        write_err(str(exc))
        return EXIT_CANNOT_CONFINE
