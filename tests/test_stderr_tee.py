"""The stderr pass-through (stderr_tee.py): bytes copied unchanged, a bounded tail, a bounded
wait at the end, and a pty when the target is a terminal. The "child" here is a descriptor
duplicated from the child's end before the tee starts."""

from __future__ import annotations

import os
import pty
import random
import time
from pathlib import Path

from egressbox.confine.refusal import TAIL_BYTES as REFUSAL_TAIL_BYTES
from egressbox.stderr_tee import TAIL_BYTES, StderrTee

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
