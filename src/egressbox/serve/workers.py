"""`egressbox serve --workers N`: N proxy processes behind one set of ports.

One event loop saturates one core, so a busy `serve` on a multi-core host runs
N worker processes and lets the kernel spread connections across them:

- the parent binds every listener first, N sockets per listener, each with
  SO_REUSEPORT set before bind (the first picks the port when it is 0; the
  others join it), so "port taken" still fails at start with exit 3 and every
  worker gets its own accept queue (no thundering herd on one socket);
- the parent forks the workers before any event loop exists; each worker
  keeps only its own sockets, builds its own loop, resolver and EgressProxy,
  opens the audit log itself (O_APPEND, one write(2) per record, so records of
  several processes stay whole lines), and dies with the parent
  (PR_SET_PDEATHSIG);
- each worker reports on its own pipe (ready, reload outcome); the parent
  prints the one ready line once every worker is ready, and only then lets
  the workers accept (a shared pipe: one byte each), so that nothing precedes
  the ready line on stdout;
- the parent supervises: SIGHUP and SIGUSR1 are forwarded to every worker
  (a reload's outcome is said once, when every worker has answered), and so is
  a change of the policy file under --watch-policy (the parent polls it);
  SIGINT/SIGTERM are forwarded and the parent waits for every worker's drain,
  then exits 0 (a second one kills the workers); a worker that dies otherwise
  stops the others and the parent exits 1: never a silent respawn, since an
  egress proxy that half-works is worse than one that stops.

The policy's `[limits] max_connections` is per process, so each worker gets
ceil(max_connections / N) and the total still holds.

With `--admin`, worker 0 alone gets the admin listener (bound here before the
fork) and the others send it their numbers (fleet.py); the parent, systemd's
main process, sends READY=1 with the ready line and STOPPING=1 when it stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import math
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from egressbox.core.exitcodes import EXIT_OK, EXIT_RUNTIME, EXIT_START, EXIT_USAGE
from egressbox.core.policy import Policy
from egressbox.core.secrets import RequestRule
from egressbox.proxy.gate import stderr_log
from egressbox.proxy.server import LISTEN_BACKLOG
from egressbox.serve.systemd import Notifier
from egressbox.serve.watch import WATCH_INTERVAL, PolicyWatch

# More processes than this is a typo, not a deployment.
MAX_WORKERS = 256
# How long the parent sleeps in select() at most between looks at its workers
# (SIGCHLD wakes it at once; this is the safety net).
SUPERVISE_TICK = 1.0
# Signals the parent handles; everything else keeps its default action.
PARENT_SIGNALS = (signal.SIGHUP, signal.SIGUSR1, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
KINDS = ("http", "socks5")


def worker_count(text: str) -> int:
    """`--workers N|auto`: 1..MAX_WORKERS; auto is the number of CPUs this process may use."""
    if text == "auto":
        return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number; use 1-{MAX_WORKERS} or auto") from None
    if not 1 <= count <= MAX_WORKERS:
        raise ValueError(f"{count} is out of range; use 1-{MAX_WORKERS} or auto")
    return count


def share_limits(policy: Policy, count: int) -> Policy:
    """The policy one of `count` workers enforces: max_connections divided (rounded up).

    Like suggest.with_mode, the derived fields (CIDR indexes) are passed fresh so that
    the original policy is left untouched."""
    if count <= 1:
        return policy
    limits = policy.limits
    per_worker = math.ceil(limits.max_connections / count)
    fresh = {
        f.name: f.default_factory()
        for f in dataclasses.fields(policy)
        if f.name.startswith("_") and f.default_factory is not dataclasses.MISSING
    }
    return dataclasses.replace(policy, limits=limits._replace(max_connections=per_worker), **fresh)


def share_rules(rules: Sequence[RequestRule], count: int) -> tuple[RequestRule, ...]:
    """The [[request_rule]] budgets one of `count` workers enforces: each divided (rounded
    up), as max_connections is. Workers count on their own (no shared counter): a client
    whose connections all land in one worker meets its share of the budget, not the whole."""
    if count <= 1:
        return tuple(rules)
    return tuple(
        rule._replace(
            max_requests=_share(rule.max_requests, count),
            max_request_bytes=_share(rule.max_request_bytes, count),
        )
        for rule in rules
    )


def _share(budget: int | None, count: int) -> int | None:
    return None if budget is None else math.ceil(budget / count)


# -- listeners ---------------------------------------------------------------------------


def bind_group(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on host:port in one SO_REUSEPORT group.

    The first socket binds `port` (0: the OS picks one) and the others bind the
    port it got. Only sockets of the same user that all set SO_REUSEPORT can
    join a group, so a port held by anyone else still fails with EADDRINUSE."""
    ip = ipaddress.ip_address(host)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                v6only = 0 if ip.is_unspecified else 1
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
            sock.bind((str(ip), port))
            port = sock.getsockname()[1]
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def bind_listeners(
    listen: str, ports: dict[str, int | None], count: int
) -> dict[str, list[socket.socket]]:
    """Per listener kind, one socket per worker (none for a listener that is off)."""
    groups: dict[str, list[socket.socket]] = {}
    try:
        for kind in KINDS:
            port = ports.get(kind)
            if port is not None:
                groups[kind] = bind_group(listen, port, count)
    except BaseException:
        close_all(sock for group in groups.values() for sock in group)
        raise
    return groups


def close_all(sockets: Iterable[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


# -- the parent ----------------------------------------------------------------------------


@dataclass
class Worker:
    """A worker process, as its supervisor tracks it."""

    index: int
    pid: int
    report_fd: int  # the parent's end of the worker's report pipe
    buffer: bytes = b""
    ready: dict[str, str] | None = None
    status: int | None = None  # the wait status once reaped

    @property
    def alive(self) -> bool:
        return self.status is None


@dataclass
class ReloadRound:
    """The answers to one forwarded SIGHUP: said once when every worker has answered."""

    expected: int
    answers: dict[str, int] = field(default_factory=dict)

    def add(self, message: str) -> None:
        self.answers[message] = self.answers.get(message, 0) + 1
        self.expected -= 1

    def lines(self, count: int) -> list[str]:
        return [
            text if seen == count else f"{text} (in {seen} of {count} workers)"
            for text, seen in self.answers.items()
        ]


class Supervisor:
    """The parent of the workers: forks them, prints the ready line, relays signals."""

    def __init__(
        self,
        count: int,
        log: Callable[[str], None],
        *,
        notifier: Notifier | None = None,
        watch: PolicyWatch | None = None,
        ready_extra: dict[str, str] | None = None,
    ) -> None:
        self.count = count
        self.log = log
        self.notifier = notifier or Notifier(None)
        self.watch = watch
        self.watch_at = 0.0  # when the policy file is next looked at (monotonic)
        self.ready_extra = dict(ready_extra or {})
        self.workers: list[Worker] = []
        self.pending: list[int] = []
        self.reload: ReloadRound | None = None
        self.stopping = False
        self.pid = os.getpid()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.go_r, self.go_w = os.pipe()
        self._old_handlers: dict[int, object] = {}
        self._old_wakeup = -1

    # -- signals -----------------------------------------------------------------------

    def install_signals(self) -> None:
        # A handler that only notes the signal: the main loop acts on it. The
        # wakeup fd ends the select() at once.
        for sig in PARENT_SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._note)
        self._old_wakeup = signal.set_wakeup_fd(self.wake_w)

    def _note(self, signum: int, frame: object) -> None:
        self.pending.append(signum)

    def restore_signals(self) -> None:
        signal.set_wakeup_fd(self._old_wakeup)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def signal_workers(self, sig: int) -> None:
        for worker in self.workers:
            if worker.alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, sig)

    # -- the main loop -----------------------------------------------------------------

    def wait(self, timeout: float = SUPERVISE_TICK) -> None:
        """Sleep until a signal, a report or the tick; then read reports and reap."""
        fds = [self.wake_r] + [w.report_fd for w in self.workers if w.report_fd >= 0]
        with contextlib.suppress(InterruptedError):
            readable, _, _ = select.select(fds, [], [], timeout)
            if self.wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.wake_r, 4096):
                        pass
            for worker in self.workers:
                if worker.report_fd in readable:
                    self._read_reports(worker)
        self.reap()

    def reap(self) -> None:
        for worker in self.workers:
            if not worker.alive:
                continue
            try:
                pid, status = os.waitpid(worker.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = worker.pid, 0
            if pid == worker.pid:
                worker.status = status
                if worker.report_fd >= 0:
                    self._read_reports(worker)

    def _read_reports(self, worker: Worker) -> None:
        try:
            chunk = os.read(worker.report_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            os.close(worker.report_fd)
            worker.report_fd = -1
            return
        worker.buffer += chunk
        while b"\n" in worker.buffer:
            line, _, worker.buffer = worker.buffer.partition(b"\n")
            with contextlib.suppress(ValueError):
                self._on_report(worker, json.loads(line))

    def _on_report(self, worker: Worker, report: dict[str, object]) -> None:
        event = report.get("event")
        if event == "ready" and isinstance(report.get("line"), dict):
            line = report["line"]
            assert isinstance(line, dict)
            worker.ready = {str(k): str(v) for k, v in line.items()}
        elif event in ("reload", "reopen"):
            message = str(report.get("message", ""))
            if event == "reopen" or self.reload is None:
                # A reopen reports failures only; a reload outside a round was
                # signalled to that worker directly.
                self.log(message)
            else:
                self.reload.add(message)
                if self.reload.expected <= 0:
                    self._say_reload()

    def _say_reload(self) -> None:
        if self.reload is not None:
            for line in self.reload.lines(self.count):
                self.log(line)
            self.reload = None

    def take_signals(self) -> tuple[bool, bool, bool]:
        """(stop, reload, reopen) asked since the last look."""
        taken, self.pending = self.pending, []
        stop = any(sig in STOP_SIGNALS for sig in taken)
        return stop, signal.SIGHUP in taken, signal.SIGUSR1 in taken

    def forward_reload(self) -> None:
        if self.reload is not None:
            self._say_reload()  # an overlapping reload: say what the last one got so far
        live = sum(1 for w in self.workers if w.alive)
        self.reload = ReloadRound(live)
        self.signal_workers(signal.SIGHUP)

    def dead_worker(self) -> Worker | None:
        return next((w for w in self.workers if not w.alive), None)

    def policy_changed(self) -> bool:
        """--watch-policy: True when the file should be reloaded (looked at once a second)."""
        if self.watch is None:
            return False
        now = time.monotonic()
        if now < self.watch_at:
            return False
        self.watch_at = now + WATCH_INTERVAL
        return self.watch.poll()

    def stop_all(self) -> int:
        """SIGTERM every worker and wait for each drain; a second stop signal kills."""
        self.stopping = True
        self.notifier.notify("STOPPING=1", "STATUS=draining")
        self.signal_workers(signal.SIGTERM)
        if self.go_w >= 0:
            # A worker still waiting for the go reads EOF instead, and stops.
            os.close(self.go_w)
            self.go_w = -1
        killed = False
        while any(w.alive for w in self.workers):
            self.wait()
            stop, _, _ = self.take_signals()
            if stop and not killed:
                self.log("stopping now: killing the workers")
                self.signal_workers(signal.SIGKILL)
                killed = True
        return EXIT_OK if all(_stopped_cleanly(w.status) for w in self.workers) else EXIT_RUNTIME

    def close(self) -> None:
        for fd in (self.wake_r, self.wake_w, self.go_r, self.go_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        for worker in self.workers:
            if worker.report_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(worker.report_fd)
                worker.report_fd = -1


def _stopped_cleanly(status: int | None) -> bool:
    """Exit 0, or the SIGTERM we sent killed it before its handlers were in place."""
    if status is None:
        return False
    return status == 0 or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM)


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"was killed by {name}"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"


# worker_main(index, sockets, report_fd, go_fd) -> exit code, run in each child.
WorkerMain = Callable[[int, dict[str, socket.socket], int, int], int]


def run_workers(
    count: int,
    groups: dict[str, list[socket.socket]],
    worker_main: WorkerMain,
    *,
    own: Sequence[dict[str, socket.socket]] = (),
    ready_extra: dict[str, str] | None = None,
    notifier: Notifier | None = None,
    watch: PolicyWatch | None = None,
) -> int:
    """Fork `count` workers over `groups`, supervise them, return the exit code.

    `worker_main(index, sockets, report_fd, go_fd)` runs in each child and returns its
    exit code; `sockets` maps a listener kind to the worker's own socket (a group of one
    socket is shared by every worker), plus what `own[index]` gives that worker alone.
    `ready_extra` joins the ready line; `notifier` hears READY=1 and STOPPING=1; a change
    of `watch`'s file is forwarded as SIGHUP is."""
    sup = Supervisor(count, stderr_log, notifier=notifier, watch=watch, ready_extra=ready_extra)
    sys.stdout.flush()
    sys.stderr.flush()
    sup.install_signals()
    extra = [sock for mine in own for sock in mine.values()]
    try:
        return _run(sup, count, groups, worker_main, own)
    except BaseException:
        sup.signal_workers(signal.SIGTERM)
        raise
    finally:
        close_all(sock for group in groups.values() for sock in group)
        close_all(extra)
        sup.close()
        sup.restore_signals()


def _run(
    sup: Supervisor,
    count: int,
    groups: dict[str, list[socket.socket]],
    worker_main: WorkerMain,
    own: Sequence[dict[str, socket.socket]] = (),
) -> int:
    for index in range(count):
        report_r, report_w = os.pipe()
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(report_r)
            os.close(report_w)
            sup.log(f"cannot start worker {index + 1} of {count}: {exc}")
            sup.stop_all()
            return EXIT_START
        if pid == 0:  # pragma: no cover - the child never returns (coverage sees no exit)
            _child(
                sup,
                index,
                groups=groups,
                own=own,
                worker_main=worker_main,
                report_r=report_r,
                report_w=report_w,
            )
        os.close(report_w)
        os.set_blocking(report_r, False)
        sup.workers.append(Worker(index, pid, report_r))
    # The workers hold their sockets now: the parent's copies would sit in the
    # SO_REUSEPORT group with nobody accepting on them.
    close_all(sock for group in groups.values() for sock in group)
    close_all(sock for mine in own for sock in mine.values())
    os.close(sup.go_r)
    sup.go_r = -1
    code = _wait_ready(sup)
    if code is not None:
        return code
    return _supervise(sup)


def _wait_ready(sup: Supervisor) -> int | None:
    """Wait for every worker's ready report, then print the ready line and let them go."""
    reload = reopen = False
    while not all(w.ready is not None for w in sup.workers):
        sup.wait()
        stop, hup, usr1 = sup.take_signals()
        reload, reopen = reload or hup, reopen or usr1
        if stop:
            return sup.stop_all()
        dead = sup.dead_worker()
        if dead is not None:
            assert dead.status is not None
            if dead.ready is None:
                sup.log(f"worker {dead.pid} {describe_status(dead.status)} before it was ready")
            code = os.waitstatus_to_exitcode(dead.status)
            sup.stop_all()
            return code if code in (EXIT_USAGE, EXIT_START) else EXIT_START
    lines = {json.dumps({**(w.ready or {}), **sup.ready_extra}) for w in sup.workers}
    if len(lines) != 1:  # cannot happen: every worker serves the same sockets' addresses
        sup.log(f"workers disagree on their addresses: {sorted(lines)}")
        sup.stop_all()
        return EXIT_START
    os.write(sys.stdout.fileno(), (lines.pop() + "\n").encode())
    sup.notifier.notify("READY=1", f"STATUS=serving with {sup.count} workers")
    # One byte per worker on the shared pipe: each reads one and starts accepting.
    os.write(sup.go_w, b"g" * len(sup.workers))
    os.close(sup.go_w)
    sup.go_w = -1
    if reload:
        sup.forward_reload()
    if reopen:
        sup.signal_workers(signal.SIGUSR1)
    return None


def _supervise(sup: Supervisor) -> int:
    while True:
        sup.wait()
        stop, reload, reopen = sup.take_signals()
        if stop:  # first: a Ctrl-C reaches the workers too, and they may end first
            return sup.stop_all()
        dead = sup.dead_worker()
        if dead is not None:
            assert dead.status is not None
            sup.log(
                f"worker {dead.pid} {describe_status(dead.status)} unexpectedly; "
                "stopping the other workers"
            )
            sup.stop_all()
            return EXIT_RUNTIME
        if reload or sup.policy_changed():
            sup.forward_reload()
        if reopen:
            sup.signal_workers(signal.SIGUSR1)


def _child(
    sup: Supervisor,
    index: int,
    *,
    groups: dict[str, list[socket.socket]],
    own: Sequence[dict[str, socket.socket]],
    worker_main: WorkerMain,
    report_r: int,
    report_w: int,
) -> None:
    """The worker side of the fork: tidy up what belongs to the parent, run, _exit."""
    code = EXIT_RUNTIME
    try:
        # Die with the parent (a SIGKILLed parent must not leave a half proxy behind):
        # SIGTERM lets the worker drain; the getppid() check covers a parent that died
        # before prctl took effect.
        _set_pdeathsig(signal.SIGTERM)
        if os.getppid() != sup.pid:
            os._exit(EXIT_RUNTIME)
        signal.set_wakeup_fd(-1)
        # Until the worker's loop installs its own handlers: a SIGHUP or SIGUSR1 must
        # not kill it (the parent forwards them only once every worker is ready).
        for sig in (signal.SIGHUP, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        for fd in [sup.wake_r, sup.wake_w, sup.go_w, report_r]:
            os.close(fd)
        for worker in sup.workers:
            os.close(worker.report_fd)
        code = worker_main(index, _keep_mine(index, groups, own), report_w, sup.go_r)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else EXIT_RUNTIME
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


def _keep_mine(
    index: int, groups: dict[str, list[socket.socket]], own: Sequence[dict[str, socket.socket]]
) -> dict[str, socket.socket]:
    """Worker `index`'s sockets; every other one is closed in this process."""
    mine: dict[str, socket.socket] = {}
    for kind, group in groups.items():
        for position, sock in enumerate(group):
            if position == index % len(group):
                mine[kind] = sock
            else:
                sock.close()
    alone = own[index] if index < len(own) else {}
    for theirs in own:
        for sock in theirs.values():
            if all(sock is not kept for kept in alone.values()):
                sock.close()
    mine.update(alone)
    return mine


def _set_pdeathsig(sig: int) -> None:
    from egressbox.confine import syscalls

    syscalls.prctl(syscalls.PR_SET_PDEATHSIG, int(sig))


def report(fd: int, event: str, **fields: object) -> None:
    """One JSON line to the parent (a short blocking write; ignored if the parent is gone)."""
    data = (json.dumps({"event": event, **fields}) + "\n").encode()
    with contextlib.suppress(OSError):
        os.write(fd, data)


def wait_for_go(fd: int) -> bool:
    """Block (the event loop too, on purpose: nothing is accepted meanwhile) until the
    parent has printed the ready line. False when the parent went away instead."""
    try:
        got = os.read(fd, 1)
    except OSError:
        got = b""
    with contextlib.suppress(OSError):
        os.close(fd)
    return got == b"g"
