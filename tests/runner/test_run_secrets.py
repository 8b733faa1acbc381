"""Credential brokering inside `egressbox run`: the child holds a placeholder, the proxy puts
the real value into requests to the one host it is bound to.

Real clients inside the sandbox (curl, Python requests and httpx, git over HTTPS with
http.extraHeader) reach a loopback HTTPS origin (Python's ssl server, its certificate from a
test CA given as [tls] origin_ca) that accepts only the real token. Judged from the host: the
origin's log, the audit log, the run's output; the real value is searched for in every one of
them and in what the child saw of its environment and its CA bundle.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from egressbox.proxy.ca import CertificateAuthority
from egressbox.runner.facts import host_facts

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl"),
    pytest.mark.timeout(300),
]

TOKEN = "real-token-0b8d2c41e9"
RUN_TIMEOUT = 120.0
# An empty repository's ref advertisement (git's smart HTTP, protocol v0): `ls-remote` succeeds.
EMPTY_REFS = b"001e# service=git-upload-pack\n0000" + b"0000"


@dataclass
class Origin:
    port: int = 0
    seen: list[tuple[str, str, str, str]] = field(default_factory=list)  # method path auth agent

    def authorized(self) -> list[tuple[str, str]]:
        return [(p, agent.split("/")[0]) for _, p, auth, agent in self.seen if TOKEN in auth]


def _origin(context: ssl.SSLContext) -> tuple[Origin, http.server.ThreadingHTTPServer]:
    found = Origin()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            auth = self.headers.get("Authorization") or ""
            agent = self.headers.get("User-Agent") or ""
            found.seen.append((self.command, self.path, auth, agent))
            ok = TOKEN in auth
            body, kind = (b"welcome\n" if ok else b"no\n"), "text/plain"
            if ok and "/info/refs" in self.path:
                body, kind = EMPTY_REFS, "application/x-git-upload-pack-advertisement"
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    found.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return found, server


@dataclass
class Box:
    tmp: Path
    bound: Origin
    other: Origin
    origin_ca: Path

    def policy(self) -> Path:
        b, o = self.bound.port, self.other.port
        text = f"""
[egress]
allow = ["127.0.0.1:{b}", "127.0.0.1:{o}"]
allow_cidrs = ["127.0.0.1/32"]

[[secret]]
name = "API_TOKEN"
from_env = "EGRESSBOX_TEST_REAL"
hosts = ["127.0.0.1:{b}"]
header = "Authorization"
format = "Bearer {{value}}"

[[request_rule]]
hosts = ["127.0.0.1:{o}"]

[tls]
origin_ca = "{self.origin_ca}"
"""
        path = self.tmp / "policy.toml"
        path.write_text(text)
        return path

    def run(self, script: str) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, EGRESSBOX_TEST_REAL=TOKEN, API_TOKEN=TOKEN)  # granted or not
        argv = [
            sys.executable,
            "-m",
            "egressbox",
            "run",
            "--policy",
            str(self.policy()),
            "--audit-log",
            str(self.tmp / "audit.jsonl"),
            "--read-root",
            sys.prefix,
            "--grant",
            "API_TOKEN",
            "--",
            "/bin/sh",
            "-c",
            script,
        ]
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            env=env,
            cwd=self.tmp,
            timeout=RUN_TIMEOUT,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    def records(self) -> list[tuple[str, int, str, str]]:
        lines = (self.tmp / "audit.jsonl").read_text().splitlines()
        return [
            (r["protocol"], r["port"], r["decision"], r["reason"]) for r in map(json.loads, lines)
        ]


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    facts = host_facts()
    if not {"network_namespace", "mount_namespace"} <= facts.available:
        pytest.skip(f"the child's view needs a mount and network namespace: {facts.status}")
    tmp_path.chmod(0o755)
    ca = CertificateAuthority.generate()
    origin_ca = tmp_path / "origin-ca.pem"
    origin_ca.write_text(ca.cert_pem)
    bound, s1 = _origin(ca.server_context("127.0.0.1"))
    other, s2 = _origin(ca.server_context("127.0.0.1"))
    try:
        yield Box(tmp_path, bound, other, origin_ca)
    finally:
        for server in (s1, s2):
            server.shutdown()
            server.server_close()


def _python(code: str) -> str:
    return f"{sys.executable} -c '{code}'; "


def test_real_clients_reach_the_origin_with_the_value_they_never_hold(box: Box) -> None:
    url = f"https://127.0.0.1:{box.bound.port}"
    script = (
        'echo "env=$API_TOKEN"; '
        "cat /etc/ssl/certs/ca-certificates.crt > seen-bundle.pem; env > seen-env.txt; "
        f"curl -sS --max-time 20 {url}/curl; "
        f'curl -sS --max-time 20 -H "Authorization: token $API_TOKEN" {url}/curl-sent; '
        + _python(f'import requests; print(requests.get("{url}/requests", timeout=20).text)')
        + _python(f'import httpx; print(httpx.get("{url}/httpx", timeout=20).text)')
        + f'git -c http.extraHeader="Authorization: Bearer $API_TOKEN" ls-remote {url}/repo.git '
        "&& echo git-ok; "
        # The same placeholder to another allowed (terminated) host: refused.
        f'curl -sS -o /dev/null -w "other=%{{http_code}}\\n" -H "X-Key: $API_TOKEN" '
        f"https://127.0.0.1:{box.other.port}/leak"
    )
    done = box.run(script)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "env=egressbox-placeholder-API_TOKEN-" in done.stdout
    assert done.stdout.count("welcome") == 4 and "git-ok" in done.stdout, out
    assert "other=403" in done.stdout
    assert [agent for _, agent in box.bound.authorized()] == [
        "curl",
        "curl",
        "python-requests",
        "python-httpx",
        "git",
    ]
    assert box.other.seen == []
    records = box.records()
    assert ("connect", box.other.port, "deny", "secret_misdirected") in records
    # The child's view: its bundle is the system's plus the run's CA; its environment and
    # files hold the placeholder, never the value (and the host's bundle is untouched).
    bundle = (box.tmp / "seen-bundle.pem").read_text()
    assert bundle.count("BEGIN CERTIFICATE") >= 2
    assert bundle != Path("/etc/ssl/certs/ca-certificates.crt").read_text()
    seen_env = (box.tmp / "seen-env.txt").read_text()
    assert "REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt" in seen_env
    for text in (out, seen_env, bundle, (box.tmp / "audit.jsonl").read_text()):
        assert TOKEN not in text
