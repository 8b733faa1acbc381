"""Every TCP client works unchanged inside `egressbox run`, with every proxy variable removed:
names the policy could admit resolve (to synthetic addresses egressbox maps back), every
connection is captured and decided as `name:port`, everything else is refused and audited.

The origins and the upstream DNS server are the tests' own, on the host's loopback; the child
reaches them only through the proxy. Judged from the host side: the origin's request log, the
DNS server's query log, the audit log. Every wait is bounded.
"""

from __future__ import annotations

import http.server
import ipaddress
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dnsserver import A, DnsServer
from egressbox.core.synthetic import V4_NETWORK, V6_NETWORK
from tools_fixtures import Sshd, make_git_repo, missing_tools
from unprivileged import Actor

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="run confines on Linux only"),
    pytest.mark.timeout(600),
]

RUN_TIMEOUT = 120.0
PROXY_VARIABLES = (
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "ws_proxy",
    "wss_proxy",
    "NODE_USE_ENV_PROXY",
    "EGRESSBOX_SOCKS_PROXY",
    "GIT_SSH_COMMAND",
    "npm_config_proxy",
    "npm_config_https_proxy",
)


class _Origin(http.server.ThreadingHTTPServer):
    paths: list[str]


@pytest.fixture
def origin() -> Iterator[_Origin]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            server.paths.append(self.path)
            body = b"captured hello\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            del format, args

    server = _Origin(("127.0.0.1", 0), Handler)
    server.paths = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Box:
    actor: Actor
    workspace: Path
    policy: Path
    log: Path
    dns: DnsServer
    port: int

    def run(self, script: str) -> subprocess.CompletedProcess[str]:
        """`sh -c script` inside run, with every proxy variable removed."""
        unset = " ".join(f"-u {name}" for name in PROXY_VARIABLES)
        host, port = self.dns.nameserver
        argv = [
            *self.actor.egressbox,
            "run",
            "--quiet",
            "--policy",
            str(self.policy),
            "--audit-log",
            str(self.log),
            "--nameserver",
            f"{host}:{port}",
            "--",
            "sh",
            "-c",
            f"exec env {unset} sh -c '{script}'",
        ]
        command, env = self.actor.command(argv, self.actor.base_env(self.workspace.parent))
        return subprocess.run(
            command,
            env=env,
            cwd=self.workspace,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            check=False,
            stdin=subprocess.DEVNULL,
        )

    def records(self) -> list[tuple[str, str, int, str, str]]:
        lines = self.log.read_text(encoding="utf-8").splitlines()
        loaded = [json.loads(line) for line in lines if line.strip()]
        return [(r["protocol"], r["host"], r["port"], r["decision"], r["reason"]) for r in loaded]


@pytest.fixture
def box(actor: Actor, origin: _Origin, tmp_path: Path) -> Iterator[Box]:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    port = origin.server_address[1]
    home = actor.make_dir("/tmp", "egressbox-capture-home-")  # reachable for the test user
    workspace = actor.make_dir(home, "ws-")
    policy = workspace.parent / "policy.toml"
    policy.write_text(
        f'[egress]\nallow = ["origin.test:{port}", "*.ok.test:{port}"]\n'
        'deny = ["blocked.ok.test"]\nallow_cidrs = ["127.0.0.1/32"]\n',
        encoding="utf-8",
    )
    log = workspace.parent / "audit.jsonl"
    log.touch()
    actor.own(log, 0o666)
    actor.own(policy, 0o644)
    with DnsServer(
        {
            "origin.test": [A("127.0.0.1")],
            "www.ok.test": [A("127.0.0.1")],
            "blocked.ok.test": [A("127.0.0.1")],
        }
    ) as dns:
        probe = Box(actor, workspace, policy, log, dns, port)
        done = probe.run("cat /etc/resolv.conf")
        if "127.0.0.53" not in done.stdout:
            pytest.skip(f"capture is not available here: {done.stderr.strip()[-300:]}")
        probe.log.write_text("", encoding="utf-8")
        try:
            yield probe
        finally:
            shutil.rmtree(home, ignore_errors=True)


def test_curl_ignoring_the_proxy_reaches_an_allowed_name(box: Box, origin: _Origin) -> None:
    token = secrets.token_hex(6)
    done = box.run(f'curl -sS --noproxy "*" http://origin.test:{box.port}/{token}')
    assert done.returncode == 0, done.stderr
    assert done.stdout == "captured hello\n"
    assert f"/{token}" in origin.paths  # the origin saw it: it went through, via the proxy
    records = box.records()
    assert ("dns", "origin.test", 0, "allow", "allowed") in records
    assert ("tcp", "origin.test", box.port, "allow", "allowed") in records


def test_getent_resolves_allowed_names_only(box: Box) -> None:
    done = box.run("getent hosts origin.test; echo rc=$?; getent hosts nothere.example; echo rc=$?")
    lines = done.stdout.splitlines()
    address, name = lines[0].split()[:2]
    assert ipaddress.ip_address(address) in (V4_NETWORK, V6_NETWORK)[":" in address]
    assert name == "origin.test"
    assert lines[-1] == "rc=2"
    assert ("dns", "nothere.example", 0, "deny", "no_allow_rule") in box.records()


def test_random_labels_under_a_zone_no_entry_admits_reach_no_resolver(box: Box) -> None:
    box.dns.clear_queries()
    labels = " ".join(f"{secrets.token_hex(8)}.exfil.example" for _ in range(5))
    done = box.run(f"for n in {labels}; do getent hosts $n; done; echo done")
    assert "done" in done.stdout
    assert [q for q in box.dns.queries if "exfil" in q.name] == []
    denied = [r for r in box.records() if r[0] == "dns" and r[3] == "deny"]
    assert len(denied) >= 5


def test_a_denied_name_or_port_is_refused_and_audited(box: Box, origin: _Origin) -> None:
    other = box.port + 1 if box.port < 65535 else box.port - 1
    script = (
        f'curl -sS --noproxy "*" --max-time 10 http://origin.test:{other}/x; echo rc=$?; '
        f'curl -sS --noproxy "*" --max-time 10 http://blocked.ok.test:{box.port}/y; echo rc=$?'
    )
    done = box.run(script)
    assert "rc=0" not in done.stdout, done.stdout + done.stderr
    records = box.records()
    assert ("tcp", "origin.test", other, "deny", "no_allow_rule") in records
    assert ("dns", "blocked.ok.test", 0, "deny", "deny_rule") in records
    assert origin.paths == []


def test_a_raw_socket_client_in_python(box: Box, origin: _Origin) -> None:
    code = (
        'import socket; s = socket.create_connection((\\"www.ok.test\\", PORT), timeout=10); '
        's.sendall(b\\"GET /raw HTTP/1.0\\\\r\\\\nHost: www.ok.test\\\\r\\\\n\\\\r\\\\n\\"); '
        "print(s.recv(100).split()[1].decode())"
    ).replace("PORT", str(box.port))
    done = box.run(f'python3 -c "{code}"')  # the system's python3, under /usr
    assert done.stdout.strip() == "200", done.stderr
    assert "/raw" in origin.paths


def test_node_fetch_ignoring_every_proxy_variable(box: Box, origin: _Origin) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    script = (
        f'fetch(\\"http://origin.test:{box.port}/node\\")'
        ".then(r => console.log(r.status))"
        ".catch(e => { console.log(e.cause || e); process.exit(1) })"
    )
    done = box.run(f'{node} -e "{script}"')
    assert done.stdout.strip() == "200", done.stdout + done.stderr
    assert "/node" in origin.paths


@pytest.fixture
def sshd(tmp_path: Path, actor: Actor) -> Iterator[Sshd]:
    if actor.uid != os.geteuid():
        pytest.skip("the throwaway sshd accepts the invoking user only")
    if missing_tools("ssh", "ssh-keygen", "git") or not os.path.isfile(
        shutil.which("sshd") or "/usr/sbin/sshd"
    ):
        pytest.skip("ssh over capture needs ssh, sshd, ssh-keygen and git")
    server = Sshd(tmp_path / "sshd")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _ssh_options(key: Path) -> str:
    # No ProxyCommand, no proxy variable: ssh dials the name itself, and capture takes it.
    return (
        f"-F /dev/null -i {key} -o IdentitiesOnly=yes -o BatchMode=yes"
        " -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"
    )


def test_plain_ssh_and_git_over_ssh_to_an_allowed_name(box: Box, sshd: Sshd) -> None:
    box.policy.write_text(
        f'[egress]\nallow = ["ssh.ok.test:{sshd.port}"]\nallow_cidrs = ["127.0.0.1/32"]\n',
        encoding="utf-8",
    )
    box.dns.set("ssh.ok.test", A("127.0.0.1"))
    repo = make_git_repo(box.workspace.parent / "repos", {"README": "over ssh\n"})
    key = box.workspace / "id_test"  # ~/.ssh is on the credential deny list
    shutil.copyfile(sshd.client_key, key)
    key.chmod(0o600)
    options = _ssh_options(key)
    url = f"ssh://{sshd.user}@ssh.ok.test:{sshd.port}{repo.bare}"
    script = (
        f"ssh {options} -p {sshd.port} {sshd.user}@ssh.ok.test echo over-capture; "
        f'GIT_SSH_COMMAND="ssh {options}" git clone -q {url} clone && cat clone/README'
    )
    done = box.run(script)
    assert "over-capture" in done.stdout, done.stdout + done.stderr
    assert "over ssh" in done.stdout, done.stdout + done.stderr
    assert ("tcp", "ssh.ok.test", sshd.port, "allow", "allowed") in box.records()


def test_a_plain_request_whose_host_names_another_site_is_refused(
    box: Box, origin: _Origin
) -> None:
    """Fronting in plain HTTP: connect to an allowed name, ask the origin for another."""
    code = (
        'import socket; s = socket.create_connection((\\"www.ok.test\\", PORT), timeout=10); '
        's.sendall(b\\"GET /fronted HTTP/1.1\\\\r\\\\nHost: evil.example\\\\r\\\\n\\\\r\\\\n\\"); '
        "print(repr(s.recv(100)))"
    ).replace("PORT", str(box.port))
    done = box.run(f'python3 -c "{code}"')
    assert "/fronted" not in origin.paths, done.stdout + done.stderr
    assert ("tcp", "www.ok.test", box.port, "deny", "host_mismatch") in box.records()
