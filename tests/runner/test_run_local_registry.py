"""A local registry (an HTTP origin on the host's loopback) used from inside `egressbox run`.

Real curl inside `run`, through the proxy and captured (`--noproxy '*'`), as the invoking
user and as an unprivileged one. Judged from the host: the origin's own log of the requests
it served and the Host headers it saw, and the audit log. The learning workflow is run for
real: report mode, `audit --suggest-policy`, then the suggested policy enforced.
"""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from egressbox.runner.facts import host_facts
from unprivileged import Actor

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl"),
    pytest.mark.timeout(600),
]

RUN_TIMEOUT = 120.0


@dataclass
class Origin:
    """An HTTP origin on 127.0.0.1 that logs (path, Host) of every request it serves."""

    port: int = 0
    seen: list[tuple[str, str]] = field(default_factory=list)

    def paths(self) -> list[str]:
        return [path for path, _ in self.seen]


@pytest.fixture
def origin() -> Iterator[Origin]:
    found = Origin()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found.seen.append((self.path, self.headers.get("Host", "")))
            body = b"registry\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    found.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _needs_capture() -> None:
    facts = host_facts()
    if not {"network_namespace", "mount_namespace", "seccomp", "capture"} <= facts.available:
        pytest.skip(f"capture needs a network and mount namespace and seccomp: {facts.status}")


@dataclass
class Box:
    actor: Actor
    workspace: Path
    logs: Path

    def run(self, policy: Path, script: str, log: str) -> subprocess.CompletedProcess[str]:
        argv = [
            *self.actor.egressbox,
            "run",
            "--quiet",
            "--write-root",
            str(self.workspace),
            "--policy",
            str(policy),
            "--audit-log",
            str(self.logs / log),
            "--",
            "/bin/sh",
            "-c",
            script,
        ]
        command, env = self.actor.command(argv, self.actor.base_env(self.workspace))
        return subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=env,
            cwd=self.workspace,
            timeout=RUN_TIMEOUT,
            check=False,
        )

    def egressbox(self, *args: str) -> subprocess.CompletedProcess[str]:
        command, env = self.actor.command(
            [*self.actor.egressbox, *args], self.actor.base_env(self.workspace)
        )
        return subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT, check=False
        )

    def policy(self, name: str, text: str) -> Path:
        path = self.logs / name
        path.write_text(text)
        path.chmod(0o644)
        return path

    def records(self, log: str) -> list[tuple[str, str, int, str, str]]:
        lines = (self.logs / log).read_text().splitlines()
        found = [json.loads(line) for line in lines if line]
        return [(r["protocol"], r["host"], r["port"], r["decision"], r["reason"]) for r in found]


@pytest.fixture
def box(actor: Actor) -> Iterator[Box]:
    _needs_capture()
    workspace = actor.make_dir("/tmp", "egressbox-localreg-ws-")
    logs = actor.make_dir("/tmp", "egressbox-localreg-logs-")
    try:
        yield Box(actor, workspace, logs)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)


def _curl(url: str, *options: str) -> str:
    """One curl in the script: prints its status code (000 when refused), never fails it."""
    quoted = " ".join(f"'{o}'" for o in options)
    return f"curl -sS -o /dev/null -w '%{{http_code}}\\n' --max-time 20 {quoted} '{url}' 2>&1; "


def _explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-3000:]}"


def test_localhost_captured_and_proxied_with_any_spelling_of_host(box: Box, origin: Origin) -> None:
    port = origin.port
    policy = box.policy(
        "policy.toml",
        f'[egress]\nallow = ["localhost:{port}"]\nallow_cidrs = ["127.0.0.1/32", "::1/128"]\n',
    )
    local = f"http://localhost:{port}"
    script = (
        _curl(f"{local}/proxied")
        + _curl(f"{local}/captured", "--noproxy", "*")
        + _curl(f"http://127.0.0.1:{port}/literal", "--noproxy", "*")
        + _curl(f"{local}/upper", "--noproxy", "*", "-H", f"Host: LOCALHOST:{port}")
        + _curl(f"{local}/fronted", "--noproxy", "*", "-H", "Host: evil.example")
    )
    done = box.run(policy, script, "audit.jsonl")
    codes = [line for line in done.stdout.splitlines() if line.isdigit()]
    assert codes[:4] == ["200"] * 4, _explain(done)
    # Judged on the host: what the origin served, and the audit log.
    assert sorted(origin.paths()) == ["/captured", "/literal", "/proxied", "/upper"], _explain(done)
    assert "/fronted" not in origin.paths()
    records = box.records("audit.jsonl")
    assert ("tcp", "localhost", port, "deny", "host_mismatch") in records, records
    allowed = [r for r in records if r[3] == "allow" and r[0] != "dns"]
    assert {(r[1], r[2]) for r in allowed} == {("localhost", port)}, records


def test_an_ip_entry_takes_localhost_as_its_host_but_no_other_name(
    box: Box, origin: Origin
) -> None:
    port = origin.port
    policy = box.policy(
        "policy.toml", f'[egress]\nallow = ["127.0.0.1:{port}"]\nallow_cidrs = ["127.0.0.1"]\n'
    )
    literal = f"http://127.0.0.1:{port}"
    script = (
        _curl(f"{literal}/plain", "--noproxy", "*")
        + _curl(f"{literal}/named", "--noproxy", "*", "-H", f"Host: localhost:{port}")
        + _curl(f"{literal}/fronted", "--noproxy", "*", "-H", f"Host: other.localhost:{port}")
    )
    done = box.run(policy, script, "audit.jsonl")
    assert sorted(origin.paths()) == ["/named", "/plain"], _explain(done)
    assert ("tcp", "127.0.0.1", port, "deny", "host_mismatch") in box.records("audit.jsonl")


def test_a_local_registry_learned_in_report_mode_works_enforced(box: Box, origin: Origin) -> None:
    port = origin.port
    learn = box.policy("learn.toml", '[egress]\nmode = "report"\nallow = []\n')
    script = _curl(f"http://localhost:{port}/one") + _curl(
        f"http://127.0.0.1:{port}/two", "--noproxy", "*"
    )
    done = box.run(learn, script, "learn.jsonl")
    # Report mode lets no local address through: the log records the attempts.
    assert origin.paths() == [], _explain(done)
    learned = box.records("learn.jsonl")
    assert ("tcp", "127.0.0.1", port, "deny", "private_address") in learned, learned
    suggested = box.egressbox("audit", "--suggest-policy", str(box.logs / "learn.jsonl"))
    assert suggested.returncode == 0, _explain(suggested)
    text = suggested.stdout
    assert f'"localhost:{port}"' in text and f'"127.0.0.1:{port}"' in text, text
    assert '"127.0.0.1/32",' in text and "loopback" in text, text
    enforced = box.policy("enforced.toml", text)
    checked = box.egressbox("check", str(enforced))
    assert checked.returncode == 0 and "warning" not in checked.stdout, _explain(checked)
    origin.seen.clear()
    done = box.run(enforced, script, "enforced.jsonl")
    assert sorted(origin.paths()) == ["/one", "/two"], _explain(done)
    records = box.records("enforced.jsonl")
    assert all(r[3] == "allow" for r in records if r[0] != "dns"), records
