"""`run --ask`: a destination no allow entry admits is asked about at the caller's terminal.

The question (proxy/approval.py) is asked on the caller's terminal, `/dev/tty` (else the
terminal on our fd 0), never on the command's own pty. While it is up the terminal relay
(stderr_tee.TerminalRelay.hold) copies nothing either way: the command's output waits in its
pty, and nothing typed reaches the command. Keys typed before the prompt appeared are dropped,
so type-ahead meant for the command never answers it. One key answers: `o` (or `y`) allows
once, `s` (or `a`) for the session, `d` (or `n`, Esc, Ctrl-C, Ctrl-D) denies; other keys are
ignored. The terminal's modes are set for the one key and put back exactly as they were.

Questions are asked one at a time; each waits its turn within its own timeout. Light at import
(no asyncio): `run` builds its options before it forks the launcher.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

    from egressbox.proxy.approval import Answer, Decider, MissRequest
    from egressbox.runner.terminal import StderrTee, TerminalRelay

# How often the prompt looks whether its question was withdrawn (a timeout, the run ending).
POLL_SECONDS = 0.1
KEYS = {
    "once": b"oOyY",
    "session": b"sSaA",
    "deny": b"dDnN\x1b\x03\x04",
}


class TerminalPrompt:
    """A decider that asks the person at the caller's terminal (see the module docstring)."""

    def __init__(
        self, timeout: float, *, relay: TerminalRelay | None = None, tty: str = "/dev/tty"
    ) -> None:
        self.timeout = timeout  # the question's timeout, to say how long is left
        self.relay = relay
        self.tty = tty
        self._turn: asyncio.Lock | None = None

    async def __call__(self, request: MissRequest) -> Answer:
        import asyncio

        from egressbox.proxy.approval import Answer

        deadline = time.monotonic() + self.timeout
        if self._turn is None:
            self._turn = asyncio.Lock()
        async with self._turn:
            loop = asyncio.get_running_loop()
            done: asyncio.Future[str] = loop.create_future()
            withdrawn = threading.Event()

            def answered(text: str) -> None:
                if not done.done():
                    done.set_result(text)

            def ask() -> None:
                text = "deny"
                try:
                    text = self._ask(request, deadline, withdrawn)
                finally:
                    with contextlib.suppress(RuntimeError):  # the loop is gone
                        loop.call_soon_threadsafe(answered, text)

            # A thread of its own (a daemon): a terminal that blocks our writes must not
            # hold up the interpreter's exit.
            threading.Thread(target=ask, name="egressbox-ask", daemon=True).start()
            try:
                return Answer(await asyncio.shield(done))
            except asyncio.CancelledError:
                withdrawn.set()  # the prompt says so and gives the terminal back
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(done), 1.0)
                raise

    def _ask(self, request: MissRequest, deadline: float, withdrawn: threading.Event) -> str:
        """In the prompt's thread: the answer's text ("deny" when nobody can be asked)."""
        import signal

        # Never stopped by job control: in the background, reads fail and we wait.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTIN, signal.SIGTTOU})
        fd = _open_terminal(self.tty)
        if fd is None:
            return "deny"
        relay = self.relay
        try:
            if relay is not None:
                relay.hold()
            try:
                return _prompt(fd, request, deadline, withdrawn)
            finally:
                if relay is not None:
                    relay.release()
        finally:
            os.close(fd)


def for_run(decider: Decider, tee: StderrTee | TerminalRelay | None) -> Decider:
    """The run's decider: a terminal prompt learns the run's terminal relay (to hold it)."""
    from egressbox.runner.terminal import TerminalRelay

    if isinstance(decider, TerminalPrompt):
        decider.relay = tee if isinstance(tee, TerminalRelay) else None
    return decider


def _open_terminal(path: str) -> int | None:
    flags = os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC
    for candidate in (path, "/proc/self/fd/0"):
        with contextlib.suppress(OSError):
            fd = os.open(candidate, flags)
            if os.isatty(fd):
                return fd
            os.close(fd)
    return None


def _prompt(fd: int, request: MissRequest, deadline: float, withdrawn: threading.Event) -> str:
    """Ask on the terminal `fd` with one-key input; its modes come back as they were."""
    import termios

    try:
        saved = termios.tcgetattr(fd)
    except termios.error:
        return "deny"
    try:
        termios.tcsetattr(fd, termios.TCSANOW, _one_key(saved))
        termios.tcflush(fd, termios.TCIFLUSH)  # type-ahead was meant for the command
        left = max(1, round(deadline - time.monotonic()))
        _write(
            fd,
            # Every protocol a shared question covers (what a once answer admits).
            f"\r\negressbox: {'/'.join(request.protocols)} {request.authority}:"
            " no allow entry admits it."
            f" Allow? [o]nce, [s]ession, [d]eny (denied in {left} s): ",
        )
        answer = _read_key(fd, deadline, withdrawn)
        _write(fd, (answer or "no answer: denied") + "\r\n")
        return answer or "deny"
    finally:
        with contextlib.suppress(termios.error):
            termios.tcsetattr(fd, termios.TCSANOW, saved)


def _one_key(modes: list[Any]) -> list[Any]:
    """`modes` reading one key at a time, unechoed, Ctrl-C a key like any other."""
    import termios

    changed = list(modes)
    changed[3] &= ~(termios.ICANON | termios.ECHO | termios.ISIG | termios.IEXTEN)
    cc = list(changed[6])
    cc[termios.VMIN] = 1
    cc[termios.VTIME] = 0
    changed[6] = cc
    return changed


def _read_key(fd: int, deadline: float, withdrawn: threading.Event) -> str | None:
    """The answer typed, or None: withdrawn, timed out, or the terminal hung up."""
    while not withdrawn.is_set() and time.monotonic() < deadline:
        if not select.select([fd], [], [], POLL_SECONDS)[0]:
            continue
        try:
            data = os.read(fd, 64)
        except (BlockingIOError, InterruptedError):
            continue
        except OSError:  # EIO: a background job now (or a hangup): wait, bounded
            withdrawn.wait(POLL_SECONDS)
            continue
        if not data:
            return None
        for key in data:
            for answer, keys in KEYS.items():
                if key in keys:
                    return answer
    return None


def _write(fd: int, text: str) -> None:
    view = memoryview(text.encode("utf-8", "replace"))
    while view:
        try:
            written = os.write(fd, view)
        except (BlockingIOError, InterruptedError):
            select.select([], [fd], [], POLL_SECONDS)
            continue
        except OSError:
            return  # the terminal is gone: the answer will be "deny"
        view = view[written:]
