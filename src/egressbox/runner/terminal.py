"""The confined command's standard streams, passed through the parent and remembered.

Without a terminal, `run` gives the command a pipe instead of its stderr
(StderrTee); stdin and stdout pass through unchanged. A thread copies every
byte to our stderr as soon as it arrives (no line buffering, binary-safe)
and keeps the last TAIL_BYTES for the refusal classification
(confine/refusal.py). The thread blocks on writing exactly as long as our
real stderr blocks, so the command waits no longer than it would have on
that stderr (plus one pipe buffer).

When any of our fds 0/1/2 is a terminal, the command never gets that
terminal (TerminalRelay): it gets the slave of one new pty on each of those
fds instead, so it cannot type into the caller's terminal (TIOCSTI), read
keystrokes meant for someone else, or change its modes. One thread relays:
what is typed on our fd 0 goes to the pty's master, what the master gives
goes to our stdout (or stderr) and into the tail. A non-terminal stderr
still goes through a StderrTee pipe feeding the same tail; a non-terminal
stdin is never read here (the command reads it directly).

What reaches a terminal of ours passes through a filter (runner/vtfilter.py): only
sequences that act on the command's own screen get there; the clipboard, the title, the
queries a terminal answers by typing, DCS and the other strings are dropped and counted
(`dropped()`, for the run's report). The tail keeps the bytes as they came.

While the relay holds our terminal raw, its output processing is off: egressbox's own
lines written meanwhile end with CR LF (`terminal_line`), or the command's next line would
start where ours ended.

When the command has exited, `finish` waits at most DRAIN_TIMEOUT for the
end of the stream: with a PID namespace the kernel has killed everything by
then, but without one a daemonized grandchild may hold the pipe open, and
the run must not hang on it (what it writes later is no longer copied).

Only the stdlib's low-level `_thread`, `select` and `os` are used (plus
`termios`, `tty` and `fcntl` when there is a terminal), so the cost at
start-up is a pipe or a pty and a thread (about 0.1 ms).
"""

from __future__ import annotations

import _thread
import contextlib
import os
import select
from typing import Any

# The tail kept for the refusal classification: confine.refusal.TAIL_BYTES
# (not imported: that module loads only when a run fails).
TAIL_BYTES = 64 * 1024
# How long the run waits for the end of the command's stderr after the
# command exited: generous for output still in flight, short enough that a
# grandchild holding the pipe open delays the exit code only a little.
DRAIN_TIMEOUT = 0.5
# How long `finish` then waits for a copy blocked on our own stderr.
STUCK_TIMEOUT = 5.0
# After that, what is readable at once is still copied, up to this many reads.
FINAL_READS = 64
CHUNK = 65536
# A write to our stderr that cannot go on (non-blocking and full) waits this long per try.
WRITE_POLL_MS = 1000
# While `run` is a background job of its terminal, the relay looks again this often
# whether it is in the foreground (reading the terminal before would stop the run).
BACKGROUND_POLL_MS = 200
# hold(): the longest wait for a relay step under way (it may be blocked on our terminal).
HOLD_WAIT = 1.0
# The child's fds 0, 1, 2 and which of our fds each one would inherit.
STD_STREAMS: tuple[int | None, int | None, int | None] = (0, 1, 2)
_HUNG = select.POLLHUP | select.POLLERR | select.POLLNVAL


def _terminal_filter(fd: int) -> Any:
    """A VtFilter for what goes to `fd` when it is a terminal (else None), in the
    encoding of the caller's locale."""
    if not os.isatty(fd):
        return None
    from egressbox.runner.vtfilter import VtFilter, utf8_locale

    return VtFilter(utf8=utf8_locale())


class Tail:
    """The last TAIL_BYTES the command wrote, fed by one or more copying threads."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._lock = _thread.allocate_lock()

    def add(self, data: bytes) -> None:
        with self._lock:
            self._data += data
            if len(self._data) > TAIL_BYTES:
                del self._data[: len(self._data) - TAIL_BYTES]

    def get(self) -> bytes:
        with self._lock:
            return bytes(self._data)


class StderrTee:
    """Copies the command's stderr to ours and keeps the tail; see the module docstring."""

    def __init__(
        self,
        read_fd: int,
        child_fd: int,
        *,
        pty: bool,
        target_fd: int = 2,
        tail: Tail | None = None,
    ) -> None:
        self.read_fd = read_fd
        self.child_fd = child_fd  # dup2'ed onto fd 2 in the launcher, closed here after the fork
        self.pty = pty
        self.target_fd = target_fd
        self._tail = tail if tail is not None else Tail()
        self._done = _thread.allocate_lock()
        self._stop = -1
        self._sink_ok = True
        self._started = False
        self._filter = _terminal_filter(target_fd)

    @classmethod
    def open(cls, target_fd: int = 2, *, tail: Tail | None = None) -> StderrTee | None:
        """A pty when `target_fd` is a terminal, else a pipe; None when there is no stderr."""
        try:
            os.fstat(target_fd)
        except OSError:
            return None
        if os.isatty(target_fd):
            tee = cls._open_pty(target_fd, tail)
            if tee is not None:
                return tee
        read_fd, write_fd = (_lift(fd) for fd in os.pipe())
        return cls(read_fd, write_fd, pty=False, target_fd=target_fd, tail=tail)

    def child_fds(self) -> dict[int, int]:
        """The child's std fds and what the launcher dup2()s onto them."""
        return {2: self.child_fd}

    @classmethod
    def _open_pty(cls, target_fd: int, tail: Tail | None) -> StderrTee | None:
        try:
            master, slave = (_lift(fd) for fd in os.openpty())
        except OSError:
            return None  # no pty available: a pipe will do
        try:
            _raw(slave)
        except OSError:
            os.close(master)
            os.close(slave)
            return None
        tee = cls(master, slave, pty=True, target_fd=target_fd, tail=tail)
        tee.resize()
        return tee

    def start(self) -> None:
        """In the parent, after the fork: close the child's end and start copying."""
        os.close(self.child_fd)
        self._stop = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._done.acquire()
        self._started = True
        _thread.start_new_thread(self._pump, ())

    def close_in_child(self) -> None:
        """In the forked launcher, after the dup2: our end is not the child's business."""
        with contextlib.suppress(OSError):
            os.close(self.read_fd)
        with contextlib.suppress(OSError):
            os.close(self.child_fd)

    def abandon(self) -> None:
        """Never started (the launch failed): release both ends."""
        for fd in (self.read_fd, self.child_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def resize(self) -> None:
        """Copy the terminal's window size to the pty (at start and on SIGWINCH)."""
        if not self.pty:
            return
        import fcntl
        import termios

        with contextlib.suppress(OSError):
            size = fcntl.ioctl(self.target_fd, termios.TIOCGWINSZ, b"\0" * 8)
            fcntl.ioctl(self.read_fd, termios.TIOCSWINSZ, size)

    def tail(self) -> bytes:
        return self._tail.get()

    def dropped(self) -> dict[str, int]:
        """Escape sequences kept from our terminal, by kind (runner/vtfilter.py)."""
        return dict(self._filter.dropped) if self._filter is not None else {}

    def finish(self, timeout: float = DRAIN_TIMEOUT) -> bytes:
        """After the command exited: wait (bounded) for the end of the stream; the tail."""
        if self._started:
            if not _join(self._done, self._stop, timeout):
                return self.tail()
            self._started = False
            os.close(self._stop)
            os.close(self.read_fd)
            if self._filter is not None:
                self._filter.flush()  # a sequence left open is counted, never written
        return self.tail()

    # -- the thread ----------------------------------------------------------------------

    def _pump(self) -> None:
        try:
            poller = select.poll()
            poller.register(self.read_fd, select.POLLIN)
            poller.register(self._stop, select.POLLIN)
            while True:
                ready = dict(poller.poll())
                if self.read_fd in ready:
                    if not self._read_once():
                        return
                elif self._stop in ready:
                    break
            # Told to stop: copy what is there now, then let go.
            os.set_blocking(self.read_fd, False)
            for _ in range(FINAL_READS):
                if not self._read_once():
                    return
        finally:
            self._done.release()

    def _read_once(self) -> bool:
        """One read and copy; False at the end of the stream (or when nothing is left)."""
        try:
            data = os.read(self.read_fd, CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            # EIO: a pty whose slave side is closed everywhere; anything else
            # (EBADF...) ends the copy too, never the run.
            return False
        if not data:
            return False
        self._tail.add(data)
        shown = data if self._filter is None else self._filter.feed(data)
        self._sink_ok = self._sink_ok and _write_all(self.target_fd, shown)
        return True


class TerminalRelay:
    """The command's own terminal: one new pty, whose slave replaces each of our std fds
    that is a terminal; a thread relays between its master and our terminal."""

    def __init__(
        self, master: int, slave: int, terminals: dict[int, int], stderr_fd: int | None
    ) -> None:
        self.master = master  # ours, non-blocking, relayed by the thread
        self.slave = slave  # dup2'ed onto the child's fds in `terminals`, closed here after
        self.terminals = terminals  # child's std fd -> our fd there, a terminal
        self.in_fd = terminals.get(0)  # our terminal input; None: the child reads fd 0 itself
        self.out_fd = _output_fd(terminals, 2 if stderr_fd is None else stderr_fd)
        # The terminal whose modes and size the pty copies.
        outputs = terminals.values()
        self.term_fd = self.out_fd if self.out_fd in outputs else next(iter(outputs))
        self.raw = False  # decided in open(): our terminal goes raw in start()
        self.stderr: StderrTee | None = None  # a stderr that is no terminal, through a pipe
        self._stderr_fd = stderr_fd if 2 not in terminals else None
        self._tail = Tail()
        self._reader = -1  # where typed bytes are read (set in start())
        self._reading = self.in_fd is not None
        self._lock = _thread.allocate_lock()  # _reading, and any read of our terminal
        self._saved: list[Any] | None = None  # in_fd's modes while we keep it raw
        self._modes_lock = _thread.allocate_lock()
        self._pending = bytearray()  # typed, not yet taken by the master
        self._sink_ok = True
        self._done = _thread.allocate_lock()
        self._stop = -1
        self._started = False
        # hold(): the caller's terminal belongs to a question for a moment (runner/ask.py).
        self._held = False
        self._step_lock = _thread.allocate_lock()  # one relay step, or a hold() waiting
        self._filter: Any = None  # what reaches our terminal (set in _setup)

    @classmethod
    def open(
        cls, streams: tuple[int | None, int | None, int | None] = STD_STREAMS
    ) -> TerminalRelay | None:
        """A relay when one of `streams` (our fds the child's 0, 1, 2 would inherit; None:
        not passed by us) is a terminal; None when none is, or no pty can be had."""
        terminals = {std: fd for std, fd in enumerate(streams) if fd is not None and os.isatty(fd)}
        if not terminals:
            return None
        try:
            master, slave = (_lift(fd) for fd in os.openpty())
        except OSError:
            return None  # no pty here: the streams pass as they are
        relay = cls(master, slave, terminals, streams[2])
        try:
            relay._setup()
        except OSError:
            relay.abandon()
            return None
        return relay

    def _setup(self) -> None:
        os.set_blocking(self.master, False)
        # Raw only for an interactive command (typing and output on the terminal), and
        # only as the terminal's foreground job: a pipe into a pager keeps its modes.
        self.raw = self.in_fd is not None and 1 in self.terminals and _foreground(self.in_fd)
        self._configure_slave()
        self.resize()
        self._filter = _terminal_filter(self.out_fd)
        if self._stderr_fd is not None:
            self.stderr = StderrTee.open(self._stderr_fd, tail=self._tail)

    def _configure_slave(self) -> None:
        """Raw relay: the slave takes our terminal's modes (it edits, echoes and signals
        now). Otherwise our terminal does all that and the slave neither echoes nor
        processes output (each byte is treated once)."""
        import termios

        source = self.in_fd if self.raw and self.in_fd is not None else self.term_fd
        try:
            modes = termios.tcgetattr(source)
            termios.tcsetattr(self.slave, termios.TCSANOW, modes if self.raw else _passive(modes))
        except termios.error as exc:
            raise OSError(str(exc)) from None

    def child_fds(self) -> dict[int, int]:
        """The child's std fds and what the launcher dup2()s onto them."""
        fds = dict.fromkeys(self.terminals, self.slave)
        if self.stderr is not None:
            fds.update(self.stderr.child_fds())
        return fds

    def start(self) -> None:
        """In the parent, after the fork: our terminal raw, the child's end closed, relaying."""
        if self.raw:
            self._enter_raw()
        os.close(self.slave)
        if self.stderr is not None:
            self.stderr.start()
        if self.in_fd is not None:
            self._reader = _reopen(self.in_fd)
        self._stop = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._done.acquire()
        self._started = True
        _thread.start_new_thread(self._pump, ())

    def _enter_raw(self) -> None:
        import atexit
        import termios
        import tty

        assert self.in_fd is not None
        if _foreground(self.in_fd):  # still: we may have been moved since open()
            try:
                self._saved = termios.tcgetattr(self.in_fd)
                tty.setraw(self.in_fd, termios.TCSANOW)  # TCSANOW: typed-ahead bytes stay
                atexit.register(self._restore)  # an exception ending the interpreter, too
                return
            except termios.error:
                self._restore()
        self.raw = False  # our terminal keeps its modes: the slave must not echo twice
        with contextlib.suppress(OSError):
            self._configure_slave()

    def close_in_child(self) -> None:
        """In the forked launcher, after the dup2s: our ends are not the child's business."""
        for fd in (self.master, self.slave):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.stderr is not None:
            self.stderr.close_in_child()

    def abandon(self) -> None:
        """Never started (the launch failed): release everything."""
        self._restore()
        for fd in (self.master, self.slave):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.stderr is not None:
            self.stderr.abandon()

    def resize(self) -> None:
        """Copy our terminal's window size to the pty (at start and on SIGWINCH)."""
        import fcntl
        import termios

        with contextlib.suppress(OSError):
            size = fcntl.ioctl(self.term_fd, termios.TIOCGWINSZ, b"\0" * 8)
            fcntl.ioctl(self.master, termios.TIOCSWINSZ, size)

    def tail(self) -> bytes:
        return self._tail.get()

    def dropped(self) -> dict[str, int]:
        """Escape sequences kept from our terminal, by kind (the stderr pipe's too)."""
        counts = dict(self._filter.dropped) if self._filter is not None else {}
        for kind, count in (self.stderr.dropped() if self.stderr is not None else {}).items():
            counts[kind] = counts.get(kind, 0) + count
        return counts

    def hold(self) -> None:
        """Copy nothing either way until release(): the command's output waits in its pty
        and what is typed stays in our terminal (a question is asked there meanwhile).
        Returns once no copy is under way (or after HOLD_WAIT, when one is stuck writing to a
        blocked terminal: then the hold begins after it)."""
        locked = self._step_lock.acquire(timeout=HOLD_WAIT)
        self._held = True
        if locked:
            self._step_lock.release()

    def release(self) -> None:
        """Relay again (within BACKGROUND_POLL_MS)."""
        with self._step_lock:
            self._held = False

    def finish(self, timeout: float = DRAIN_TIMEOUT) -> bytes:
        """After the command exited: stop reading our terminal at once, wait (bounded) for
        the end of the output, give the terminal back its modes; the tail."""
        self._stop_reading()
        if self._started and _join(self._done, self._stop, timeout):
            self._started = False
            self._close()
            if self._filter is not None:
                self._filter.flush()  # a sequence left open is counted, never written
        self._restore()
        if self.raw:
            import atexit

            atexit.unregister(self._restore)
        if self.stderr is not None:
            self.stderr.finish(timeout)
        return self.tail()

    def _close(self) -> None:
        os.close(self._stop)
        os.close(self.master)
        if self._reader not in (-1, self.in_fd):
            os.close(self._reader)

    def _stop_reading(self) -> None:
        """No read of our terminal after this returns (what is typed next is not ours)."""
        # Only a read of fd 0 itself (no descriptor of our own) could hold the lock long.
        locked = self._lock.acquire(timeout=STUCK_TIMEOUT)
        self._reading = False
        if locked:
            self._lock.release()

    def _restore(self) -> None:
        """Our terminal's modes as they were before start(), exactly; at most once."""
        with self._modes_lock:
            saved, self._saved = self._saved, None
        if saved is not None and self.in_fd is not None:
            _set_modes(self.in_fd, saved)

    # -- the thread ----------------------------------------------------------------------

    def _pump(self) -> None:
        import signal
        import termios

        # Job control never stops the relay: a read in the background fails (EIO) instead.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTIN, signal.SIGTTOU})
        try:
            with contextlib.suppress(OSError, termios.error):  # they end the relay, not the run
                self._relay()
        finally:
            # The command's terminal is gone (or we were told to stop): the caller's
            # terminal is the caller's again at once.
            self._stop_reading()
            self._restore()
            self._done.release()

    def _relay(self) -> None:
        poller = select.poll()
        poller.register(self._stop, select.POLLIN)
        while True:
            events = dict(poller.poll(self._arm(poller)))
            if self._stop in events:
                break
            with self._step_lock:
                if not self._held and not self._step(events):
                    return
        # Told to stop: copy what is there now, then let go.
        for _ in range(FINAL_READS):
            if not self._copy_output(_HUNG):
                return

    def _arm(self, poller: Any) -> int | None:
        """Register what to wait for; the poll timeout (ms) while we wait for the foreground."""
        if self._held:  # neither side is watched: look again soon whether we may go on
            for fd in (self.master, self._reader):
                if fd >= 0:
                    with contextlib.suppress(KeyError):
                        poller.unregister(fd)
            return BACKGROUND_POLL_MS
        poller.register(self.master, select.POLLIN | (select.POLLOUT if self._pending else 0))
        if self._reader < 0:
            return None
        # Typed bytes wait in our terminal while the master has not taken the last ones.
        if self._reading and not self._pending and _may_read(self._reader):
            poller.register(self._reader, select.POLLIN)
            return None
        with contextlib.suppress(KeyError):
            poller.unregister(self._reader)
        return BACKGROUND_POLL_MS if self._reading and not self._pending else None

    def _step(self, events: dict[int, int]) -> bool:
        """One round of copying; False once the command's terminal is gone."""
        output = events.get(self.master, 0)
        if output & (select.POLLIN | _HUNG) and not self._copy_output(output):
            return False
        if output & select.POLLOUT and not self._flush():
            return False
        typed = events.get(self._reader, 0) if self._reader >= 0 else 0
        return self._take_input(typed) if typed else True

    def _copy_output(self, events: int) -> bool:
        """One read from the master to our terminal and the tail; False at its end."""
        try:
            data = os.read(self.master, CHUNK)
        except BlockingIOError:
            return not events & _HUNG
        except OSError:  # EIO: every slave is closed (the command and its children are gone)
            return False
        if not data:
            return False
        # The tail first: whoever reads our copy may look at the tail right after.
        self._tail.add(data)
        shown = data if self._filter is None else self._filter.feed(data)
        self._sink_ok = self._sink_ok and _write_all(self.out_fd, shown)
        return True

    def _take_input(self, events: int) -> bool:
        if events & _HUNG:  # our terminal hung up: nothing more will be typed
            self._stop_reading()
            return True
        data = self._read_input()
        if data is None:
            self._stop_reading()
            return True
        self._pending += data
        return self._flush()

    def _read_input(self) -> bytes | None:
        """A chunk typed on our terminal: b"" when none is there now, None when input is
        over. Under the lock, so that once _stop_reading() returns no read is under way."""
        with self._lock:
            if not self._reading:
                return None
            try:
                data = os.read(self._reader, self._readable())
            except (BlockingIOError, InterruptedError):
                return b""
            except OSError:  # EIO: hung up, or a background job now (SIGTTIN is blocked)
                return None if _may_read(self._reader) else b""
        return data or self._typed_eof()

    def _readable(self) -> int:
        if self._reader != self.in_fd:
            return CHUNK  # our own non-blocking descriptor: a read never waits
        # fd 0 itself, blocking and shared with the shell: read no more than is there
        # (0 with POLLIN is a typed EOF in canonical mode, which a read returns at once).
        import fcntl
        import struct
        import termios

        there = struct.unpack("i", fcntl.ioctl(self._reader, termios.FIONREAD, b"\0" * 4))[0]
        return max(1, min(int(there), CHUNK))

    def _typed_eof(self) -> bytes | None:
        """A read of 0 bytes: EOF typed on a canonical terminal (the command gets the
        slave's EOF character, so it sees its input end too); raw, the terminal hung up."""
        import termios

        if self.raw:
            return None
        modes = termios.tcgetattr(self.master)  # Linux: a master reports its slave's modes
        eof = modes[6][termios.VEOF]
        if not modes[3] & termios.ICANON or not isinstance(eof, bytes):
            return b""
        return eof

    def _flush(self) -> bool:
        """Hand typed bytes to the master as far as it takes them; False once it is gone."""
        while self._pending:
            try:
                written = os.write(self.master, self._pending)
            except BlockingIOError:
                return True  # the command reads slower than we type: POLLOUT says when
            except OSError:
                return False
            del self._pending[:written]
        return True


def open_stdio(*, capture_output: bool = False) -> StderrTee | TerminalRelay | None:
    """What carries the command's standard streams through us (None: nothing does).

    A TerminalRelay when one of our fds 0/1/2 is a terminal (captured output keeps its
    pipes, so only a terminal stdin is relayed then); otherwise a StderrTee for stderr.
    """
    if capture_output:
        return TerminalRelay.open((0, None, None))
    return TerminalRelay.open() or StderrTee.open()


def terminal_line(text: str, stream: Any) -> str:
    """`text` as one line of ours on `stream`: control characters shown as \\xNN (a name or a
    path in it may come from the command: never an escape sequence for our terminal), and
    each line ended as the terminal needs it (line_end)."""
    import re

    end = line_end(stream)
    shown = re.sub("[\x00-\x08\x0b-\x1f\x7f-\x9f]", lambda m: f"\\x{ord(m.group()):02x}", text)
    return shown.replace("\n", end) + end


def line_end(stream: Any) -> str:
    """CR LF when `stream` is a terminal that does not turn LF into CR LF itself (a relay
    holds it raw), else LF."""
    import termios

    try:
        fd = stream.fileno()
        if not os.isatty(fd):
            return "\n"
        oflag = termios.tcgetattr(fd)[1]
    except (OSError, ValueError, AttributeError, termios.error):
        return "\n"
    return "\n" if oflag & termios.OPOST and oflag & termios.ONLCR else "\r\n"


def _join(done: Any, stop: int, timeout: float) -> bool:
    """Wait for a copying thread to end, telling it to stop after `timeout`; False when it
    is still stuck after STUCK_TIMEOUT (its descriptors are then left to it)."""
    if not done.acquire(timeout=timeout):
        os.eventfd_write(stop, 1)
        # The thread is at worst blocked writing to our stdout/stderr (as the
        # command would have been); give up on it after STUCK_TIMEOUT.
        if not done.acquire(timeout=STUCK_TIMEOUT):
            return False
    done.release()
    return True


def _write_all(fd: int, data: bytes) -> bool:
    """Write everything to our stdout/stderr; False once it is closed or broken (the
    caller keeps draining the command then, and copies no more)."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:  # non-blocking (shared with a shell)
            _wait_writable(fd)
            continue
        except OSError:
            return False
        view = view[written:]
    return True


def _wait_writable(fd: int) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    poller.poll(WRITE_POLL_MS)


def _raw(fd: int) -> None:
    """Raw mode on the pty's slave: the bytes reach the master unchanged (no \\n -> \\r\\n)."""
    import termios
    import tty

    try:
        tty.setraw(fd)
    except termios.error as exc:
        raise OSError(str(exc)) from None


def _lift(fd: int) -> int:
    """`fd`, moved above 2 if needed: with fds 0-2 closed when `run` starts, a pipe or pty
    could land there, and the launcher's dup2()s onto 0-2 would overwrite it."""
    if fd > 2:
        return fd
    import fcntl

    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)


def _foreground(fd: int) -> bool:
    """Whether we are the foreground process group of the terminal on `fd`."""
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False


def _may_read(fd: int) -> bool:
    """Whether reading the terminal on `fd` is ours to do now: we are its foreground job,
    or it is not our controlling terminal (no job control applies)."""
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return True


def _output_fd(terminals: dict[int, int], fallback: int) -> int:
    """Where the master's bytes go: our stdout, else our stderr, when it is a terminal;
    else the terminal on our fd 0 itself when it is open for writing (what the command
    writes to /dev/tty belongs there), else `fallback` (our stderr, a pipe or file)."""
    import fcntl

    for std in (1, 2):
        if std in terminals:
            return terminals[std]
    fd = terminals[0]
    with contextlib.suppress(OSError):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
            return fd
    return fallback


def _passive(modes: list[Any]) -> list[Any]:
    """`modes` without echo and output processing (our own terminal does both)."""
    import termios

    modes = list(modes)
    modes[1] &= ~termios.OPOST
    modes[3] &= ~(termios.ECHO | termios.ECHONL)
    return modes


def _reopen(fd: int) -> int:
    """Our own, non-blocking open file description of the terminal on `fd`: a read never
    waits (so none outlives the run), and fd 0's flags, shared with the shell, stay as
    they are. `fd` itself when the terminal cannot be opened by us."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        return _lift(os.open(f"/proc/self/fd/{fd}", flags))
    except OSError:
        return fd


def _set_modes(fd: int, modes: list[Any]) -> None:
    """tcsetattr that never stops us (SIGTTOU blocked: we may be a background job by
    now) and never fails the run."""
    import signal
    import termios

    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        with contextlib.suppress(termios.error):
            termios.tcsetattr(fd, termios.TCSANOW, modes)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
