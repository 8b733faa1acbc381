"""The launcher: applies a LaunchPlan in a forked, single-threaded process and execs.

Process tree (with a PID namespace):

    egressbox run (unconfined proxy)
      └─ launcher            unshares user/net/mount/pid, binds the proxy's
         │                   listeners inside the new netns, sends them up
         └─ reaper (pid 1)   mounts, then forks the command, forwards
            │                signals, reaps, exits with the command's status
            └─ command       caps dropped, Landlock, fds closed, seccomp, exec

When the reaper (pid 1) exits the kernel kills the whole namespace, so no
double-forked daemon outlives the run. Imports are stdlib and our own
small confine modules only: no asyncio, no dnspython.

Exit codes: the command's code, 128+N when it died from signal N, 126 when
confinement could not be applied (the command never ran), 127 when the
command was not found.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

from egressbox.confine import netns
from egressbox.confine.plan import Mechanism

EXIT_CANNOT_CONFINE = 126
EXIT_NOT_FOUND = 127
# Signals the launcher and the reaper pass on to the command.
FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGWINCH,
)
RLIMIT_CORE_OFF = 0  # no core dumps: they could hold secrets read by the child


class LaunchError(Exception):
    """Confinement could not be applied; the command must not run."""


@dataclass(frozen=True)
class LaunchPlan:
    argv: tuple[str, ...]
    executable: str
    cwd: str
    env: dict[str, str]
    mechanisms: tuple[str, ...]  # Mechanism values to apply
    uid: int
    gid: int
    # Without a network namespace the parent binds the listeners on the
    # host's loopback and the ports are known up front.
    host_ports: tuple[int, ...] = ()
    proxy_host: str = "127.0.0.1"
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    read_only_inside_write: tuple[str, ...] = ()
    bind_back: tuple[tuple[str, bool], ...] = ()
    allow_loopback: bool = False
    pass_fds: tuple[int, ...] = ()
    rlimit_nofile: int | None = None
    rlimit_as: int | None = None
    best_effort: bool = True
    env_ports: dict[str, str] = field(default_factory=dict)  # NAME -> template with {http}/{socks}
    # A seccomp filter compiled (and cached) by the parent: loaded with one
    # prctl, so the launcher never imports pyseccomp. Empty: build it here.
    seccomp_program: bytes = b""
    parent_pid: int = 0  # the proxy's pid: the launcher dies with it

    def has(self, mechanism: Mechanism) -> bool:
        return mechanism.value in self.mechanisms

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def launcher_main(plan: LaunchPlan, chan_fd: int) -> NoReturn:
    """Entry point in the forked launcher; never returns."""
    chan = socket.socket(fileno=chan_fd)
    try:
        code = _launch(plan, chan)
    except LaunchError as exc:
        _refuse(chan, str(exc))
        code = EXIT_CANNOT_CONFINE
    except BaseException as exc:  # anything unexpected: never run unconfined
        _refuse(chan, f"launcher failed: {exc!r}")
        code = EXIT_CANNOT_CONFINE
    os._exit(code)


@dataclass
class _Progress:
    listening_sent: bool = False


# One launcher per process: where it got to decides how a failure is reported.
_PROGRESS = _Progress()


def _refuse(chan: socket.socket, message: str) -> None:
    # Before the listeners are handed over the parent is reading the channel
    # and reports the refusal; afterwards it only waits for our exit status.
    if _PROGRESS.listening_sent:
        with contextlib.suppress(OSError):
            os.write(2, f"egressbox: cannot confine the command: {message}\n".encode())
    else:
        _tell(chan, {"event": "refused", "message": message})


def _preload(plan: LaunchPlan) -> None:
    """Import every module the later steps need while the filesystem is intact.

    After the mount namespace hides /tmp (and Landlock narrows reads) our own
    package may be out of sight, say in a checkout under /tmp.
    """
    import resource

    from egressbox.confine import caps, landlock, landlock_apply, mounts, syscalls

    del caps, landlock, landlock_apply, mounts, syscalls, resource
    if plan.has(Mechanism.SECCOMP) and not plan.seccomp_program:
        from egressbox.confine import seccomp

        del seccomp
    del plan


def _tell(chan: socket.socket, message: dict[str, object], fds: tuple[int, ...] = ()) -> None:
    with contextlib.suppress(OSError):
        netns.send_message(chan, message, fds)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (an `egressbox run` killed with
    SIGKILL must not leave a sandbox running); checked again after the call,
    since the parent may already be gone."""
    from egressbox.confine import syscalls

    syscalls.prctl(syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(EXIT_CANNOT_CONFINE)


def _launch(plan: LaunchPlan, chan: socket.socket) -> int:
    _die_with_parent(plan.parent_pid)
    _preload(plan)
    prepared = _prepare_seccomp(plan)
    _unshare(plan)
    ports = _listeners(plan, chan)
    _PROGRESS.listening_sent = True
    _await_go(chan)
    env = _fill_ports(plan, ports)
    if plan.has(Mechanism.PID_NAMESPACE):
        launcher = os.getpid()
        pid = os.fork()
        if pid == 0:
            # The reaper is pid 1 of the new namespace: when it dies, the
            # kernel kills everything in it; it dies with the launcher.
            _die_with_parent_pid_ns(launcher)
            os._exit(_reaper(plan, env, ports, prepared, chan))
        chan.close()
        return _supervise(pid, reap_all=False)
    return _reaper(plan, env, ports, prepared, chan)


def _die_with_parent_pid_ns(launcher: int) -> None:
    # Inside the new PID namespace getppid() is 0 (the parent is outside it),
    # so only the death signal is set; the launcher is alive at this point.
    from egressbox.confine import syscalls

    del launcher
    syscalls.prctl(syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)


def _prepare_seccomp(plan: LaunchPlan) -> Any:
    # pyseccomp's import may run ldconfig and needs a temp dir: build the
    # filter now, before any namespace or Landlock rule hides the filesystem.
    if not plan.has(Mechanism.SECCOMP) or plan.seccomp_program:
        return None
    from egressbox.confine import seccomp

    return seccomp.prepare(seccomp.SeccompOptions())


def _unshare(plan: LaunchPlan) -> None:
    from egressbox.confine import syscalls

    flags = 0
    if plan.has(Mechanism.NETWORK_NAMESPACE):
        flags |= syscalls.CLONE_NEWNET
    if plan.has(Mechanism.MOUNT_NAMESPACE):
        flags |= syscalls.CLONE_NEWNS
    if plan.has(Mechanism.PID_NAMESPACE):
        flags |= syscalls.CLONE_NEWPID
    if not flags:
        return
    if plan.uid != 0:
        flags |= syscalls.CLONE_NEWUSER
    try:
        syscalls.unshare(flags)
    except OSError as exc:
        raise LaunchError(f"cannot create namespaces: {exc.strerror}") from None
    if plan.uid != 0:
        netns.write_id_maps(plan.uid, plan.gid)


def _listeners(plan: LaunchPlan, chan: socket.socket) -> tuple[int, ...]:
    if not plan.has(Mechanism.NETWORK_NAMESPACE):
        _tell(chan, {"event": "listening", "ports": list(plan.host_ports)})
        return plan.host_ports
    netns.loopback_up()
    socks = [netns.bind_listener(plan.proxy_host, 0) for _ in range(2)]
    ports = tuple(s.getsockname()[1] for s in socks)
    netns.send_message(
        chan, {"event": "listening", "ports": list(ports)}, [s.fileno() for s in socks]
    )
    for sock in socks:
        # Our copies would keep the namespace's listeners alive after the parent closes its own.
        sock.close()
    return ports


def _await_go(chan: socket.socket) -> None:
    """Start the command only on the parent's word: it loads the policy while
    we set up, and gives up (closing the channel) if the policy is bad."""
    try:
        word = chan.recv(16)
    except OSError:
        word = b""
    if word != b"go":
        os._exit(EXIT_CANNOT_CONFINE)  # nothing ran; the parent says why


def _fill_ports(plan: LaunchPlan, ports: tuple[int, ...]) -> dict[str, str]:
    env = dict(plan.env)
    http, socks = (*ports, 0, 0)[:2]
    for name, template in plan.env_ports.items():
        env[name] = template.format(http=http, socks=socks)
    return env


# -- pid 1 of the namespace -----------------------------------------------------------


def _reaper(
    plan: LaunchPlan,
    env: dict[str, str],
    ports: tuple[int, ...],
    prepared: Any,
    chan: socket.socket,
) -> int:
    if plan.has(Mechanism.MOUNT_NAMESPACE):
        _mounts(plan)
    chan.close()
    pid = os.fork()
    if pid == 0:
        _command(plan, env, ports, prepared)
    return _supervise(pid, reap_all=plan.has(Mechanism.PID_NAMESPACE))


def _mounts(plan: LaunchPlan) -> None:
    from egressbox.confine import mounts

    spec = mounts.MountSpec(
        bind_back=plan.bind_back,
        read_only=plan.read_only_inside_write,
        mask=plan.deny,
        protect_kernel=plan.uid == 0,
        minimal_dev=plan.uid == 0,
        new_proc=plan.has(Mechanism.PID_NAMESPACE),
    )
    try:
        mounts.apply_mounts(spec)
    except OSError as exc:
        raise LaunchError(f"cannot set up the mount namespace: {exc}") from None


def _supervise(child: int, *, reap_all: bool) -> int:
    """Forward signals to `child`, reap, and return its exit code (128+N on signal N)."""

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    while True:
        try:
            pid, status = os.waitpid(-1 if reap_all else child, 0)
        except ChildProcessError:
            return EXIT_CANNOT_CONFINE
        except InterruptedError:
            continue
        if pid == child:
            return _exit_code(status)


def _exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


# -- the command ----------------------------------------------------------------------


def _command(
    plan: LaunchPlan, env: dict[str, str], ports: tuple[int, ...], prepared: Any
) -> NoReturn:
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_DFL)
    try:
        _restrict(plan, ports, prepared)
        os.chdir(plan.cwd)
    except BaseException as exc:  # never exec (or fall back into the reaper) half-confined
        _fail(f"cannot confine the command: {exc}", EXIT_CANNOT_CONFINE)
    try:
        os.execve(plan.executable, list(plan.argv), env)
    except OSError as exc:
        code = EXIT_NOT_FOUND if exc.errno == 2 else EXIT_CANNOT_CONFINE
        _fail(f"{plan.argv[0]}: {exc.strerror}", code)


def _restrict(plan: LaunchPlan, ports: tuple[int, ...], prepared: Any) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (RLIMIT_CORE_OFF, RLIMIT_CORE_OFF))
    if plan.rlimit_nofile is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (plan.rlimit_nofile, plan.rlimit_nofile))
    if plan.rlimit_as is not None:
        resource.setrlimit(resource.RLIMIT_AS, (plan.rlimit_as, plan.rlimit_as))
    if plan.has(Mechanism.CAPABILITIES) and os.geteuid() == 0 and not _powerless():
        from egressbox.confine import caps

        caps.drop_all_capabilities()
    _landlock(plan, ports)
    _close_fds(plan.pass_fds)
    if plan.seccomp_program and plan.has(Mechanism.SECCOMP):
        from egressbox.confine.syscalls import load_seccomp_program

        load_seccomp_program(plan.seccomp_program)  # raises: never exec without it
        return
    if prepared is None:
        _no_new_privs()
        return
    report = prepared.load()
    if report.status != "full" and not plan.best_effort:
        # os_hardened fails closed: never exec with a weaker filter than planned.
        raise LaunchError(f"seccomp filter not fully applied: {report.reason}")
    if report.status == "none":
        _no_new_privs()


def _powerless() -> bool:
    """uid 0 that already holds no capability and has its securebits locked (a nested run).

    Nothing is left to drop, and locking the securebits again would need CAP_SETPCAP.
    """
    from egressbox.confine import caps, syscalls

    try:
        sets = caps.read_capability_sets()
        bits = syscalls.prctl(syscalls.PR_GET_SECUREBITS)
    except (OSError, ValueError):
        return False
    return sets.all_clear and bits & caps.LOCKED_SECUREBITS == caps.LOCKED_SECUREBITS


def _landlock(plan: LaunchPlan, ports: tuple[int, ...]) -> None:
    from egressbox.confine import landlock_apply

    read, write = plan.read, plan.write
    if not plan.has(Mechanism.MOUNT_NAMESPACE):
        read, write = _without_mounts(plan)
    landlock_apply.apply(
        read=read if plan.has(Mechanism.LANDLOCK_FS) else None,
        write=write,
        connect_ports=ports if plan.has(Mechanism.LANDLOCK_NET) else None,
        allow_loopback=plan.allow_loopback,
        scopes=plan.has(Mechanism.LANDLOCK_SCOPE),
    )


def _without_mounts(plan: LaunchPlan) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Landlock roots that keep the credential deny list and the read-only roots
    nested in writable ones without a mount namespace to mask or remount them.

    Landlock is allow-only: a root that holds a denied path is replaced by its
    siblings along the way (expand_excluding), and a writable root that holds a
    read-only one is split the same way, the read-only part granted for reading.
    Entries created later directly in a split directory are not granted.
    """
    from egressbox.confine.plan import expand_excluding

    deny = plan.deny
    read = [p for root in plan.read for p in expand_excluding(root, deny)]
    read_only = plan.read_only_inside_write
    write = [p for root in plan.write for p in expand_excluding(root, (*deny, *read_only))]
    read += [p for root in read_only for p in expand_excluding(root, deny)]
    return tuple(dict.fromkeys(read)), tuple(dict.fromkeys(write))


def _close_fds(keep: tuple[int, ...]) -> None:
    low = 3
    for fd in sorted(set(keep)):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, _max_fd())


def _max_fd() -> int:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _no_new_privs() -> None:
    from egressbox.confine import landlock

    landlock.set_no_new_privs()


def _fail(message: str, code: int) -> NoReturn:
    with contextlib.suppress(OSError):
        os.write(2, f"egressbox: {message}\n".encode())
    sys.stderr.flush()
    os._exit(code)
