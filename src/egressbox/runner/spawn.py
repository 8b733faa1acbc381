"""Fork the launcher, receive the listeners it bound in the child's namespace, and learn
what it really applied (the report it sends just before exec)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import time
from typing import TYPE_CHECKING, Any

from egressbox.confine import face
from egressbox.confine.grants import (
    Enforcement,
    Mechanism,
)
from egressbox.core.errors import EgressboxError
from egressbox.core.exitcodes import CAUSE_CODES, EXIT_CANNOT_CONFINE
from egressbox.net.original import Destinations
from egressbox.runner import zygote
from egressbox.runner.assemble import Prepared
from egressbox.runner.facts import forget_facts
from egressbox.runner.options import KILL_GRACE, LAUNCHER_TIMEOUT, RunOptions, write_err
from egressbox.runner.report import CAPTURE_ROW, FILESYSTEM_ROW, MEMORY_ROW, applied_report
from egressbox.runner.terminal import (
    StderrTee,
    TerminalRelay,
    open_stdio,
)

if TYPE_CHECKING:
    from egressbox.runner.notify import ConnectSupervisor


def confirm(prepared: Prepared, launched: Launched, options: RunOptions) -> None:
    """Replace the planned report with what the launcher applied; say a gap on stderr."""
    chosen = frozenset(Mechanism(m) for m in prepared.plan.mechanisms)
    applied = launched.read_applied()
    if applied is None:
        return  # the command never ran: its exit code and message say why
    prepared.report, prepared.network_boundary = applied_report(
        prepared.profile,
        chosen,
        applied,
        capture_off=prepared.capture_off,
        capture_served=launched.capture_served,
    )
    gaps = [
        row.mechanism
        for row in prepared.report
        if row.enforcement is not Enforcement.FULL
        and row.mechanism not in ("network_boundary", CAPTURE_ROW, MEMORY_ROW, FILESYSTEM_ROW)
        and not (options.allow_loopback and row.mechanism == Mechanism.LANDLOCK_NET.value)
    ]
    if gaps:
        # The host probe said these were available and they were not applied: the cached
        # probe is out of date (runner/facts.py); the next run probes afresh.
        forget_facts()
    if gaps or prepared.network_boundary is not Enforcement.FULL:
        line = (
            f"confinement is partial: network boundary {prepared.network_boundary.value}; "
            f"not applied: {', '.join(gaps) or '-'} (--report for details)"
        )
        prepared.warnings.append(line)
        write_err(f"warning: {line}")


# Whether this process's run side serves the capture listener and the DNS sockets: the proxy
# that runner/supervise.py makes takes Launched.capture, .dns_udp and .dns_tcp (EgressProxy's
# capture and DNS sockets). While it does not, spawn() closes them as soon as they arrive, so a
# captured connection is refused at once and a DNS question gets "port unreachable" at once,
# instead of waiting in a backlog that nobody accepts; the report says so.
SERVE_CAPTURE = True
# Roles of the descriptors the launcher sends, in order (confine/launcher.py _listeners).
PROXY_ROLES = ("http", "socks")
CAPTURE_ROLES = ("capture", "dns_udp", "dns_tcp")


# Mutable state of one run, compared by identity. A plain class, not a dataclass: the
# decorator compiles its __init__ at import, on the start-up path. The class attributes are
# the defaults of what __init__ does not set.
class Launched:
    """A launcher that is running, and the sockets of its child's namespace.

    `listeners` is [http, socks], the proxy's own listeners. With capture (the launcher
    applied it and SERVE_CAPTURE) the namespace's other sockets, each owned by this object
    until the proxy takes it (it then closes it), else closed by close_capture() or abandon():

    - `capture`: TCP listener every other connection of the child is redirected to. Dual-stack
      (AF_INET6, bound to [::]) when the kernel has IPv6, else AF_INET on 127.0.0.1. Read where
      an accepted connection was going with confine.capture.original_destination(conn)
      (SO_ORIGINAL_DST for IPv4, IPv4-mapped included; IP6T_SO_ORIGINAL_DST for IPv6).
    - `dns_udp`: UDP socket bound to 127.0.0.53:53, where the child's /etc/resolv.conf points;
      UDP to port 53 of any IPv4 address is sent there too (nat).
    - `dns_tcp`: TCP listener on 127.0.0.53:53 (truncated answers, `dig +tcp`).

    `ports` names each port by role: {"http", "socks"} and, with capture, {"capture", "dns"}.
    """

    pid: int
    listeners: list[socket.socket]
    stdout_fd: int | None = None
    stderr_fd: int | None = None
    chan: socket.socket | None = None  # to the launcher, until go() or abandon()
    # The command's stderr through us, or its new terminal relayed by us (None: neither).
    tee: StderrTee | TerminalRelay | None = None
    report_fd: int | None = None  # what the launcher applied, until read_applied()
    proxy_text = ""  # where the proxy listens, as the child sees it (for refusal lines)
    applied: dict[str, Any] | None = None
    # --timeout: when the next step is due (time.monotonic()), and whether it expired.
    due: float | None = None
    timeout: float | None = None
    timed_out: bool = False
    capture: socket.socket | None = None
    dns_udp: socket.socket | None = None
    dns_tcp: socket.socket | None = None
    ports: dict[str, int]
    # The launcher captured and the sockets were kept for this run's proxy (SERVE_CAPTURE).
    capture_served: bool = False
    # Without a network namespace: the connect supervisor (runner/notify.py), started by go()
    # when `supervise_connects`; `destinations` is its table, shared with the proxy.
    supervise_connects: bool = False
    abstract_allowed: bool = True
    # --user NAME: the supervisor connects the command's unix sockets with NAME's rights.
    run_as: tuple[int, int, tuple[int, ...]] | None = None
    connects: ConnectSupervisor | None = None
    destinations: Destinations | None = None
    # Where it admits a unix socket connect (LaunchPlan.unix_roots, unix_hidden).
    unix_roots: tuple[str, ...] | None = None
    unix_hidden: tuple[str, ...] = ()
    connects_off = ""
    # What the supervisor refused outside those grants, kept when it stops (for RunResult).
    unix_refused = 0
    unix_refused_first = ""

    def __init__(
        self,
        pid: int,
        listeners: list[socket.socket],
        *,
        chan: socket.socket | None = None,
        tee: StderrTee | TerminalRelay | None = None,
    ) -> None:
        self.pid = pid
        self.listeners = listeners
        self.chan = chan
        self.tee = tee
        self.ports = {}

    def capture_sockets(self) -> list[socket.socket]:
        """The capture and DNS sockets still held (to serve, or to watch for a first client)."""
        return [s for s in (self.capture, self.dns_udp, self.dns_tcp) if s is not None]

    def close_capture(self) -> None:
        """Close the capture and DNS sockets nobody took, and stop the connect supervisor
        (idempotent)."""
        for sock in self.capture_sockets():
            sock.close()
        self.capture = self.dns_udp = self.dns_tcp = None
        if self.connects is not None:
            self.connects.close()  # its thread joined: the counts are final
            self.unix_refused = self.connects.unix_refused
            self.unix_refused_first = self.connects.unix_refused_first
            self.connects = None

    def _start_connects(self, chan: socket.socket) -> None:
        """Take the connect filter's notification fd the command sends before it waits for
        "go", and serve it. Not sent (the filter failed to load: the command then runs with
        Landlock's ports alone, as its report says; or it died): said in connects_off."""
        from egressbox.runner.notify import ConnectSupervisor, receive_listener

        try:
            fd = receive_listener(chan, LAUNCHER_TIMEOUT)
        except OSError as exc:
            self.connects_off = str(exc.strerror or exc)
            return
        self.connects = ConnectSupervisor(
            fd,
            proxy_ports=(self.ports["http"], self.ports["socks"]),
            capture_port=self.ports.get("capture") if self.capture is not None else None,
            destinations=self.destinations if self.destinations is not None else Destinations(),
            abstract_allowed=self.abstract_allowed,
            as_user=self.run_as,
            unix_roots=self.unix_roots,
            unix_hidden=self.unix_hidden,
        )
        self.connects.start()

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
            if self.supervise_connects and self.connects is None:
                self._start_connects(self.chan)
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
        self.close_capture()
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
    plan = prepared.plan
    pipes = (os.pipe(), os.pipe()) if capture_output else None
    # Not captured: the command's stderr still passes through us (refusal records). It never
    # gets our terminal: a new pty takes the place of each of our std fds that is one.
    tee = open_stdio(capture_output=capture_output)
    if isinstance(tee, TerminalRelay):
        plan = plan._replace(controlling_tty=True)
    try:
        # A zygote the command line forked early has imported the launcher's modules already.
        started = face.launch(
            plan,
            child_fds=_child_fds(pipes, tee),
            in_child=tee.close_in_child if tee is not None else None,
            forker=zygote.launch,
        )
    except BaseException:
        if tee is not None:
            tee.abandon()
        raise
    pid, parent_chan, report_r = started
    if tee is not None:
        tee.start()
    out_fd = err_fd = None
    if pipes is not None:
        os.close(pipes[0][1])
        os.close(pipes[1][1])
        out_fd, err_fd = pipes[0][0], pipes[1][0]
    try:
        sockets = _receive(parent_chan, prepared)
    except BaseException:
        parent_chan.close()
        os.close(report_r)
        _kill_and_reap(pid)
        if tee is not None:
            tee.finish()
        raise
    parent_chan.settimeout(None)
    launched = _launched(pid, sockets, parent_chan, tee)
    if prepared.plan.connect_filter:
        _supervised(launched, prepared)
    launched.stdout_fd, launched.stderr_fd = out_fd, err_fd
    launched.report_fd = report_r
    launched.proxy_text = "{host}:{http} (HTTP) and :{socks} (SOCKS5)".format(
        host=prepared.plan.proxy_host, **launched.ports
    )
    return launched


def _supervised(launched: Launched, prepared: Prepared) -> None:
    """Without a namespace: the connect supervisor starts in go(); the capture listener is
    the one `prepare` bound on the host's loopback, its destinations from the shared table."""
    launched.supervise_connects = True
    launched.abstract_allowed = not prepared.plan.has(Mechanism.LANDLOCK_SCOPE)
    launched.run_as = prepared.plan.run_as
    launched.unix_roots = prepared.plan.unix_roots
    launched.unix_hidden = prepared.plan.unix_hidden
    launched.destinations = Destinations()
    capture, prepared.host_capture = prepared.host_capture, None
    if capture is not None:
        launched.capture = capture
        launched.ports["capture"] = int(capture.getsockname()[1])
        launched.capture_served = True


def _child_fds(
    pipes: tuple[tuple[int, int], tuple[int, int]] | None, tee: StderrTee | TerminalRelay | None
) -> dict[int, int]:
    """What the launcher dup2()s onto its std fds: the capture pipes, then the tee's ends."""
    fds = {} if pipes is None else {1: pipes[0][1], 2: pipes[1][1]}
    if tee is not None:
        fds.update(tee.child_fds())
    return fds


def _launched(
    pid: int,
    sockets: dict[str, socket.socket],
    chan: socket.socket,
    tee: StderrTee | TerminalRelay | None,
) -> Launched:
    """The Launched for the sockets received by role; unserved capture sockets closed."""
    ports = {role: int(sock.getsockname()[1]) for role, sock in sockets.items()}
    if "dns_udp" in ports:
        ports["dns"] = ports.pop("dns_udp")
        del ports["dns_tcp"]
    launched = Launched(pid, [sockets[role] for role in PROXY_ROLES], chan=chan, tee=tee)
    launched.ports = ports
    launched.capture = sockets.get("capture")
    launched.dns_udp = sockets.get("dns_udp")
    launched.dns_tcp = sockets.get("dns_tcp")
    launched.capture_served = SERVE_CAPTURE and launched.capture is not None
    if not SERVE_CAPTURE:
        launched.close_capture()
    return launched


def _receive(chan: socket.socket, prepared: Prepared) -> dict[str, socket.socket]:
    """The sockets the launcher sent, by role (PROXY_ROLES, then CAPTURE_ROLES with capture)."""
    chan.settimeout(LAUNCHER_TIMEOUT)
    try:
        message, fds = face.launcher_word(chan)
    except TimeoutError:
        raise LaunchFailedError("the launcher did not start in time") from None
    if message.get("event") == "refused":
        for fd in fds:
            os.close(fd)
        cause = str(message.get("cause", "confinement_unavailable"))
        code = CAUSE_CODES.get(cause, EXIT_CANNOT_CONFINE)
        raise LaunchFailedError(str(message.get("message", "confinement failed")), code)
    if message.get("event") != "listening":
        for fd in fds:
            os.close(fd)
        raise LaunchFailedError("the launcher ended before it was ready")
    if not fds:
        return dict(zip(PROXY_ROLES, prepared.host_listeners, strict=True))
    received = [socket.socket(fileno=fd) for fd in fds]
    roles = message.get("roles", list(PROXY_ROLES))
    known = (list(PROXY_ROLES), [*PROXY_ROLES, *CAPTURE_ROLES])
    if roles not in known or len(roles) != len(received):
        for sock in received:
            sock.close()
        raise LaunchFailedError(f"the launcher sent unexpected sockets: {roles!r}")
    if face.on_host_network(received):
        for sock in received:
            sock.close()
        raise LaunchFailedError("the child's listeners are not in a private network namespace")
    return dict(zip(roles, received, strict=True))


def _kill_and_reap(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
