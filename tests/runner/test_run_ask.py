"""`egressbox run --ask` and `--ask-command`: a confined curl asks for a destination no allow
entry admits, and the question is answered at the caller's terminal (a pty this test holds,
the run's controlling terminal, as under a shell) or by a real script; `egressbox.run(...,
on_miss=...)` is the library's way.

Judged from the host side: what crossed the terminal (the prompt, the command's output after
it), the terminal's modes after the run, the audit log file, the saved policy (`egressbox
check` accepts it) and the run's exit code. The origin and the DNS server are on 127.0.0.1;
the child reaches them only through the run's proxy. Every wait is bounded.
"""

from __future__ import annotations

import http.server
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import termios
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from dnsserver import A
from egressbox.core.policy import load_policy, parse_policy
from egressbox.proxy.approval import Answer, Approved, MissRequest
from egressbox.runner.api import run
from egressbox.runner.facts import host_facts
from unprivileged import CLEAN_PATH, invoking_actor

if TYPE_CHECKING:
    from dnsserver import DnsServer

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    pytest.mark.timeout(180),
]

RUN_TIMEOUT = 90.0
READ_TIMEOUT = 30.0
CURL_TIMEOUT = 20
PROMPT = b"Allow? [o]nce, [s]ession, [d]eny"
# Makes fd argv[1] (a terminal) the controlling terminal of this new session, then execs
# the rest: `egressbox run` starts as the terminal's foreground job.
SESSION_LEADER = (
    "import fcntl, os, sys, termios\n"
    "fcntl.ioctl(int(sys.argv[1]), termios.TIOCSCTTY, 0)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
ASK_SCRIPT = """\
    read line
    printf '%s\\n' "$line" >> "$(dirname "$0")/asked.log"
    case "$EGRESSBOX_HOST" in
      session.test|ten.test) echo session ;;
      once.test) echo once ;;
      *) echo deny ;;
    esac
"""


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"hello {self.headers.get('Host', '')}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def origin_port() -> Iterator[int]:
    """A threaded HTTP origin on 127.0.0.1 (runs while the blocking CLI does)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(READ_TIMEOUT)


@dataclass
class Box:
    root: Path
    workspace: Path
    policy: Path
    nameserver: str

    def env(self) -> dict[str, str]:
        home = self.root / "home"
        home.mkdir(exist_ok=True)
        return {
            "PATH": CLEAN_PATH,
            "HOME": str(home),
            "LANG": "C.UTF-8",
            "USER": "root",
            "XDG_CACHE_HOME": str(self.root / "cache"),
            **({"EGRESSBOX_PURE": "1"} if os.environ.get("EGRESSBOX_PURE") == "1" else {}),
        }

    def argv(self, *options: str, urls: list[str]) -> list[str]:
        curl = ["curl", "-q", "-sS", "-f", "--max-time", str(CURL_TIMEOUT), *urls]
        return [
            *_egressbox(),
            "run",
            "--policy",
            str(self.policy),
            "--nameserver",
            self.nameserver,
            "--audit-log",
            str(self.root / "audit.jsonl"),
            *options,
            "--",
            *curl,
        ]

    def records(self) -> list[tuple[str, str, str]]:
        lines = (self.root / "audit.jsonl").read_text().splitlines()
        return [(item["host"], item["decision"], item["reason"]) for item in map(json.loads, lines)]


def _egressbox() -> list[str]:
    script = Path(sys.executable).parent / "egressbox"
    return [str(script)] if script.exists() else [sys.executable, "-m", "egressbox"]


@pytest.fixture
def box(tmp_path: Path, zone: DnsServer) -> Iterator[Box]:
    missing = {"network_namespace"} - host_facts().available
    if missing:
        pytest.skip(f"this host lacks {sorted(missing)}")
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    for name in ("session.test", "once.test", "no.test", "ten.test"):
        zone.set(name, A("10.0.0.1" if name == "ten.test" else "127.0.0.1"))
    workspace = invoking_actor().make_dir("/tmp", "egressbox-ask-ws-")
    policy = tmp_path / "policy.toml"
    policy.write_text('[egress]\nallow = ["origin.test"]\nallow_cidrs = ["127.0.0.1/32"]\n')
    script = tmp_path / "ask.sh"
    script.write_text("#!/bin/sh\n" + textwrap.dedent(ASK_SCRIPT))
    script.chmod(0o755)
    host, port = zone.nameserver
    try:
        yield Box(tmp_path, workspace, policy, f"{host}:{port}")
    finally:
        shutil.rmtree(workspace, ignore_errors=True)


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_egressbox(), "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": CLEAN_PATH},
    )


# -- --ask-command ----------------------------------------------------------------------------


def test_ask_command_decides_for_a_confined_curl(box: Box, origin_port: int) -> None:
    saved = box.root / "approved.toml"
    urls = [f"http://{name}:{origin_port}/" for name in ("once.test", "once.test", "session.test")]
    urls += [f"http://session.test:{origin_port}/"]
    argv = box.argv(
        "--ask-command", str(box.root / "ask.sh"), "--save-approved", str(saved), urls=urls
    )
    done = subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
        env=box.env(),
        cwd=box.workspace,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(f"hello once.test:{origin_port}") == 2
    assert done.stdout.count(f"hello session.test:{origin_port}") == 2
    asked = [json.loads(line) for line in (box.root / "asked.log").read_text().splitlines()]
    assert [(a["host"], a["port"]) for a in asked] == [
        ("once.test", origin_port),
        ("once.test", origin_port),
        ("session.test", origin_port),
    ]
    assert box.records() == [
        ("once.test", "allow", "approved"),
        ("once.test", "allow", "approved"),
        ("session.test", "allow", "approved_session"),
        ("session.test", "allow", "approved_session"),
    ]
    checked = _check(saved)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rules = [rule.text for rule in load_policy(str(saved)).allow.rules]
    assert rules == [f"session.test:{origin_port}"]


def test_ask_command_denial_is_the_runs_egress_refusal(box: Box, origin_port: int) -> None:
    argv = box.argv(
        "--ask-command",
        str(box.root / "ask.sh"),
        urls=[f"http://no.test:{origin_port}/", f"http://ten.test:{origin_port}/"],
    )
    done = subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
        env=box.env(),
        cwd=box.workspace,
    )
    assert done.returncode != 0
    assert "refused by egress" in done.stderr and "approval_denied" in done.stderr, done.stderr
    # ten.test is approved, but it resolves to 10.0.0.1: the address ban still holds.
    assert box.records() == [
        ("no.test", "deny", "approval_denied"),
        ("ten.test", "deny", "private_address"),
    ]


def test_ask_without_a_terminal_is_a_usage_error(box: Box, origin_port: int) -> None:
    for options in (["--ask"], ["--save-approved", str(box.root / "x.toml")]):
        done = subprocess.run(
            box.argv(*options, urls=[f"http://once.test:{origin_port}/"]),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            check=False,
            env=box.env(),
            cwd=box.workspace,
        )
        assert done.returncode == 2, done.stderr
        assert "--ask" in done.stderr


# -- --ask at a terminal ---------------------------------------------------------------------


@dataclass
class Terminal:
    master: int
    slave: int
    seen: bytes = b""

    def read_until(self, marker: bytes, count: int = 1) -> None:
        deadline = time.monotonic() + READ_TIMEOUT
        while self.seen.count(marker) < count and (left := deadline - time.monotonic()) > 0:
            self._read_some(min(left, 0.2))
        assert self.seen.count(marker) >= count, self.seen

    def read_to_exit(self, proc: subprocess.Popen[bytes]) -> bytes:
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


@pytest.fixture
def term() -> Iterator[Terminal]:
    master, slave = pty.openpty()
    try:
        yield Terminal(master, slave)
    finally:
        os.close(master)
        os.close(slave)


def _start_on(term: Terminal, box: Box, argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", SESSION_LEADER, "0", *argv],
        stdin=term.slave,
        stdout=term.slave,
        stderr=term.slave,
        env=box.env(),
        cwd=box.workspace,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=RUN_TIMEOUT)


def test_ask_at_the_terminal_session_then_no_more_questions(
    box: Box, term: Terminal, origin_port: int
) -> None:
    saved = box.root / "approved.toml"
    url = f"http://session.test:{origin_port}/"
    before = termios.tcgetattr(term.slave)
    proc = _start_on(term, box, box.argv("--ask", "--save-approved", str(saved), urls=[url, url]))
    try:
        term.read_until(PROMPT)
        assert b"session.test:%d: no allow entry admits it" % origin_port in term.seen
        os.write(term.master, b"s")
        seen = term.read_to_exit(proc)
    finally:
        code = _finish(proc)
    assert code == 0, seen
    assert seen.count(PROMPT) == 1, seen
    assert seen.count(b"hello session.test:%d" % origin_port) == 2, seen
    assert termios.tcgetattr(term.slave) == before
    assert box.records() == [("session.test", "allow", "approved_session")] * 2
    checked = _check(saved)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert [rule.text for rule in load_policy(str(saved)).allow.rules] == [
        f"session.test:{origin_port}"
    ]


def test_ask_at_the_terminal_once_asks_each_time_and_deny_refuses(
    box: Box, term: Terminal, origin_port: int
) -> None:
    urls = [f"http://once.test:{origin_port}/"] * 2 + [f"http://no.test:{origin_port}/"]
    before = termios.tcgetattr(term.slave)
    proc = _start_on(term, box, box.argv("--ask", urls=urls))
    try:
        for count, key in enumerate((b"o", b"o", b"d"), start=1):
            term.read_until(PROMPT, count)
            os.write(term.master, key)
        seen = term.read_to_exit(proc)
    finally:
        code = _finish(proc)
    assert code != 0, seen  # curl -f: the denied third URL fails the command
    assert seen.count(b"hello once.test:%d" % origin_port) == 2, seen
    assert b"refused by egress" in seen and b"approval_denied" in seen, seen
    assert termios.tcgetattr(term.slave) == before
    assert box.records() == [
        ("once.test", "allow", "approved"),
        ("once.test", "allow", "approved"),
        ("no.test", "deny", "approval_denied"),
    ]


def test_an_unanswered_prompt_times_out(box: Box, term: Terminal, origin_port: int) -> None:
    url = f"http://once.test:{origin_port}/"
    proc = _start_on(term, box, box.argv("--ask", "--ask-timeout", "1", urls=[url]))
    try:
        term.read_until(PROMPT)
        seen = term.read_to_exit(proc)
    finally:
        code = _finish(proc)
    assert code != 0, seen
    assert b"no answer: denied" in seen, seen
    assert box.records() == [("once.test", "deny", "approval_timeout")]


def test_a_command_that_exits_under_a_prompt_leaves_the_terminal_as_it_was(
    box: Box, term: Terminal, origin_port: int
) -> None:
    # curl gives up (--max-time 2) while the question is still on the terminal.
    url = f"http://once.test:{origin_port}/"
    argv = box.argv("--ask", urls=[url])
    argv[argv.index(str(CURL_TIMEOUT))] = "2"
    before = termios.tcgetattr(term.slave)
    proc = _start_on(term, box, argv)
    try:
        term.read_until(PROMPT)
        seen = term.read_to_exit(proc)
    finally:
        code = _finish(proc)
    assert code == 28, seen  # curl: operation timed out
    assert b"no answer: denied" in seen, seen
    assert termios.tcgetattr(term.slave) == before
    assert box.records() == [("once.test", "deny", "approval_denied")]


# -- the library ------------------------------------------------------------------------------


async def test_the_library_asks_on_miss(box: Box, origin_port: int, zone: DnsServer) -> None:
    asked: list[MissRequest] = []

    async def on_miss(request: MissRequest) -> str:
        asked.append(request)
        return "session" if request.host == "session.test" else "deny"

    policy = parse_policy(
        {"egress": {"allow": ["origin.test"], "allow_cidrs": ["127.0.0.1/32"]}}, env={}
    )
    urls = [f"http://session.test:{origin_port}/"] * 2
    result = await run(
        ["curl", "-q", "-sS", "-f", "--max-time", str(CURL_TIMEOUT), *urls],
        policy=policy,
        on_miss=on_miss,
        nameservers=[zone.nameserver],
        capture_output=True,
        cwd=str(box.workspace),
        write_roots=[str(box.workspace)],
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout is not None
    assert result.stdout.count(b"hello session.test") == 2
    assert asked == [MissRequest("http", "session.test", origin_port)]
    assert [r.reason.value for r in result.records] == ["approved_session"] * 2
    assert result.approved == [Approved("session.test", origin_port, Answer.SESSION)]
