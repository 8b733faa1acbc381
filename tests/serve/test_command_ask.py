"""`egressbox serve --ask-command CMD --save-approved FILE` as a real process: a real script
decides each destination no allow entry admits, curl goes through the proxy, the audit log
and the saved policy are read from the files afterwards (and the saved one passes `egressbox
check`), and the combinations that cannot work are usage errors (exit 2).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from dnsserver import A
from egressbox.core.policy import load_policy

if TYPE_CHECKING:
    from dnsserver import DnsServer
    from proxy_fixtures import Curl, HttpOrigin

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(sys.platform != "linux", reason="serve's contract is tested on Linux"),
]

READY_TIMEOUT = 20.0
EXIT_TIMEOUT = 20.0
POLL = 0.02
# The script's answers, by host: anything else is denied.
ASK_SCRIPT = """\
    read line
    printf '%s\\n' "$line" >> "$(dirname "$0")/asked.log"
    case "$EGRESSBOX_HOST" in
      session.test) echo session ;;
      once.test) echo once ;;
      slow.test) sleep 30 ;;
      *) echo deny ;;
    esac
"""


def _env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("EGRESSBOX_") or k == "EGRESSBOX_PURE"
    }


def _serve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "egressbox", "serve", *args]


async def _ready(proc: asyncio.subprocess.Process, out: Path, err: Path) -> dict[str, str]:
    async with asyncio.timeout(READY_TIMEOUT):
        while "\n" not in out.read_text():
            if proc.returncode is not None:
                pytest.fail(f"serve exited {proc.returncode}:\n{err.read_text()}")
            await asyncio.sleep(POLL)
    ready: dict[str, str] = json.loads(out.read_text().split("\n", 1)[0])
    return ready


@pytest.fixture
def setup(tmp_path: Path, zone: DnsServer) -> Path:
    for name in ("session.test", "once.test", "no.test", "blocked.test", "slow.test"):
        zone.set(name, A("127.0.0.1"))
    script = tmp_path / "ask.sh"
    script.write_text("#!/bin/sh\n" + textwrap.dedent(ASK_SCRIPT))
    script.chmod(0o755)
    policy = tmp_path / "policy.toml"
    policy.write_text(
        '[egress]\nallow = ["origin.test"]\ndeny = ["blocked.test"]\n'
        'allow_cidrs = ["127.0.0.1/32"]\n'
    )
    return tmp_path


async def test_serve_asks_the_command_audits_and_saves_what_it_approved(
    setup: Path, zone: DnsServer, origin: HttpOrigin, curl: Curl
) -> None:
    host, port = zone.nameserver
    out, err = setup / "serve.stdout", setup / "serve.stderr"
    saved, log = setup / "approved.toml", setup / "audit.jsonl"
    argv = _serve_argv(
        "--policy",
        str(setup / "policy.toml"),
        "--nameserver",
        f"{host}:{port}",
        "--audit-log",
        str(log),
        "--ask-command",
        f"{setup / 'ask.sh'}",
        "--ask-timeout",
        "2",
        "--save-approved",
        str(saved),
    )
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=_env()
        )
    try:
        ready = await _ready(proc, out, err)
        proxy = f"http://{ready['http']}"
        fetched: dict[str, list[bool]] = {}
        for name in ("session.test", "session.test", "once.test", "once.test", "no.test"):
            result = await curl("-x", proxy, origin.url(name), check=False)
            fetched.setdefault(name, []).append(b"hello from" in result.stdout)
        for name in ("blocked.test", "slow.test"):
            result = await curl("-x", proxy, "-D", "-", origin.url(name), check=False)
            fetched[name] = [b"hello from" in result.stdout]
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), EXIT_TIMEOUT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 0, err.read_text()
    assert fetched == {
        "session.test": [True, True],
        "once.test": [True, True],
        "no.test": [False],
        "blocked.test": [False],
        "slow.test": [False],
    }
    asked = [json.loads(line)["host"] for line in (setup / "asked.log").read_text().splitlines()]
    assert asked == ["session.test", "once.test", "once.test", "no.test", "slow.test"]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["host"], r["decision"], r["reason"]) for r in records] == [
        ("session.test", "allow", "approved_session"),
        ("session.test", "allow", "approved_session"),
        ("once.test", "allow", "approved"),
        ("once.test", "allow", "approved"),
        ("no.test", "deny", "approval_denied"),
        ("blocked.test", "deny", "deny_rule"),
        ("slow.test", "deny", "approval_timeout"),
    ]
    assert "--save-approved: wrote" in err.read_text()
    check = subprocess.run(
        [sys.executable, "-m", "egressbox", "check", str(saved)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=_env(),
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert [rule.text for rule in load_policy(str(saved)).allow.rules] == [
        f"session.test:{origin.port}"
    ]
    assert f'# "once.test:{origin.port}",' in saved.read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ask-command", "ASK", "--workers", "2"], "cannot be combined with --workers"),
        (["--save-approved", "out.toml"], "--save-approved needs --ask-command"),
        (["--ask-command", "no-such-asker-program"], "not an executable program"),
        (["--ask-command", ""], "empty command"),
        (["--ask-command", "ASK", "--ask-timeout", "0"], "more than 0 seconds"),
    ],
)
def test_what_cannot_work_is_a_usage_error(setup: Path, args: list[str], message: str) -> None:
    args = [str(setup / "ask.sh") if a == "ASK" else a for a in args]
    done = subprocess.run(
        _serve_argv("--policy", str(setup / "policy.toml"), *args),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=_env(),
        cwd=setup,
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert done.stdout == ""
