"""Serve a launched child's proxy until the command exits; judge why it failed.

The proxy runs in this process (asyncio), the command in its namespaces; cancelling the run kills
and reaps the whole tree and closes every descriptor.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from egressbox.confine import face
from egressbox.confine.grants import (
    Mechanism,
)
from egressbox.confine.launcher import FORWARDED
from egressbox.core.exitcodes import EXIT_TAMPERED, EXIT_TIMEOUT
from egressbox.runner.assemble import Prepared
from egressbox.runner.gate import finish
from egressbox.runner.options import RunOptions, RunResult
from egressbox.runner.spawn import Launched, _kill_and_reap
from egressbox.runner.terminal import (
    DRAIN_TIMEOUT,
    FINAL_READS,
)
from egressbox.runner.verify import settle

if TYPE_CHECKING:
    from egressbox.audit.record import AuditRecord, AuditSink
    from egressbox.confine.refusal import HostPath, PathPlan, RefusalRecord
    from egressbox.proxy.broker import Broker
    from egressbox.proxy.server import EgressProxy


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
    hold = _Hold(launched, prepared=prepared)
    try:
        hold.proxy = _make_proxy(launched, options, audit=audit, log=log, broker=prepared.broker)
    except BaseException:
        hold.abandon()
        raise
    return await _supervise(hold, prepared)


def _make_proxy(
    launched: Launched,
    options: RunOptions,
    *,
    audit: AuditSink | None = None,
    log: Any = None,
    broker: Broker | None = None,
) -> EgressProxy:
    """The proxy for the launcher's listeners (not started: _supervise() starts it)."""
    from egressbox.net.resolve import DnsResolver
    from egressbox.proxy.server import EgressProxy

    http, socks = launched.listeners[0], launched.listeners[1]
    capture = [s for s in (launched.capture,) if s is not None]
    dns = [s for s in (launched.dns_udp, launched.dns_tcp) if s is not None]
    for sock in (*launched.listeners, *capture, *dns):
        sock.setblocking(False)
    resolver = DnsResolver(list(options.nameservers)) if options.nameservers else None
    asking: dict[str, Any] = {}
    if options.on_miss is not None:
        from egressbox.runner.ask import for_run

        asking["on_miss"] = for_run(options.on_miss, launched.tee)
        if options.ask_timeout is not None:
            asking["ask_timeout"] = options.ask_timeout
    proxy = EgressProxy(
        options.policy,
        http_sockets=[http],
        socks_sockets=[socks],
        resolver=resolver,
        audit=audit,
        keep_records=True,
        log=log,
        log_allowed=options.log_allowed,
        capture_sockets=capture,
        dns_sockets=dns,
        destinations=launched.destinations,
        # Its values were read after the fork, before the command started (api._read_secrets).
        broker=broker,
        secrets=options.secrets,
        **asking,
    )
    return proxy


class _Hold:
    """What a run holds until it ends; let go of once, whatever ends it."""

    def __init__(
        self,
        launched: Launched,
        proxy: EgressProxy | None = None,
        prepared: Prepared | None = None,
    ) -> None:
        self.launched = launched
        self.proxy = proxy
        self.prepared = prepared  # its layer and snapshot, settled however the run ends
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
        launched.close_capture()  # the same for the capture and DNS sockets

    def abandon(self) -> None:
        """Tear the run down awaiting nothing: its loop is closing, or it never ran."""
        if self.released:
            return
        self.stop()
        if self.proxy is not None:
            self.proxy.abort()
        self.release()
        if self.prepared is not None:
            keep_unapplied(self.prepared)

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
        if proxy.approvals is not None:
            # A question still open (a prompt on the terminal) ends before the terminal
            # relay gives the terminal its modes back.
            await proxy.approvals.aclose()
        outputs = await asyncio.gather(*(r.finish(DRAIN_TIMEOUT) for r in hold.readers))
    except GeneratorExit:
        # The coroutine is being finalized (its loop closed with the run in
        # flight): nothing may be awaited any more.
        hold.abandon()
        raise
    except BaseException:
        hold.stop()
        keep_unapplied(prepared)
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
    result.approved = proxy.approvals.approved() if proxy.approvals is not None else []
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
    *,
    proxy: str = "",
) -> RefusalRecord | None:
    """Which boundary refused a failing child, or None when nothing shows one did.

    Evidence only: the proxy's denials during the run (egress); then the command's own error
    output (`stderr`, its tail) judged against the run's `plan` (confine/refusal.py): a path
    refused outside the grants, a namespace refused by the seccomp filter, a connection made
    without the proxy. A command that failed for its own reasons (`false`, a failing test
    suite, a missing file the host lacks too, SIGINT) gets no record.
    """
    from egressbox.confine.refusal import SOURCE_AUDIT, Boundary, RefusalRecord

    denied = [r for r in records if r.decision.value == "deny"]
    if denied:
        seen = dict.fromkeys(f"{r.host}:{r.port} ({r.reason.value})" for r in denied)
        return RefusalRecord(Boundary.EGRESS, tuple(seen), source=SOURCE_AUDIT)
    del code
    if not stderr or plan is None:
        return None
    text = stderr.decode("utf-8", "replace")
    return face.judge_output(text, plan, lookup or host_path, proxy)


def path_plan(prepared: Prepared) -> PathPlan:
    """The filesystem side of the plan the launcher applied, for judging refusals."""
    return face.refusal_view(
        prepared.plan,
        homes=prepared.homes,
        caches=prepared.caches,
        cache_mode=prepared.cache_mode,
        read_only_workspaces=prepared.read_only_workspaces,
    )


def host_path(path: str) -> HostPath:
    """What the host says about a path the command named (stat only, never opened)."""
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
    if st.st_uid == os.geteuid():
        return bool(st.st_mode & stat.S_IRUSR)
    if st.st_gid == os.getegid() or st.st_gid in os.getgroups():
        return bool(st.st_mode & stat.S_IRGRP)
    return bool(st.st_mode & stat.S_IROTH)


def _exit_before_first_connection(launched: Launched) -> int | None:
    """Wait (without asyncio) until the child connects or exits.

    A command that never connects then never pays for starting the proxy;
    one that does waits in the listen backlog for a few milliseconds.
    """

    def forward(signum: int, _frame: object) -> None:
        launched.forward(signum)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED}
    pidfd = os.pidfd_open(launched.pid)
    try:
        while True:
            try:
                # A captured connection or a DNS question starts the proxy too.
                sockets = [*launched.listeners, *launched.capture_sockets()]
                watched = [pidfd, *(sock.fileno() for sock in sockets)]
                ready, _, _ = select.select(watched, [], [], launched.expire())
                if ready:
                    break
            except InterruptedError:
                continue
    finally:
        os.close(pidfd)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if any(sock.fileno() in ready for sock in sockets):
        return None
    _, status = os.waitpid(launched.pid, 0)
    for sock in launched.listeners:
        sock.close()
    launched.close_capture()
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _result(
    code: int,
    records: list[AuditRecord],
    prepared: Prepared,
    launched: Launched,
    stderr: bytes | None = None,
) -> RunResult:
    clean_up(prepared)
    if launched.timed_out:
        from egressbox.confine.refusal import Boundary, RefusalRecord

        result = RunResult(EXIT_TIMEOUT, records, prepared.report, roots=prepared.roots)
        result.profile = prepared.profile.value
        _end_facts(result, launched)
        result.refusal = RefusalRecord(Boundary.TIMEOUT, timeout=launched.timeout)
        finish(prepared, result)
        return result
    result = RunResult(code, records, prepared.report, roots=prepared.roots)
    result.profile = prepared.profile.value
    _end_facts(result, launched)
    # The way back, before anything judges the host's files: the layer through the gate.
    finish(prepared, result)
    result.created_trusted = _created_trusted(prepared)
    result.warnings = list(prepared.warnings) + result.created_trusted
    if prepared.guard is not None and prepared.guard.acted:
        result.exit_code = EXIT_TAMPERED
        result.created_trusted.append(
            f"the run exits {EXIT_TAMPERED} (the command's own exit code was {code}): it "
            "changed or made files the host trusts, put right as said above"
        )
    if code != 0:
        result.refusal = _refusal(code, records, stderr, prepared, launched)
    return result


def _end_facts(result: RunResult, launched: Launched) -> None:
    """What the run's ends kept: escape sequences the terminal relay dropped, unix socket
    connects the connect supervisor refused."""
    result.terminal_dropped = launched.tee.dropped() if launched.tee is not None else {}
    result.unix_refused = launched.unix_refused
    result.unix_refused_first = launched.unix_refused_first


def unix_refused_line(result: RunResult) -> str:
    """The stderr line for unix connects refused outside the grants, "" when none were."""
    if not result.unix_refused:
        return ""
    many = "s" if result.unix_refused != 1 else ""
    return (
        f"refused {result.unix_refused} connect{many} to unix sockets outside the "
        f"grants (first: {result.unix_refused_first}); --unix-socket-root DIR admits a "
        "directory's sockets"
    )


def _refusal(
    code: int,
    records: list[AuditRecord],
    stderr: bytes | None,
    prepared: Prepared,
    launched: Launched,
) -> RefusalRecord | None:
    """The record of a failed run, with Harn's requirement and selector fields; None when
    nothing shows a boundary refused it (the exit status says the rest)."""
    from egressbox.confine.refusal import Boundary, RefusalRecord

    if code == EXIT_SIGSYS:
        record: RefusalRecord | None = seccomp_refusal(prepared.started)
    else:
        proxy = launched.proxy_text if prepared.plan.has(Mechanism.NETWORK_NAMESPACE) else ""
        record = classify_refusal(records, code, stderr, path_plan(prepared), proxy=proxy)
    if record is None and prepared.foreign_locale and stderr:
        # Something was said, in words egressbox cannot read: say that, not a boundary.
        hint = (
            f"the command's messages are in {prepared.foreign_locale} (LC_ALL/LC_MESSAGES), and "
            "egressbox reads only English error texts: with LC_MESSAGES=C and no LC_ALL (which "
            "overrides it), it names a boundary if one refused the command"
        )
        record = RefusalRecord(Boundary.UNKNOWN, hint=hint)
    return face.with_requirement(record, prepared.profile.value) if record is not None else None


# A command (or the shell that ran it) that died from SIGSYS, as `run` reports it.
EXIT_SIGSYS = 128 + signal.SIGSYS
# Kernel log records read, at most, to find a seccomp kill (a full ring buffer holds far fewer).
KMSG_MAX_RECORDS = 100_000
KMSG_MAX_SECONDS = 1.0
# Records stamped slightly before the run was planned still count (clock granularity).
KMSG_SLACK = 1.0


def seccomp_refusal(started: float) -> RefusalRecord:
    """A seccomp record for a command killed by SIGSYS, naming the call when the kernel's
    audit record of the kill can be read (/dev/kmsg: root, or dmesg_restrict=0)."""
    since = started - KMSG_SLACK
    return face.seccomp_refusal(_kernel_log(), since=since, uid=os.getuid(), name=_syscall_name)


def _kernel_log() -> list[str]:
    """The kernel's log records as text (empty when unreadable), bounded in count and time."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    lines: list[str] = []
    deadline = time.monotonic() + KMSG_MAX_SECONDS
    try:
        for _ in range(KMSG_MAX_RECORDS):
            if time.monotonic() > deadline:
                break
            try:
                record = os.read(fd, 8192)
            except BrokenPipeError:
                continue  # overwritten while we read: the next one follows
            except (BlockingIOError, OSError):
                break
            if not record:
                break
            # "PRIORITY,SEQUENCE,MICROSECONDS,FLAGS;TEXT\n": the text is what matters.
            lines.append(record.decode("utf-8", "replace").partition(";")[2].strip())
    finally:
        os.close(fd)
    return lines


def _syscall_name(kill: Any) -> str:
    """`getpid (x86 system call 20)`, or the number alone when libseccomp cannot name it."""
    from egressbox.confine.refusal import AUDIT_ARCHES

    arch = AUDIT_ARCHES.get(kill.arch, kill.arch or "unknown ABI")
    name = ""
    try:
        import pyseccomp

        token = getattr(pyseccomp.Arch, arch.upper())
        name = pyseccomp.resolve_syscall(token, kill.syscall).decode("ascii")
    except Exception:  # naming is a nicety: the number is still said
        name = ""
    number = f"{arch} system call {kill.syscall}"
    return f"{name} ({number})" if name else number


def keep_unapplied(prepared: Prepared) -> None:
    """A run that ended without its result (cancelled, failed, its loop closed): host-trusted
    paths are put right and its layer is kept, not applied; the next run or `egressbox
    changes` names it. Idempotent."""
    clean_up(prepared)
    if prepared.stage is not None:
        stage, prepared.stage = prepared.stage, None
        stage.close()


def clean_up(prepared: Prepared) -> None:
    """Put host-trusted paths right, remove what was made for this run only (idempotent)."""
    if prepared.guard is not None:
        settle(prepared.guard)  # once; _created_trusted() says what it did
    if not prepared.cleanup:
        return  # the usual case: shutil (with bz2 and lzma) is not even loaded (~2.5 ms)
    import shutil

    while prepared.cleanup:
        shutil.rmtree(prepared.cleanup.pop(), ignore_errors=True)


def _created_trusted(prepared: Prepared) -> list[str]:
    """What the command changed or made among host-trusted paths, and what was done about it.

    Read-only binds need a file to exist first: what the command made, and (without a mount
    namespace) what it changed, is judged after the run (runner/verify.py).
    """
    if prepared.guard is not None:
        return list(settle(prepared.guard))
    return [
        f"the command created {path}, which the host trusts (it may run code at your next "
        "git command, shell or editor start): review it before you use it"
        for path in prepared.created_watch
        if os.path.lexists(path)
    ]
