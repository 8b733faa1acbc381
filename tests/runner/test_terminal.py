"""The stderr pass-through (stderr_tee.py): bytes copied unchanged, a bounded tail, a bounded
wait at the end, and a pty when the target is a terminal. The "child" here is a descriptor
duplicated from the child's end before the tee starts.

The terminal relay, with real ptys: one pty stands for the caller's terminal, the relay's own
pty for the command's. Bytes cross both ways unchanged, the caller's terminal is read only
while it is a terminal stdin of the foreground job and only until finish(), its modes come
back exactly, and TIOCSTI on the command's terminal stays there. Cases that need a
controlling terminal (raw mode, job control) run in a forked child with a session of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import random
import select
import signal
import struct
import termios
import time
import tty
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from egressbox.confine.refusal import TAIL_BYTES as REFUSAL_TAIL_BYTES
from egressbox.runner.terminal import TAIL_BYTES, StderrTee, TerminalRelay
from forking import fork_call

# finish() must return soon after its timeout even when a writer keeps the stream open.
LINGER_TIMEOUT = 0.2
LINGER_BOUND = 3.0


def _tee(target: Path) -> tuple[StderrTee, int, int]:
    out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    tee = StderrTee.open(out)
    assert tee is not None and not tee.pty
    child = os.dup(tee.child_fd)
    tee.start()
    return tee, child, out


def test_the_tail_sizes_agree() -> None:
    assert TAIL_BYTES == REFUSAL_TAIL_BYTES


def test_bytes_are_copied_unchanged_and_the_tail_is_bounded(tmp_path: Path) -> None:
    target = tmp_path / "stderr"
    tee, child, out = _tee(target)
    data = random.Random(7).randbytes(3 * TAIL_BYTES + 123)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(child, view[:5000]) :]
        os.close(child)
        tail = tee.finish()
    finally:
        os.close(out)
    assert target.read_bytes() == data
    assert tail == data[-TAIL_BYTES:]


def test_finish_does_not_wait_for_a_lingering_writer(tmp_path: Path) -> None:
    tee, child, out = _tee(tmp_path / "stderr")
    try:
        os.write(child, b"before exit\n")
        started = time.monotonic()
        tail = tee.finish(LINGER_TIMEOUT)
        assert time.monotonic() - started < LINGER_BOUND
        assert tail == b"before exit\n"
    finally:
        os.close(child)
        os.close(out)


def test_a_terminal_target_gets_a_raw_pty() -> None:
    master, slave = pty.openpty()
    try:
        tee = StderrTee.open(slave)
        assert tee is not None and tee.pty
        assert os.isatty(tee.child_fd)
        child = os.dup(tee.child_fd)
        tee.start()
        os.write(child, b"a\nb\n")
        os.close(child)
        assert tee.finish() == b"a\nb\n"  # raw: no \r added on the way
    finally:
        os.close(master)
        os.close(slave)


def test_no_stderr_no_tee() -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    assert StderrTee.open(fd) is None


# -- the terminal relay ----------------------------------------------------------------------

# Longest wait for bytes to cross the relay; a hang fails the test instead of blocking it.
IO_TIMEOUT = 10.0
# How long a byte that must NOT be taken is given to be taken anyway.
SETTLE = 0.3


@dataclass
class Terminal:
    """A pty standing for the caller's terminal: the test types on (and reads) `master`;
    `slave` is what the relay sees as our fd 0/1/2."""

    master: int
    slave: int

    @classmethod
    def open(cls, *, raw: bool = True) -> Terminal:
        master, slave = pty.openpty()
        if raw:
            tty.setraw(slave)  # bytes cross unchanged (no \n -> \r\n on the way to the test)
        return cls(master, slave)

    def close(self) -> None:
        for fd in (self.master, self.slave):
            with contextlib.suppress(OSError):
                os.close(fd)


@pytest.fixture
def term() -> Iterator[Terminal]:
    terminal = Terminal.open()
    try:
        yield terminal
    finally:
        terminal.close()


def _read_exactly(fd: int, size: int, timeout: float = IO_TIMEOUT) -> bytes:
    data = b""
    deadline = time.monotonic() + timeout
    while len(data) < size and (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, size - len(data))
            if not chunk:
                break
            data += chunk
    return data


def _pending(fd: int) -> int:
    """Bytes waiting to be read on a terminal (FIONREAD)."""
    count: int = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    return count


def _relay(streams: tuple[int | None, int | None, int | None]) -> tuple[TerminalRelay, int]:
    """An opened and started relay, and the child's end of its pty (as the launcher has it)."""
    relay = TerminalRelay.open(streams)
    assert relay is not None
    child = os.dup(relay.slave)
    relay.start()
    return relay, child


def test_no_terminal_no_relay(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    out = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        assert TerminalRelay.open((read_fd, out, write_fd)) is None
        assert TerminalRelay.open((None, None, None)) is None
    finally:
        for fd in (read_fd, write_fd, out):
            os.close(fd)


def test_the_child_gets_one_new_pty_on_every_terminal_fd(term: Terminal) -> None:
    relay = TerminalRelay.open((term.slave, term.slave, term.slave))
    assert relay is not None
    try:
        fds = relay.child_fds()
        assert fds == {0: relay.slave, 1: relay.slave, 2: relay.slave}
        assert os.isatty(relay.slave)
        assert os.fstat(relay.slave).st_rdev != os.fstat(term.slave).st_rdev
    finally:
        relay.abandon()


def test_output_reaches_our_terminal_unchanged_and_feeds_the_tail(term: Terminal) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    relay, child = _relay((null, term.slave, term.slave))
    sent = "one\ntwo\r\n\x1b[31mred\x1b[0m\x00 é€".encode()
    try:
        os.write(child, sent)
        assert _read_exactly(term.master, len(sent)) == sent  # the slave adds no \r
    finally:
        os.close(child)
        tail = relay.finish()
        os.close(null)
    assert tail == sent
    assert relay.dropped() == {}


def test_what_reaches_beyond_the_screen_never_reaches_our_terminal(term: Terminal) -> None:
    """The relay's filter (runner/vtfilter.py) between the pty and our terminal: a clipboard
    write, a query the terminal would answer and a byte of no UTF-8 character stay out;
    the tail keeps what the command wrote."""
    null = os.open(os.devnull, os.O_RDONLY)
    relay, child = _relay((null, term.slave, term.slave))
    sent = b"a\x1b]52;c;aGk=\x07b\x1b[6nc\xffd\x1b]0;t"
    try:
        os.write(child, sent)
        assert _read_exactly(term.master, 4) == b"abcd"
    finally:
        os.close(child)
        tail = relay.finish()
        os.close(null)
    assert tail == sent
    assert relay.dropped() == {"clipboard": 1, "query": 1, "title": 1, "unterminated": 1}


def test_the_tail_of_a_terminal_is_bounded(term: Terminal) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    relay, child = _relay((null, term.slave, term.slave))
    # Text (random bytes would be filtered: a terminal gets only what acts on its screen).
    letters = b"abcdefghijklmnopqrstuvwxyz0123456789 \n"
    data = bytes(random.Random(11).choices(letters, k=TAIL_BYTES + 5000))
    try:
        seen = bytearray()
        for start in range(0, len(data), 4096):
            os.write(child, data[start : start + 4096])
            seen += _read_exactly(term.master, len(data[start : start + 4096]))
    finally:
        os.close(child)
        tail = relay.finish()
        os.close(null)
    assert bytes(seen) == data
    assert tail == data[-TAIL_BYTES:]


def test_typed_bytes_reach_the_child(term: Terminal) -> None:
    relay, child = _relay((term.slave, term.slave, term.slave))
    try:
        os.write(term.master, b"abc\x00\x03\xff")
        # Our terminal is raw, so the child's pty is too, and echoes nothing back.
        assert _read_exactly(child, 6) == b"abc\x00\x03\xff"
        assert not select.select([term.master], [], [], SETTLE)[0]
    finally:
        os.close(child)
        relay.finish()


def test_an_eof_typed_on_a_canonical_terminal_reaches_the_child() -> None:
    cooked = Terminal.open(raw=False)
    relay, child = _relay((cooked.slave, cooked.slave, cooked.slave))
    try:
        os.write(cooked.master, b"line\n\x04")
        assert _read_exactly(child, 5) == b"line\n"
        assert select.select([child], [], [], IO_TIMEOUT)[0]
        assert os.read(child, 100) == b""  # the child's own end of input
    finally:
        os.close(child)
        relay.finish()
        cooked.close()


def test_nothing_typed_after_finish_is_taken(term: Terminal) -> None:
    relay, child = _relay((term.slave, term.slave, term.slave))
    try:
        os.write(term.master, b"for the child")
        assert _read_exactly(child, 13) == b"for the child"
    finally:
        os.close(child)
        relay.finish()
    os.write(term.master, b"for the shell")
    time.sleep(SETTLE)
    assert _read_exactly(term.slave, 13) == b"for the shell"


def test_a_stdin_that_is_no_terminal_is_never_read(term: Terminal) -> None:
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"the child's own stdin")
    relay, child = _relay((read_fd, term.slave, term.slave))
    try:
        assert 0 not in relay.child_fds()
        os.write(child, b"x")
        assert _read_exactly(term.master, 1) == b"x"
    finally:
        os.close(child)
        relay.finish()
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as left:
        assert left.read() == b"the child's own stdin"


def test_a_stderr_that_is_no_terminal_goes_through_a_pipe_into_the_same_tail(
    term: Terminal, tmp_path: Path
) -> None:
    err = os.open(tmp_path / "stderr", os.O_WRONLY | os.O_CREAT, 0o600)
    relay = TerminalRelay.open((None, term.slave, err))
    assert relay is not None and relay.stderr is not None
    fds = relay.child_fds()
    assert fds[1] == relay.slave and fds[2] == relay.stderr.child_fd
    out_end, err_end = os.dup(fds[1]), os.dup(fds[2])
    relay.start()
    try:
        os.write(out_end, b"to the terminal;")
        assert _read_exactly(term.master, 16) == b"to the terminal;"
        os.write(err_end, b"to the file")
    finally:
        os.close(out_end)
        os.close(err_end)
        tail = relay.finish()
        os.close(err)
    assert (tmp_path / "stderr").read_bytes() == b"to the file"
    assert tail == b"to the terminal;to the file"


def test_the_window_size_is_copied_at_open_and_on_resize(term: Terminal) -> None:
    fcntl.ioctl(term.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 111, 0, 0))
    relay, child = _relay((None, term.slave, None))
    try:
        assert os.get_terminal_size(child) == os.terminal_size((111, 33))
        fcntl.ioctl(term.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 150, 0, 0))
        relay.resize()
        assert os.get_terminal_size(child) == os.terminal_size((150, 50))
    finally:
        os.close(child)
        relay.finish()


def test_tiocsti_on_the_childs_terminal_never_reaches_ours(term: Terminal) -> None:
    # Our stdin is no terminal here, so the relay never reads ours: anything waiting on it
    # afterwards could only have been pushed there by the child.
    null = os.open(os.devnull, os.O_RDONLY)
    relay, child = _relay((null, term.slave, term.slave))
    try:
        try:
            for byte in b"INJECTED\n":
                fcntl.ioctl(child, termios.TIOCSTI, bytes([byte]))
        except OSError as exc:  # not its controlling terminal: needs CAP_SYS_ADMIN
            pytest.skip(f"TIOCSTI refused here: {exc}")
        assert _read_exactly(child, 9) == b"INJECTED\n"  # typed into its own pty
    finally:
        os.close(child)
        relay.finish()
        os.close(null)
    assert _pending(term.slave) == 0
    assert not select.select([term.master], [], [], SETTLE)[0]


# -- as the terminal's foreground (or background) job: a forked child with its own session


def _own_terminal() -> Terminal:
    """A new session whose controlling terminal is a new pty (in a forked child only)."""
    os.setsid()
    terminal = Terminal.open(raw=False)
    fcntl.ioctl(terminal.slave, termios.TIOCSCTTY, 0)
    return terminal


def _wait_for_modes(fd: int, wanted: list[Any]) -> bool:
    deadline = time.monotonic() + IO_TIMEOUT
    while termios.tcgetattr(fd) != wanted:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _raw_relay_and_restore() -> dict[str, Any]:
    terminal = _own_terminal()
    before = termios.tcgetattr(terminal.slave)
    relay, child = _relay((terminal.slave, terminal.slave, terminal.slave))
    during = termios.tcgetattr(terminal.slave)
    child_modes = termios.tcgetattr(child)
    os.write(terminal.master, b"hi\r")  # a raw terminal sends \r; the child's pty makes \n
    got = _read_exactly(child, 3)
    os.close(child)  # the command is gone: the relay gives the terminal back at once
    restored_early = _wait_for_modes(terminal.slave, before)
    relay.finish()
    return {
        "raw": relay.raw,
        "canonical_during": bool(during[3] & termios.ICANON),
        "echo_during": bool(during[3] & termios.ECHO),
        "child_has_our_modes": child_modes == before,
        "got": got.decode(),
        "restored_early": restored_early,
        "restored": termios.tcgetattr(terminal.slave) == before,
    }


def test_the_foreground_job_relays_raw_and_restores_the_modes_exactly() -> None:
    result = fork_call(_raw_relay_and_restore)
    assert result == {
        "raw": True,
        "canonical_during": False,
        "echo_during": False,
        "child_has_our_modes": True,
        "got": "hi\n",
        "restored_early": True,
        "restored": True,
    }


def _abandoned_relay() -> dict[str, Any]:
    terminal = _own_terminal()
    before = termios.tcgetattr(terminal.slave)
    relay = TerminalRelay.open((terminal.slave, terminal.slave, terminal.slave))
    assert relay is not None
    relay.abandon()
    return {"raw": relay.raw, "same": termios.tcgetattr(terminal.slave) == before}


def test_an_abandoned_relay_leaves_the_modes_alone() -> None:
    assert fork_call(_abandoned_relay) == {"raw": True, "same": True}


def _background_relay() -> dict[str, Any]:
    terminal = _own_terminal()
    before = termios.tcgetattr(terminal.slave)
    other = os.fork()
    if other == 0:  # the terminal's foreground job: another process group of the session
        os.setpgid(0, 0)
        time.sleep(IO_TIMEOUT * 3)
        os._exit(0)
    try:
        os.setpgid(other, other)
        os.tcsetpgrp(terminal.slave, other)
        relay, child = _relay((terminal.slave, terminal.slave, terminal.slave))
        os.write(terminal.master, b"typed\n")
        time.sleep(SETTLE)
        waiting = _pending(terminal.slave)
        taken = select.select([child], [], [], 0)[0]
        # `fg`: the relay takes what is typed from then on (what waits, too).
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        os.tcsetpgrp(terminal.slave, os.getpgrp())
        after_fg = _read_exactly(child, 6)
        os.close(child)
        relay.finish()
    finally:
        os.kill(other, signal.SIGKILL)
        os.waitpid(other, 0)
    return {
        "raw": relay.raw,
        "waiting": waiting,
        "taken": bool(taken),
        "after_fg": after_fg.decode(),
        "same": termios.tcgetattr(terminal.slave) == before,
    }


def test_a_background_job_neither_reads_nor_changes_the_terminal() -> None:
    assert fork_call(_background_relay) == {
        "raw": False,
        "waiting": len(b"typed\n"),
        "taken": False,
        "after_fg": "typed\n",
        "same": True,
    }
