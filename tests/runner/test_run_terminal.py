"""`egressbox run` under a terminal: the command gets a new pty, never the caller's terminal.

Each test makes a pty that stands for the caller's terminal and starts the real CLI
(`egressbox run --policy policies/deny-all.toml -- ...`) as a session leader whose
controlling terminal it is, so `run` is that terminal's foreground job, as under a shell.
Everything is judged from this side: the device the child holds, the bytes that cross the
master, the terminal's modes before and after, and what waits as input on the terminal.

A TIOCSTI from the child could only reach this terminal if the child held it (on a std fd or
as /dev/tty). Seccomp refuses TIOCSTI anyway, so that case runs a second time with seccomp
planned away (a probe cache saying the host has none): the ioctl then works, on the child's
own pty. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pty
import random
import select
import shutil
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from unprivileged import CLEAN_PATH, invoking_actor, repo_root

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="egressbox run confines on Linux only"
)

RUN_TIMEOUT = 60.0
# Waiting for a marker the child prints.
READ_TIMEOUT = 30.0
DENY_ALL = repo_root() / "policies" / "deny-all.toml"
# Makes fd argv[1] (a terminal) the controlling terminal of this new session, then execs
# the rest: `egressbox run` starts as the terminal's foreground job.
SESSION_LEADER = (
    "import fcntl, os, sys, termios\n"
    "fcntl.ioctl(int(sys.argv[1]), termios.TIOCSCTTY, 0)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def _egressbox() -> list[str]:
    script = Path(sys.executable).parent / "egressbox"
    return [str(script)] if script.exists() else [sys.executable, "-m", "egressbox"]


@dataclass
class Terminal:
    """The caller's terminal: we type on and read `master`; `slave` is given to the run."""

    master: int
    slave: int
    seen: bytes = b""

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def read_until(self, marker: bytes, timeout: float = READ_TIMEOUT) -> bytes:
        deadline = time.monotonic() + timeout
        while marker not in self.seen and (left := deadline - time.monotonic()) > 0:
            self._read_some(min(left, 0.2))
        assert marker in self.seen, self.seen
        return self.seen

    def read_to_exit(self, proc: subprocess.Popen[bytes]) -> bytes:
        """Everything until the run has exited (our slave stays open: no EOF here)."""
        deadline = time.monotonic() + RUN_TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            self._read_some(0.2)
        while self._read_some(0.2):
            pass
        return self.seen

    def _read_some(self, timeout: float) -> bool:
        if not select.select([self.master], [], [], timeout)[0]:
            return False
        try:
            data = os.read(self.master, 65536)
        except OSError:
            return False
        self.seen += data
        return bool(data)

    def waiting_input(self) -> int:
        """Bytes waiting to be read on the terminal (what a shell would read next)."""
        count: int = struct.unpack("i", fcntl.ioctl(self.slave, termios.FIONREAD, b"\0" * 4))[0]
        return count


@dataclass
class Box:
    workspace: Path
    home: Path
    cache: Path

    def env(self, **extra: str) -> dict[str, str]:
        base = {"PATH": CLEAN_PATH, "HOME": str(self.home), "LANG": "C.UTF-8", "USER": "root"}
        base["XDG_CACHE_HOME"] = str(self.cache)
        return base | extra

    def start(
        self,
        term: Terminal,
        child: str,
        *,
        stdin: int | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """`egressbox run -- python -c CHILD` on `term` (stdin too, unless `stdin` is given)."""
        argv = [
            *_egressbox(),
            "run",
            "--quiet",
            "--policy",
            str(DENY_ALL),
            "--",
            invoking_actor().python,
            "-c",
            textwrap.dedent(child),
        ]
        return subprocess.Popen(
            [sys.executable, "-c", SESSION_LEADER, "1", *argv],
            stdin=term.slave if stdin is None else stdin,
            stdout=term.slave,
            stderr=term.slave,
            env=env or self.env(),
            cwd=self.workspace,
            start_new_session=True,
        )


@pytest.fixture
def box() -> Iterator[Box]:
    actor = invoking_actor()
    workspace = actor.make_dir("/tmp", "egressbox-tty-ws-")
    home = actor.make_dir("/tmp", "egressbox-tty-home-")
    cache = actor.make_dir("/tmp", "egressbox-tty-cache-")
    try:
        found = Box(workspace, home, cache)
        probe = subprocess.run(
            [*_egressbox(), "run", "--quiet", "--policy", str(DENY_ALL), "--", "true"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=found.env(),
            cwd=workspace,
            timeout=RUN_TIMEOUT,
            check=False,
        )
        if probe.returncode != 0:
            pytest.skip(f"egressbox run cannot confine here: {probe.stderr[-300:]!r}")
        yield found
    finally:
        for path in (workspace, home, cache):
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def term() -> Iterator[Terminal]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 41, 133, 0, 0))
    try:
        yield Terminal(master, slave)
    finally:
        os.close(master)
        os.close(slave)


def _finish(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=RUN_TIMEOUT)


def _report(seen: bytes, tag: str) -> dict[str, object]:
    """The JSON line the child printed after `tag`."""
    for line in seen.splitlines():
        if line.startswith(tag.encode()):
            found: dict[str, object] = json.loads(line[len(tag) :])
            return found
    raise AssertionError(f"no {tag} line in {seen!r}")


IDENTITY_CHILD = """
    import fcntl, json, os, struct, termios
    def sid(fd):
        tiocgsid = getattr(termios, "TIOCGSID", 0x5429)
        return struct.unpack("i", fcntl.ioctl(fd, tiocgsid, b"\\0" * 4))[0]
    devtty = os.open("/dev/tty", os.O_RDWR)
    report = {
        "isatty": [os.isatty(fd) for fd in (0, 1, 2)],
        "rdev": [os.fstat(fd).st_rdev for fd in (0, 1, 2)],
        "dev": [os.fstat(fd).st_dev for fd in (0, 1, 2)],
        "session": os.getsid(0),
        "tty_session": [sid(fd) for fd in (0, devtty)],
        "size": list(os.get_terminal_size(1)),
    }
    print("identity:" + json.dumps(report), flush=True)
"""


def test_the_child_holds_a_new_pty_not_our_terminal(box: Box, term: Terminal) -> None:
    proc = box.start(term, IDENTITY_CHILD)
    seen = term.read_to_exit(proc)
    assert _finish(proc) == 0, seen
    report = _report(seen, "identity:")
    ours = os.fstat(term.slave)
    assert report["isatty"] == [True, True, True]
    rdev, dev = report["rdev"], report["dev"]
    assert isinstance(rdev, list) and isinstance(dev, list)
    assert len(set(rdev)) == 1, "one pty on all three fds"
    assert rdev[0] != ours.st_rdev or dev[0] != ours.st_dev
    # The new pty is the child's controlling terminal (so /dev/tty is not ours either).
    assert report["tty_session"] == [report["session"], report["session"]]
    assert report["size"] == [133, 41]


ECHO_CHILD = """
    import sys
    print("ready", flush=True)
    line = sys.stdin.readline()
    print("got:" + line.strip().upper(), flush=True)
"""


def test_typed_input_and_output_cross_and_the_modes_come_back(box: Box, term: Terminal) -> None:
    before = termios.tcgetattr(term.slave)
    proc = box.start(term, ECHO_CHILD)
    try:
        term.read_until(b"ready")
        during = termios.tcgetattr(term.slave)
        term.type(b"hello\r")  # what a terminal sends for Enter; the child's pty makes it \n
        seen = term.read_to_exit(proc)
    finally:
        code = _finish(proc)
    assert code == 0, seen
    assert b"got:HELLO" in seen, seen
    assert not during[3] & termios.ICANON, "raw while relaying"
    assert termios.tcgetattr(term.slave) == before
    assert term.waiting_input() == 0


def test_ctrl_c_typed_interrupts_the_child(box: Box, term: Terminal) -> None:
    before = termios.tcgetattr(term.slave)
    proc = box.start(term, 'import time\nprint("ready", flush=True)\ntime.sleep(60)')
    try:
        term.read_until(b"ready")
        term.type(b"\x03")
        seen = term.read_to_exit(proc)
    finally:
        code = _finish(proc)
    # SIGINT from the child's own line discipline: KeyboardInterrupt, then death by SIGINT.
    assert code == 130, seen
    assert b"KeyboardInterrupt" in seen, seen
    assert termios.tcgetattr(term.slave) == before


TIOCSTI_CHILD = """
    import errno, fcntl, json, os, select, termios
    def push(fd):
        try:
            for byte in b"INJECTED\\n":
                fcntl.ioctl(fd, termios.TIOCSTI, bytes([byte]))
        except OSError as exc:
            return errno.errorcode.get(exc.errno, str(exc))
        return "ok"
    devtty = os.open("/dev/tty", os.O_RDWR)
    report = {"fd1": push(1), "devtty": push(devtty)}
    # Whatever was pushed waits on the child's own terminal.
    if select.select([devtty], [], [], 2)[0]:
        report["own_input"] = os.read(devtty, 100).decode()
    print("tiocsti:" + json.dumps(report), flush=True)
"""


def _env_without_seccomp(box: Box) -> dict[str, str]:
    """`run`'s environment on a host without pyseccomp: a module of that name that cannot be
    imported comes first on the path (a cached probe cannot take seccomp away: it is asked
    again, runner/facts.py)."""
    shadow = box.cache / "no-pyseccomp"
    shadow.mkdir(parents=True, exist_ok=True)
    (shadow / "pyseccomp.py").write_text("raise ImportError('no libseccomp here')\n")
    return box.env(PYTHONPATH=str(shadow))


@pytest.mark.parametrize("seccomp", ["loaded", "planned_away"])
def test_tiocsti_from_the_child_never_reaches_our_terminal(
    box: Box, term: Terminal, seccomp: str
) -> None:
    if seccomp == "planned_away":
        legacy = Path("/proc/sys/dev/tty/legacy_tiocsti")
        if legacy.exists() and legacy.read_text().strip() != "1":
            pytest.skip("this kernel refuses TIOCSTI without CAP_SYS_ADMIN anyway")
    env = _env_without_seccomp(box) if seccomp == "planned_away" else None
    before = termios.tcgetattr(term.slave)
    # stdin a pipe: `run` never reads our terminal, so whatever waits on it afterwards
    # could only have been pushed there by the child.
    proc = box.start(term, TIOCSTI_CHILD, stdin=subprocess.DEVNULL, env=env)
    seen = term.read_to_exit(proc)
    assert _finish(proc) == 0, seen
    report = _report(seen, "tiocsti:")
    if seccomp == "loaded":
        assert report["fd1"] == report["devtty"] == "EPERM", report
    else:  # the ioctl works, on the child's own pty only
        assert report == {"fd1": "ok", "devtty": "ok", "own_input": "INJECTED\n"}, report
    # Pushed into our terminal, it would wait there as input, and its echo would show.
    assert term.waiting_input() == 0
    assert b"INJECTED" not in seen.split(b"tiocsti:")[0], seen
    assert termios.tcgetattr(term.slave) == before


DIGEST_CHILD = """
    import hashlib, os, sys
    data = sys.stdin.buffer.read()
    tty = [os.isatty(fd) for fd in (0, 1, 2)]
    print("digest:", len(data), hashlib.sha256(data).hexdigest(), tty, flush=True)
"""


def test_piped_stdin_reaches_the_child_byte_exact(box: Box, term: Terminal) -> None:
    data = random.Random(5).randbytes(300_000) + bytes(range(256))
    proc = box.start(term, DIGEST_CHILD, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    pipe = proc.stdin

    def feed() -> None:
        with contextlib.suppress(BrokenPipeError):
            pipe.write(data)
        pipe.close()

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    seen = term.read_to_exit(proc)
    feeder.join(RUN_TIMEOUT)
    assert _finish(proc) == 0, seen
    line = next(line for line in seen.splitlines() if line.startswith(b"digest:"))
    expected = f"digest: {len(data)} {hashlib.sha256(data).hexdigest()} [False, True, True]"
    assert line.decode().strip() == expected


DENIED_CHILD = """
    import urllib.request
    print("ready", flush=True)
    try:
        urllib.request.urlopen("http://denied.example.invalid/", timeout=20)
    except Exception:
        pass
    print("after", flush=True)
"""


def test_our_lines_keep_the_terminals_line_discipline_while_raw(box: Box, term: Terminal) -> None:
    """A refusal line of ours, written while the relay holds the terminal raw, ends with
    CR LF: the command's next line starts at the left margin, not where ours ended."""
    argv = [*_egressbox(), "run", "--policy", str(DENY_ALL), "--"]
    argv += [invoking_actor().python, "-c", textwrap.dedent(DENIED_CHILD)]
    proc = subprocess.Popen(
        [sys.executable, "-c", SESSION_LEADER, "1", *argv],
        stdin=term.slave,
        stdout=term.slave,
        stderr=term.slave,
        env=box.env(),
        cwd=box.workspace,
        start_new_session=True,
    )
    try:
        term.read_until(b"ready")
        during = termios.tcgetattr(term.slave)
        seen = term.read_to_exit(proc)
    finally:
        code = _finish(proc)
    assert code == 0, seen
    assert not during[1] & termios.OPOST, "the relay holds the terminal raw"
    ours = [line for line in seen.split(b"\n") if b"egressbox: " in line and b"denied" in line]
    assert ours, seen
    assert all(line.endswith(b"\r") for line in ours), seen
    assert b"\r\nafter\r\n" in seen, seen
