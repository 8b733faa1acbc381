"""The confined command's stderr, passed through the parent and remembered.

`run` gives the command a pipe (or, when our own stderr is a terminal, the
slave side of a new pty, so `isatty(2)` and colours keep working) instead of
its stderr. A thread copies every byte to our stderr as soon as it arrives
(no line buffering, binary-safe) and keeps the last TAIL_BYTES for the
refusal classification (confine/refusal.py). The thread blocks on writing
exactly as long as our real stderr blocks, so the command waits no longer
than it would have on that stderr (plus one pipe buffer).

When the command has exited, `finish` waits at most DRAIN_TIMEOUT for the
end of the stream: with a PID namespace the kernel has killed everything by
then, but without one a daemonized grandchild may hold the pipe open, and
the run must not hang on it (what it writes later is no longer copied).

Only the stdlib's low-level `_thread`, `select` and `os` are used, so the
cost at start-up is a pipe and a thread (about 0.1 ms).
"""

from __future__ import annotations

import _thread
import contextlib
import os
import select

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


class StderrTee:
    """Copies the command's stderr to ours and keeps the tail; see the module docstring."""

    def __init__(self, read_fd: int, child_fd: int, *, pty: bool, target_fd: int = 2) -> None:
        self.read_fd = read_fd
        self.child_fd = child_fd  # dup2'ed onto fd 2 in the launcher, closed here after the fork
        self.pty = pty
        self.target_fd = target_fd
        self._tail = bytearray()
        self._lock = _thread.allocate_lock()
        self._done = _thread.allocate_lock()
        self._stop = -1
        self._sink_ok = True
        self._started = False

    @classmethod
    def open(cls, target_fd: int = 2) -> StderrTee | None:
        """A pty when `target_fd` is a terminal, else a pipe; None when there is no stderr."""
        try:
            os.fstat(target_fd)
        except OSError:
            return None
        if os.isatty(target_fd):
            tee = cls._open_pty(target_fd)
            if tee is not None:
                return tee
        read_fd, write_fd = os.pipe()
        return cls(read_fd, write_fd, pty=False, target_fd=target_fd)

    @classmethod
    def _open_pty(cls, target_fd: int) -> StderrTee | None:
        try:
            master, slave = os.openpty()
        except OSError:
            return None  # no pty available: a pipe will do
        try:
            _raw(slave)
        except OSError:
            os.close(master)
            os.close(slave)
            return None
        tee = cls(master, slave, pty=True, target_fd=target_fd)
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
        with self._lock:
            return bytes(self._tail)

    def finish(self, timeout: float = DRAIN_TIMEOUT) -> bytes:
        """After the command exited: wait (bounded) for the end of the stream; the tail."""
        if self._started:
            if not self._done.acquire(timeout=timeout):
                os.eventfd_write(self._stop, 1)
                # The pump is at worst blocked writing to our stderr (as the
                # command would have been); give up on it after STUCK_TIMEOUT,
                # leaving its descriptors alone while it may still use them.
                if not self._done.acquire(timeout=STUCK_TIMEOUT):
                    return self.tail()
            self._done.release()
            self._started = False
            os.close(self._stop)
            os.close(self.read_fd)
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
        self._write(data)
        with self._lock:
            self._tail += data
            if len(self._tail) > TAIL_BYTES:
                del self._tail[: len(self._tail) - TAIL_BYTES]
        return True

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while self._sink_ok and view:
            try:
                written = os.write(self.target_fd, view)
            except BlockingIOError:  # our stderr is non-blocking (shared with a shell)
                _wait_writable(self.target_fd)
                continue
            except OSError:  # closed or broken: keep draining the command, copy no more
                self._sink_ok = False
                return
            view = view[written:]


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
