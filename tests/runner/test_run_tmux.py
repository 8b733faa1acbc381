"""`egressbox run` inside a real tmux pane: what the command writes reaches tmux only through
the relay's filter (runner/vtfilter.py).

tmux runs on a private socket with `set-clipboard on`, so an OSC 52 written in a pane lands
in tmux's paste buffers, and tmux answers the queries a terminal answers (DA, DSR, CPR,
colour, XTVERSION) by typing into the pane. Each case runs a control first, the same bytes
written straight into a pane, to show that this tmux does act on them; then the same
through `egressbox run`, judged from tmux's side: its paste buffers, and what waits as
input on the pane's terminal after the run (read there by a process outside egressbox).
Every wait is bounded.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from unprivileged import CLEAN_PATH, invoking_actor, repo_root

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="egressbox run confines on Linux only"
)

TMUX = shutil.which("tmux")
DENY_ALL = repo_root() / "policies" / "deny-all.toml"
RUN_TIMEOUT = 90.0
TMUX_TIMEOUT = 20.0
# How long the child (or the control) waits for answers typed into its terminal.
ANSWER_WAIT = 1.5

# Writes the queries a terminal answers, then reports (hex) what reached its stdin.
QUERY_CHILD = """
import os, select, sys, termios, time, tty
tty.setraw(0)
sys.stdout.buffer.write(
    b"\\x1b[c\\x1b[>c\\x1b[5n\\x1b[6n\\x1b]11;?\\x07\\x1b]10;?\\x1b\\\\"
    b"\\x1b[>q\\x1b[21t\\x1bP$qm\\x1b\\\\\\x1b[?2004$p"
)
sys.stdout.flush()
got, deadline = b"", time.monotonic() + float(sys.argv[2])
while (left := deadline - time.monotonic()) > 0:
    if select.select([0], [], [], left)[0]:
        got += os.read(0, 4096)
open(sys.argv[1], "w").write(got.hex())
"""
# Outside egressbox, after it: what waits as input on the pane's terminal (hex).
DRAIN = """
import fcntl, os, struct, sys, termios, time, tty
tty.setraw(0)
time.sleep(0.5)
waiting = struct.unpack("i", fcntl.ioctl(0, termios.FIONREAD, b"\\0" * 4))[0]
open(sys.argv[1], "w").write(os.read(0, waiting).hex() if waiting else "")
"""


@dataclass
class Tmux:
    socket: Path
    workspace: Path
    home: Path

    def tmux(self, *args: str) -> subprocess.CompletedProcess[str]:
        assert TMUX is not None
        return subprocess.run(
            [TMUX, "-S", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=TMUX_TIMEOUT,
            check=False,
        )

    def run_in_pane(self, script: str) -> int:
        """`script` (sh) in a new pane, as the pane's foreground job; its exit status."""
        done = self.workspace / f"done-{uuid.uuid4().hex}"
        wrapped = f"{script}; echo $? > {shlex.quote(str(done))}"
        pane = ("new-window", "-d", "-c", str(self.workspace), f"sh -c {shlex.quote(wrapped)}")
        started = self.tmux(*pane)
        assert started.returncode == 0, started.stderr
        deadline = time.monotonic() + RUN_TIMEOUT
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert done.exists(), "the pane's command never ended"
        return int(done.read_text())

    def egressbox(self, *args: str) -> str:
        """The shell words that run `egressbox run ARGS` with a clean environment."""
        env = {
            "PATH": CLEAN_PATH,
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "TERM": "tmux-256color",
        }
        if os.environ.get("EGRESSBOX_PURE"):
            env["EGRESSBOX_PURE"] = os.environ["EGRESSBOX_PURE"]
        words = [
            "env",
            "-i",
            *(f"{k}={v}" for k, v in env.items()),
            invoking_actor().python,
            "-m",
            "egressbox",
            "run",
            "--policy",
            str(DENY_ALL),
            *args,
        ]
        return " ".join(shlex.quote(w) for w in words)

    def buffers(self) -> str:
        """Every paste buffer's contents."""
        names = self.tmux("list-buffers", "-F", "#{buffer_name}").stdout.split()
        return "\n".join(self.tmux("show-buffer", "-b", name).stdout for name in names)


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    if TMUX is None:
        pytest.skip("tmux is not installed (scripts/setup --test installs it)")
    box = Tmux(tmp_path / "tmux.sock", tmp_path / "ws", tmp_path / "home")
    box.workspace.mkdir()
    box.home.mkdir()
    size = ("-x", "120", "-y", "40")
    started = box.tmux("-f", "/dev/null", "new-session", "-d", "-c", str(box.workspace), *size)
    if started.returncode != 0:
        pytest.skip(f"tmux cannot start here: {started.stderr.strip()}")
    try:
        assert box.tmux("set-option", "-s", "set-clipboard", "on").returncode == 0
        probe = box.workspace / "probe.out"
        if box.run_in_pane(f"{box.egressbox('--quiet', '--', 'true')} 2> {probe}") != 0:
            pytest.skip(f"egressbox run cannot confine here: {probe.read_text()[-300:]}")
        yield box
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            box.tmux("kill-server")


def _osc52(text: str) -> str:
    """printf words writing an OSC 52 that sets the clipboard to `text`."""
    payload = base64.b64encode(text.encode()).decode()
    return f"printf '\\033]52;c;{payload}\\a'"


def test_osc52_from_the_command_never_reaches_tmuxs_clipboard(tmux: Tmux) -> None:
    control, secret = f"control-{uuid.uuid4().hex}", f"child-{uuid.uuid4().hex}"
    # The control: the same printf straight in a pane fills a paste buffer.
    tmux.run_in_pane(_osc52(control))
    assert control in tmux.buffers(), "this tmux ignores OSC 52: the test could see nothing"
    report = tmux.workspace / "report.txt"
    command = tmux.egressbox("--report", "--", "sh", "-c", _osc52(secret))
    tmux.run_in_pane(f"{command} 2> {shlex.quote(str(report))}")
    assert secret not in tmux.buffers()
    assert "terminal: dropped escape sequences that reach beyond the screen: clipboard 1" in (
        report.read_text()
    ), report.read_text()


def test_queries_from_the_command_get_no_answer_typed_in(tmux: Tmux) -> None:
    python = invoking_actor().python
    control = tmux.workspace / "control.hex"
    child = tmux.workspace / "child.hex"
    after = tmux.workspace / "after.hex"
    script = shlex.quote(QUERY_CHILD)
    # The control: run straight in a pane, the child's stdin gets tmux's answers.
    tmux.run_in_pane(f"{python} -c {script} {control} {ANSWER_WAIT}")
    answers = bytes.fromhex(control.read_text())
    assert b"\x1b[?1;2c" in answers and b"R" in answers, answers  # DA1, CPR
    # Through egressbox: nothing is typed into the child's terminal, nor into the pane's
    # once the run is over (where a shell would read it as a command).
    errors = tmux.workspace / "errors.txt"
    command = tmux.egressbox("--quiet", "--", python, "-c", QUERY_CHILD, str(child))
    drain = f"{python} -c {shlex.quote(DRAIN)} {after}"
    code = tmux.run_in_pane(f"{command} {ANSWER_WAIT} 2> {errors}; {drain}")
    assert code == 0 and child.exists(), errors.read_text()
    assert after.read_text() == "", bytes.fromhex(after.read_text())
    assert child.read_text() == "", bytes.fromhex(child.read_text())
