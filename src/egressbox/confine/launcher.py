"""The launcher: applies a LaunchPlan in a forked, single-threaded process and execs.

Process tree (with a PID namespace):

    egressbox run (unconfined proxy)
      └─ launcher            unshares user/net/mount/pid, binds the proxy's
         │                   listeners inside the new netns, sends them up
         └─ reaper (pid 1)   mounts, then forks the command, forwards
            │                signals, reaps, exits with the command's status
            └─ command       caps dropped, Landlock, fds closed, seccomp, then
                             exec on the parent's word ("go": its policy loaded)

All of it but the exec happens while the parent loads its policy. When the
reaper (pid 1) exits the kernel kills the whole namespace, so no
double-forked daemon outlives the run. Imports are stdlib and our own
small confine modules only: no asyncio, no dnspython.

Exit codes: the command's code, 128+N when it died from signal N, 126 when
confinement could not be applied (the command never ran), 127 when the
command was not found.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import socket
import sys
from typing import Any, NoReturn

from egressbox.confine import cgroup, netns, staging
from egressbox.confine.grants import (
    CAPTURE_FILES,
    Mechanism,
    WorldSpec,
    expand_excluding,
    is_under,
    tmpfs_total,
)
from egressbox.confine.spec import LaunchPlan
from egressbox.core.exitcodes import (
    CAUSE_CODES,
    EXIT_CANNOT_CONFINE,
    EXIT_CANNOT_EXECUTE,
    EXIT_NOT_FOUND,
)

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
    """Confinement could not be applied; the command must not run. `cause` is the parent's
    exit code's (core/exitcodes.py CAUSE_CODES)."""

    def __init__(self, message: str, cause: str = "confinement_unavailable") -> None:
        super().__init__(message)
        self.cause = cause


def launcher_main(plan: LaunchPlan, chan_fd: int) -> NoReturn:
    """Entry point in the forked launcher; never returns."""
    chan = socket.socket(fileno=chan_fd)
    try:
        code = _launch(plan, chan)
    except LaunchError as exc:
        _refuse(chan, str(exc), exc.cause)
        code = CAUSE_CODES.get(exc.cause, EXIT_CANNOT_CONFINE)
    except BaseException as exc:  # anything unexpected: never run unconfined
        _refuse(chan, f"launcher failed: {exc!r}")
        code = EXIT_CANNOT_CONFINE
    os._exit(code)


# Mutable state of one run, compared by identity. A plain class, not a dataclass: the
# decorator compiles its __init__ at import, and `egressbox run` imports this module before
# its fork (it would import dataclasses for it too).
class _Progress:
    """How far the launcher got, and what it applied."""

    def __init__(self) -> None:
        self.listening_sent = False
        # What was really applied, reported to the parent just before exec.
        self.applied: dict[str, Any] = {}
        self.etc_hidden: list[str] | None = None
        # Why libnftables could not be loaded (capture is then not applied).
        self.capture_unloadable = ""

    @property
    def captured(self) -> bool:
        return bool(self.applied.get("capture", {}).get("status") == "full")


# One launcher per process: where it got to decides how a failure is reported.
_PROGRESS = _Progress()


def _refuse(chan: socket.socket, message: str, cause: str = "confinement_unavailable") -> None:
    # Before the listeners are handed over the parent is reading the channel
    # and reports the refusal; afterwards it only waits for our exit status.
    if _PROGRESS.listening_sent:
        with contextlib.suppress(OSError):
            os.write(2, f"egressbox: cannot confine the command: {message}\n".encode())
    else:
        _tell(chan, {"event": "refused", "message": message, "cause": cause})


def _preload(plan: LaunchPlan) -> None:
    """Import every module the later steps need while the filesystem is intact.

    After the mount namespace hides /tmp (and Landlock narrows reads) our own
    package may be out of sight, say in a checkout under /tmp.
    """
    import resource

    from egressbox.confine import caps, landlock, landlock_apply, syscalls, world

    del caps, landlock, landlock_apply, syscalls, world, resource
    if plan.has(Mechanism.SECCOMP) and not plan.seccomp_program:
        from egressbox.confine import seccomp

        del seccomp
    if plan.connect_filter:
        from egressbox.confine import notify

        del notify
    if plan.capture:
        from egressbox.confine import capture

        try:
            capture.load_library()
        except capture.CaptureError as exc:
            _PROGRESS.capture_unloadable = str(exc)


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
    group = _enter_cgroup(plan)
    try:
        return _launch_in(plan, chan)
    finally:
        # Only the launcher gets here: the reaper and the command end in os._exit or exec.
        if group:
            _leave_cgroup(group, plan)


def _enter_cgroup(plan: LaunchPlan) -> str:
    """Into the run's cgroup before anything is forked; "" when there is none (and why)."""
    spec = plan.world
    tmpfs = 0
    if spec is not None and spec.tmp_size.isdigit() and spec.shm_size.isdigit():
        tmpfs = tmpfs_total(int(spec.tmp_size), int(spec.shm_size))
    memory: dict[str, Any] = {"budget": plan.rlimit_data, "rlimit_data": plan.rlimit_data}
    memory["tmpfs"] = tmpfs if plan.has(Mechanism.MOUNT_NAMESPACE) else 0
    _PROGRESS.applied["memory"] = memory
    if plan.cgroup is None:
        memory["why"] = plan.cgroup_off
        return ""
    try:
        path = cgroup.enter(plan.cgroup)
    except OSError as exc:
        memory["why"] = f"making {plan.cgroup.path} failed: {exc.strerror or exc}"
        return ""
    memory.update(cgroup=path, budget=plan.cgroup.memory_max, pids=plan.cgroup.pids_max)
    return path


def _leave_cgroup(path: str, plan: LaunchPlan) -> None:
    outcome = cgroup.leave(path)
    if outcome.oom_kills and plan.cgroup is not None:
        budget = plan.cgroup.memory_max
        with contextlib.suppress(OSError):
            os.write(
                2,
                f"egressbox: the run reached its memory budget ({budget} bytes, memory.max of "
                f"its cgroup): the kernel killed {outcome.oom_kills} of its processes "
                "([process] max_memory sets the budget)\n".encode(),
            )


def _launch_in(plan: LaunchPlan, chan: socket.socket) -> int:
    _preload(plan)
    prepared = _prepare_seccomp(plan)
    _unshare(plan)
    ports = _listeners(plan, chan)
    _PROGRESS.listening_sent = True
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
        _close_report(plan)
        return _supervise(pid, reap_all=False)
    return _reaper(plan, env, ports, prepared, chan)


def walk_etc_early() -> None:
    """Walk /etc now, before a plan exists (runner/zygote.py, while it waits for one); the
    launcher uses the result if its plan grants /etc."""
    from egressbox.confine import world

    _PROGRESS.etc_hidden = world.unreadable_to_others("/etc")


def _walk_etc(plan: LaunchPlan) -> None:
    if plan.world is None or not plan.has(Mechanism.MOUNT_NAMESPACE):
        return
    from egressbox.confine import world

    if any(is_under("/etc", os.path.realpath(p)) for p, _ in plan.world.grants):
        if _PROGRESS.etc_hidden is None:  # not walked while the plan was awaited
            _PROGRESS.etc_hidden = world.unreadable_to_others("/etc")
    else:
        _PROGRESS.etc_hidden = []


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

    # A captured child may make UDP sockets: every datagram ends at our DNS socket or nowhere.
    return seccomp.prepare(seccomp.SeccompOptions(allow_udp=plan.capture))


# --user NAME needs NAME's uid in the namespaces; a user namespace made by a root without
# CAP_SYS_ADMIN maps only uid 0 (more needs the parent to write the map).
_RUN_AS_NEEDS_SYS_ADMIN = (
    "--user needs CAP_SYS_ADMIN to make the run's namespaces as root, which this process "
    "lacks (a container's default capabilities): run egressbox as the user itself (it makes a "
    "user namespace of its own), or give the container CAP_SYS_ADMIN"
)


def _unshare(plan: LaunchPlan) -> None:
    from egressbox.confine import caps, syscalls

    flags = 0
    names = []
    for mechanism, flag, name in (
        (Mechanism.NETWORK_NAMESPACE, syscalls.CLONE_NEWNET, "net"),
        # SysV IPC objects and the host name of host processes go with the mount namespace:
        # the child's world is constructed, not shared.
        (Mechanism.MOUNT_NAMESPACE, syscalls.CLONE_NEWNS, "mnt"),
        (Mechanism.MOUNT_NAMESPACE, syscalls.CLONE_NEWIPC, "ipc"),
        (Mechanism.MOUNT_NAMESPACE, syscalls.CLONE_NEWUTS, "uts"),
        (Mechanism.PID_NAMESPACE, syscalls.CLONE_NEWPID, "pid"),
    ):
        if plan.has(mechanism):
            flags |= flag
            names.append(name)
    if not flags:
        _PROGRESS.applied["namespaces"] = []
        return
    # Without CAP_SYS_ADMIN (an unprivileged user, or a container's root with Docker's default
    # capabilities) only a new user namespace gives the right to make the others.
    user = not caps.holds_sys_admin()
    ids = (os.geteuid(), os.getegid())  # unmapped (the overflow id) until the maps are written
    if user:
        if plan.run_as is not None:
            raise LaunchError(_RUN_AS_NEEDS_SYS_ADMIN)
        flags |= syscalls.CLONE_NEWUSER
        names.append("user")
    try:
        syscalls.unshare(flags)
    except OSError as exc:
        raise LaunchError(f"cannot create namespaces: {exc.strerror}") from None
    if user:
        netns.write_id_maps(*ids)
    _PROGRESS.applied["namespaces"] = names


def _listeners(plan: LaunchPlan, chan: socket.socket) -> tuple[int, ...]:
    """Bind the proxy's listeners (and, with capture, the capture and DNS sockets) inside the
    namespace and send them up; returns the proxy's (http, socks) ports.

    The message: {"event": "listening", "ports": [...], "roles": [...]} with one fd per role,
    in this order: http, socks, then with capture: capture, dns_udp, dns_tcp.
    """
    if not plan.has(Mechanism.NETWORK_NAMESPACE):
        _tell(chan, {"event": "listening", "ports": list(plan.host_ports)})
        return plan.host_ports
    netns.loopback_up()
    try:
        socks = [netns.bind_listener(plan.proxy_host, 0) for _ in range(2)]
    except OSError as exc:
        raise LaunchError(
            f"cannot bind the proxy's listeners on {plan.proxy_host} inside the command's "
            f"network namespace: {exc.strerror or exc}",
            "proxy_bind",
        ) from None
    ports = tuple(s.getsockname()[1] for s in socks)
    roles = ["http", "socks"]
    if plan.capture:
        made = _capture(plan, ports)
        if made:
            socks += made
            roles += ["capture", "dns_udp", "dns_tcp"]
    message: dict[str, object] = {
        "event": "listening",
        "ports": [s.getsockname()[1] for s in socks],
        "roles": roles,
    }
    netns.send_message(chan, message, [s.fileno() for s in socks])
    for sock in socks:
        # Our copies would keep the namespace's listeners alive after the parent closes its own.
        sock.close()
    return ports


def _capture(plan: LaunchPlan, proxy_ports: tuple[int, ...]) -> list[socket.socket]:
    """Capture sockets, local routes and the nat rules, while we hold CAP_NET_ADMIN and
    CAP_NET_BIND_SERVICE in the namespace; on any failure nothing of it is kept, the command
    runs without capture, and the report says why."""
    from egressbox.confine import capture

    if _PROGRESS.capture_unloadable:
        _PROGRESS.applied["capture"] = {"status": "none", "reason": _PROGRESS.capture_unloadable}
        return []
    if plan.proxy_host != capture.CAPTURE_HOST:  # the rules leave the proxy alone there only
        reason = f"the proxy listens on {plan.proxy_host}, not {capture.CAPTURE_HOST}"
        _PROGRESS.applied["capture"] = {"status": "none", "reason": reason}
        return []
    try:
        made = capture.open_sockets(netns.LISTEN_BACKLOG)
    except OSError as exc:
        reason = f"binding the capture sockets: {exc.strerror or exc}"
        _PROGRESS.applied["capture"] = {"status": "none", "reason": reason}
        return []
    try:
        families = capture.add_local_routes()
        ipv6 = made.dual_stack and "ipv6" in families
        capture.install_redirect(
            proxy_ports, made.capture_port, ipv6=ipv6, allow_loopback=plan.allow_loopback
        )
    except (OSError, capture.CaptureError) as exc:
        made.close()
        _PROGRESS.applied["capture"] = {"status": "none", "reason": capture.describe(exc)}
        return []
    _PROGRESS.applied["capture"] = {
        "status": "full",
        "families": ["ipv4", "ipv6"] if ipv6 else ["ipv4"],
        "capture_port": made.capture_port,
        "dns": f"{capture.DNS_HOST}:{capture.DNS_PORT}",
    }
    return list(made.all())


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
    skeleton: dict[str, set[str]] = {}
    if plan.has(Mechanism.MOUNT_NAMESPACE):
        # The world is built, and the command forked and confined, while the parent loads its
        # policy: the command execs only on the parent's word (_command), and a run the
        # parent gives up on ends with its namespaces.
        _walk_etc(plan)
        _mounts(plan)
        skeleton = _private_tmp()
        if plan.run_as is not None and plan.world is not None:
            _give_scratch(plan.world.scratch, plan.run_as)
    pid = os.fork()
    if pid == 0:
        _command(plan, env, ports, prepared, chan)
    chan.close()
    _close_report(plan)
    code = _supervise(pid, reap_all=plan.has(Mechanism.PID_NAMESPACE))
    if plan.has(Mechanism.MOUNT_NAMESPACE):
        _note_private_tmp(skeleton)
    return code


# The child's private file systems (confine/world.py PRIVATE_TMPFS and the private /dev/shm):
# what is written there ends with the run.
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/run", "/dev/shm")
# Entries walked per private file system, before and after the command: a build that fills
# /tmp with more is named by what was seen, with "and more" (a walk of 10,000 tmpfs entries
# costs about 20 ms).
PRIVATE_WALK_MAX = 10_000
# Paths named in the note after the run; the count says the rest.
PRIVATE_NOTE_PATHS = 3


def _private_tmp() -> dict[str, set[str]]:
    """What the private file systems hold, at any depth, without descending into what is
    mounted on them (the grants bound below /tmp are the host's, and are kept)."""
    found: dict[str, set[str]] = {}
    for top in PRIVATE_DIRS:
        with contextlib.suppress(OSError):
            found[top] = _walk_private(top, os.lstat(top).st_dev)
    return found


def _walk_private(top: str, device: int) -> set[str]:
    seen: set[str] = set()
    pending = [top]
    while pending and len(seen) < PRIVATE_WALK_MAX:
        directory = pending.pop()
        with contextlib.suppress(OSError), os.scandir(directory) as entries:
            for entry in entries:
                if len(seen) >= PRIVATE_WALK_MAX:
                    break
                st = entry.stat(follow_symlinks=False)
                if st.st_dev != device:
                    continue  # a mount point: a grant bound from the host, or a kernel view
                seen.add(entry.path)
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
    return seen


def _note_private_tmp(skeleton: dict[str, set[str]]) -> None:
    """Name what the command wrote on its private file systems, whatever the depth: it ends
    with the run and never reaches the host, and a user who wrote there expected to find it."""
    made: list[str] = []
    tops: list[str] = []
    for top, names in _private_tmp().items():
        new = names - skeleton.get(top, set())
        # The topmost new entries: a new directory stands for what is inside it.
        topmost = sorted(p for p in new if os.path.dirname(p) not in new)
        made += topmost
        tops += [top] if topmost else []
    if not made:
        return
    shown = ", ".join(made[:PRIVATE_NOTE_PATHS])
    if len(made) > PRIVATE_NOTE_PATHS:
        shown += f" and {len(made) - PRIVATE_NOTE_PATHS} more"
    with contextlib.suppress(OSError):
        os.write(
            2,
            f"egressbox: note: the command left {shown} on its private {', '.join(tops)}: "
            "not kept (what is written there ends with the run and never reaches the host); "
            "$TMPDIR (the workspace's .egressbox/tmp) keeps files, or grant the directory "
            "with --write-root\n".encode(),
        )


def _close_report(plan: LaunchPlan) -> None:
    # Only the command's copy may stay open: the parent reads until the exec closes it.
    if plan.report_fd >= 0:
        with contextlib.suppress(OSError):
            os.close(plan.report_fd)


def _mounts(plan: LaunchPlan) -> None:
    from egressbox.confine import world

    if plan.world is None:
        raise LaunchError("a mount namespace without a world to build")
    spec = plan.world
    if not plan.has(Mechanism.PID_NAMESPACE) and spec.new_proc:
        spec = spec._replace(new_proc=False)
    if spec.files and plan.capture and not _PROGRESS.captured:
        # Capture failed: the view's /etc stays the host's, as without capture (the clean
        # copies of configuration files stay).
        spec = spec._replace(files=tuple(f for f in spec.files if f not in CAPTURE_FILES))
    try:
        report = world.apply_world(spec, _PROGRESS.etc_hidden, plan.staged)
    except OSError as exc:
        raise LaunchError(f"cannot build the child's filesystem: {exc}") from None
    _PROGRESS.applied["world"] = {"steps": list(report.steps), "skipped": report.skipped}
    _check_clean_copies(spec, report.skipped)


def _check_clean_copies(spec: WorldSpec, skipped: tuple[tuple[str, str], ...]) -> None:
    """A clean copy of a configuration file that could not be bound leaves the original in
    view, credentials and all: the command must not start (confine/clean.py)."""
    capture = {path for path, _ in CAPTURE_FILES}
    wanted = {f"file {path}" for path, _ in spec.files if path not in capture}
    for what, why in skipped:
        if what in wanted:
            raise LaunchError(
                f"the clean copy of {what[5:]} could not be bound over it ({why}), so the "
                "original would be in view: the command did not start"
            )


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
    plan: LaunchPlan,
    env: dict[str, str],
    ports: tuple[int, ...],
    prepared: Any,
    chan: socket.socket,
) -> NoReturn:
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_DFL)
    try:
        os.set_inheritable(chan.fileno(), False)  # the exec closes it
        if plan.controlling_tty:
            _own_terminal()
        _restrict(plan, ports, prepared, chan.fileno())
        os.chdir(plan.cwd)
        _report_applied(plan)
    except BaseException as exc:  # never exec (or fall back into the reaper) half-confined
        _fail(f"cannot confine the command: {exc}", EXIT_CANNOT_CONFINE)
    # Confined: only the exec is left, on the parent's word (its policy is loaded).
    _await_go(chan)
    try:
        os.execve(plan.executable, list(plan.argv), env)
    except OSError as exc:
        # Not found (127, as shells); found but not executable (exec format error, no
        # execute permission): a code of its own, never 126, which says confinement failed.
        code = EXIT_NOT_FOUND if exc.errno == errno.ENOENT else EXIT_CANNOT_EXECUTE
        _fail(f"{plan.argv[0]}: {exc.strerror}", code)


def _own_terminal() -> None:
    """A new session whose controlling terminal is the run's pty: /dev/tty is that pty, not
    the caller's terminal, and ^C typed there signals the command through its line discipline.
    (fcntl and termios are loaded already: the parent imported them to open the pty.)"""
    import termios

    os.setsid()
    tty = next((fd for fd in (0, 1, 2) if os.isatty(fd)), None)
    if tty is not None:
        with contextlib.suppress(OSError):  # no controlling terminal at all is safe too
            fcntl.ioctl(tty, termios.TIOCSCTTY, 0)


def _restrict(plan: LaunchPlan, ports: tuple[int, ...], prepared: Any, chan: int = -1) -> None:
    _limits(plan)
    applied = _PROGRESS.applied
    if plan.run_as is not None:
        applied["user"] = _become(plan.run_as)
    elif plan.has(Mechanism.CAPABILITIES) and os.geteuid() == 0 and not _powerless():
        from egressbox.confine import caps

        caps.drop_all_capabilities()
    applied["capabilities"] = plan.has(Mechanism.CAPABILITIES)
    applied["landlock"] = _landlock(plan, ports)
    keep = (*plan.pass_fds, plan.report_fd) if plan.report_fd >= 0 else plan.pass_fds
    _close_fds((*keep, chan) if chan >= 0 else keep)  # the channel until the exec
    if plan.connect_filter:
        applied["connect_supervisor"] = _connect_filter(plan, chan)
    applied["seccomp"] = _seccomp(plan, prepared)


def _limits(plan: LaunchPlan) -> None:
    import resource

    limits = {"core": RLIMIT_CORE_OFF}
    resource.setrlimit(resource.RLIMIT_CORE, (RLIMIT_CORE_OFF, RLIMIT_CORE_OFF))
    for name, which, value in (
        ("nofile", resource.RLIMIT_NOFILE, plan.rlimit_nofile),
        ("as", resource.RLIMIT_AS, plan.rlimit_as),
        ("data", resource.RLIMIT_DATA, plan.rlimit_data),
        # Not enforced for uid 0 by the kernel: the PID namespace's pid_max is the bound there.
        (
            "nproc",
            resource.RLIMIT_NPROC,
            plan.rlimit_nproc if os.geteuid() != 0 or plan.run_as else None,
        ),
    ):
        if value is not None:
            resource.setrlimit(which, (value, value))
            limits[name] = value
    _PROGRESS.applied["rlimits"] = limits


# <linux/securebits.h>: keep-caps stays off for good (a setuid keeps no capability).
SECBIT_KEEP_CAPS_LOCKED = 1 << 5


def _become(ids: tuple[int, int, tuple[int, ...]]) -> dict[str, Any]:
    """--user: root becomes NAME for good, keeping no capability.

    While still root: lock the securebits that matter for a non-root uid (no root privileges
    for uid 0 through exec, no ambient raise, keep-caps off), empty the bounding and ambient
    sets. Then groups, gid and uid (real, effective, saved): the kernel clears the permitted
    and effective sets on that setuid. Verified from /proc/self/status and getresuid.
    """
    from egressbox.confine import caps, syscalls

    uid, gid, groups = ids
    bits = caps.SECBIT_NOROOT | caps.SECBIT_NOROOT_LOCKED | SECBIT_KEEP_CAPS_LOCKED
    bits |= caps.SECBIT_NO_CAP_AMBIENT_RAISE | caps.SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED
    syscalls.prctl(syscalls.PR_SET_SECUREBITS, bits)
    for cap in range(caps.read_last_cap() + 1):
        syscalls.prctl(syscalls.PR_CAPBSET_DROP, cap)
    with contextlib.suppress(OSError):  # kernels before 4.3 have no ambient set
        syscalls.prctl(syscalls.PR_CAP_AMBIENT, syscalls.PR_CAP_AMBIENT_CLEAR_ALL)
    os.setgroups(list(groups))
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    sets = caps.read_capability_sets()
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise LaunchError(f"could not become uid {uid}, gid {gid}")
    if not sets.all_clear:
        raise LaunchError(f"capabilities left after becoming uid {uid}: {sets}")
    return {"uid": uid, "gid": gid, "groups": list(groups)}


def _give_scratch(scratch: tuple[str, ...], ids: tuple[int, int, tuple[int, ...]]) -> None:
    """--user: the scratch space root made in the view (TMPDIR, caches) is NAME's."""
    give_directories((*sorted({os.path.dirname(p) for p in scratch}), *scratch), ids[:2])


def give_directories(paths: tuple[str, ...], owner: tuple[int, int]) -> None:
    """chown directories egressbox made for a run to `owner`: each opened with no symbolic
    link anywhere on its path (one planted by an earlier command makes it skipped, never
    followed), changed by descriptor. A missing one is skipped (its maker said why)."""
    resolve = staging.RESOLVE_NO_SYMLINKS | staging.RESOLVE_NO_MAGICLINKS
    for path in paths:
        try:
            fd = staging.openat2(_AT_FDCWD, path, os.O_DIRECTORY | os.O_NOFOLLOW, resolve)
        except OSError:
            continue
        try:
            os.fchown(fd, *owner)
        finally:
            os.close(fd)


_AT_FDCWD = -100  # <fcntl.h>: absolute paths resolve from the root either way


def _seccomp(plan: LaunchPlan, prepared: Any) -> str:
    """Load the filter last; returns its status: full, partial or none."""
    if plan.seccomp_program and plan.has(Mechanism.SECCOMP):
        from egressbox.confine.syscalls import load_seccomp_program

        load_seccomp_program(plan.seccomp_program)  # raises: never exec without it
        return "full"
    if prepared is None:
        _no_new_privs()
        return "none"
    report = prepared.load()
    if report.status != "full" and not plan.best_effort:
        # os_hardened fails closed: never exec with a weaker filter than planned.
        raise LaunchError(f"seccomp filter not fully applied: {report.reason}")
    if report.status == "none":
        _no_new_privs()
    return str(report.status)


def _connect_filter(plan: LaunchPlan, chan: int) -> dict[str, str]:
    """Load the connect filter and hand its notification fd to the parent, which is waiting
    for it before it says "go". Loaded before the main filter, so that filter need not admit
    seccomp(2); a failure is said to the parent (best effort) or refuses (os_hardened)."""
    from egressbox.confine import notify

    sock = socket.socket(fileno=os.dup(chan))
    try:
        try:
            fd = notify.load(plan.connect_filter)
        except OSError as exc:
            why = f"loading the connect filter failed: {exc.strerror or exc}"
            _tell(sock, {"event": "notify", "message": why})
            if not plan.best_effort:
                raise LaunchError(why) from None
            return {"status": "none", "reason": why}
        try:
            netns.send_message(sock, {"event": "notify"}, [fd])
        finally:
            os.close(fd)  # the parent's copy is the only listener: it dies with the parent
    finally:
        sock.close()
    return {"status": "full"}


def _report_applied(plan: LaunchPlan) -> None:
    """Tell the parent what holds, as the last step before exec (the pipe closes on exec)."""
    if plan.report_fd < 0:
        return

    data = json.dumps(_PROGRESS.applied).encode()
    with contextlib.suppress(OSError):
        os.write(plan.report_fd, data)


def _powerless() -> bool:
    """uid 0 that already holds no capability, bounding set included: a nested run (its
    securebits locked), or uid 0 of a user namespace whose owner gave it none (a nested
    sandbox).

    Nothing is left to drop, and setting the securebits would need CAP_SETPCAP. With an empty
    bounding set no exec can give a capability back (even a set-uid-root file's are masked
    by it), and the bounding set only shrinks.
    """
    from egressbox.confine import caps

    try:
        sets = caps.read_capability_sets()
    except (OSError, ValueError):
        return False
    return sets.all_clear


def _landlock(plan: LaunchPlan, ports: tuple[int, ...]) -> dict[str, Any]:
    from egressbox.confine import landlock_apply

    read, write = plan.read, plan.write
    if not plan.has(Mechanism.MOUNT_NAMESPACE):
        read, write = _without_mounts(plan)
    # Captured: a connect to any address and port ends at egressbox (the namespace holds it),
    # so Landlock refuses only TCP binds.
    captured = _PROGRESS.captured
    report = landlock_apply.apply(
        read=read if plan.has(Mechanism.LANDLOCK_FS) else None,
        write=write,
        sockets=plan.sockets,
        connect_ports=ports if plan.has(Mechanism.LANDLOCK_NET) else None,
        allow_loopback=plan.allow_loopback,
        scopes=plan.has(Mechanism.LANDLOCK_SCOPE),
        connect_any=captured,
    )
    applied: dict[str, Any] = {
        "abi": report.abi,
        "fs": report.fs,
        "net": report.net,
        "scopes": report.scopes,
    }
    if report.net:
        applied["connect"] = "any port (captured)" if captured else "the proxy's ports"
    return applied


def _without_mounts(plan: LaunchPlan) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Landlock roots that keep the credential deny list and the read-only roots
    nested in writable ones without a mount namespace to mask or remount them.

    Landlock is allow-only: a root that holds a denied path is replaced by its
    siblings along the way (expand_excluding), and a writable root that holds a
    read-only one is split the same way, the read-only part granted for reading.
    Entries created later directly in a split directory are not granted.
    """
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
