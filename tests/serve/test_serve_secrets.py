"""`egressbox serve` brokering a secret with the operator's CA, as a real process.

The operator's CA is made the way docs/secrets.md says (the openssl command line), its key
0600. A real client (curl through the proxy, trusting only that CA) reaches a loopback HTTPS
origin (Python's ssl server, its certificate from a test CA given as [tls] origin_ca) that
accepts only the real token. Judged from the host: what the origin saw, the audit log, the
admin listener's /metrics and every byte serve wrote; the real value is searched for in all
of them. A reload (SIGHUP) keeps the CA, the placeholder and the bindings.

What cannot work is refused at start with exit 2 and one line saying what to do: no CA, a
key open to others, a key that is not the certificate's, a from_command that fails.
"""

from __future__ import annotations

import contextlib
import http.server
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from egressbox.proxy.ca import CertificateAuthority
from serving import admin_get, audit_lines, clean_env, serving

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="serve is tested on Linux"),
    pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
    pytest.mark.timeout(120),
]

TOKEN = "real-token-serve-3e9a51c07b"
START_TIMEOUT = 60.0
# The budgets' window in the policy below: short, so that the test sees it renew.
WINDOW = 2


@dataclass
class Origin:
    """An HTTPS origin on 127.0.0.1: 200 only with the real token; logs every request."""

    port: int = 0
    seen: list[tuple[str, str, str]] = field(default_factory=list)  # method, path, auth


@contextlib.contextmanager
def https_origin(context: ssl.SSLContext) -> Iterator[Origin]:
    found = Origin()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            auth = self.headers.get("Authorization") or ""
            found.seen.append((self.command, self.path, auth))
            ok = auth == f"Bearer {TOKEN}" or auth == f"token {TOKEN}"
            body = b"welcome\n" if ok else b"who are you\n"
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_DELETE = _answer  # noqa: N815 - http.server's names

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    found.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield found
    finally:
        server.shutdown()
        server.server_close()


def make_operator_ca(where: Path) -> tuple[Path, Path]:
    """A P-256 CA made with the command docs/secrets.md gives, its key 0600."""
    cert, key = where / "ca.pem", where / "ca.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "30",
            "-subj",
            "/CN=egressbox test operator CA",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    key.chmod(0o600)
    return cert, key


@dataclass
class Setup:
    tmp: Path
    origin: Origin
    origin_ca: Path
    ca_cert: Path
    ca_key: Path

    def policy(
        self,
        *,
        extra: str = "",
        max_requests: int = 3,
        ca_in_policy: bool = True,
        ca: tuple[Path, Path] | None = None,
    ) -> Path:
        port = self.origin.port
        cert, key = ca or (self.ca_cert, self.ca_key)
        ca_keys = f'ca_cert = "{cert}"\nca_key = "{key}"\n' if ca_in_policy else ""
        text = f"""
[egress]
allow = ["127.0.0.1:{port}"{extra}]
allow_cidrs = ["127.0.0.1/32"]

[[secret]]
name = "API_TOKEN"
from_env = "EGRESSBOX_TEST_REAL"
hosts = ["127.0.0.1:{port}"]
header = "Authorization"
format = "Bearer {{value}}"

[[request_rule]]
hosts = ["127.0.0.1:{port}"]
methods = ["GET"]
paths = ["/ok"]
max_requests = {max_requests}
window = {WINDOW}

[tls]
origin_ca = "{self.origin_ca}"
{ca_keys}"""
        path = self.tmp / "policy.toml"
        path.write_text(text)
        return path


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    test_ca = CertificateAuthority.generate()
    origin_ca = tmp_path / "origin-ca.pem"
    origin_ca.write_text(test_ca.cert_pem)
    cert, key = make_operator_ca(tmp_path)
    with https_origin(test_ca.server_context("127.0.0.1")) as origin:
        yield Setup(tmp_path, origin, origin_ca, cert, key)


def curl(proxy: str, ca: Path, url: str, *options: str) -> tuple[str, str]:
    """(status, X-Egressbox-Reason) of one curl through the proxy, trusting only `ca`."""
    head = ["curl", "-sS", "-D", "-", "-o", "/dev/null", "--max-time", "20", "--cacert", str(ca)]
    done = subprocess.run(
        [*head, "-x", f"http://{proxy}", *options, url],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert TOKEN not in done.stdout + done.stderr
    status, reason = "000", ""
    for line in done.stdout.splitlines():
        if line.startswith("HTTP/") and " 200 Connection" not in line:
            status = line.split()[1]
        if line.lower().startswith("x-egressbox-reason:"):
            reason = line.split(":", 1)[1].strip()
    return status, reason or done.stderr.strip()


def placeholder_in(stderr: str) -> str:
    for line in stderr.splitlines():
        if "[[secret]] API_TOKEN: clients send " in line:
            return line.split("clients send ", 1)[1].split()[0]
    pytest.fail(f"no placeholder line:\n{stderr}")


def test_serve_brokers_the_token_with_the_operators_ca(setup: Setup) -> None:
    audit = setup.tmp / "audit.jsonl"
    policy = setup.policy()
    args = ["--policy", str(policy), "--audit-log", str(audit), "--admin", "127.0.0.1:0"]
    env = {"EGRESSBOX_TEST_REAL": TOKEN}
    url = f"https://127.0.0.1:{setup.origin.port}"
    with serving(setup.tmp / "serve", *args, env=env) as serve:
        proxy, ca = serve.ready["http"], setup.ca_cert
        token = placeholder_in(serve.stderr())
        assert curl(proxy, ca, f"{url}/ok/added") == ("200", "")  # the header, in its format
        sent = curl(proxy, ca, f"{url}/ok/sent", "-H", f"Authorization: token {token}")
        assert sent == ("200", "")
        assert curl(proxy, ca, f"{url}/ok/x", "-X", "DELETE") == ("403", "method_denied")
        assert curl(proxy, ca, f"{url}/admin") == ("403", "path_denied")
        assert curl(proxy, ca, f"{url}/ok/3") == ("200", "")
        assert curl(proxy, ca, f"{url}/ok/4") == ("403", "budget_exceeded")
        time.sleep(WINDOW + 0.2)  # the window passes: the budget starts again
        assert curl(proxy, ca, f"{url}/ok/5") == ("200", "")
        # A reload keeps the CA and the placeholder (the client's trust and configuration
        # hold), and says that the changed budget waits for a restart.
        setup.policy(extra=', "localhost:1"', max_requests=1000)
        serve.send(signal.SIGHUP)
        serve.wait_stderr("policy reloaded")
        assert "changes [[request_rule]]" in serve.wait_stderr("reads at start only")
        sent = curl(proxy, ca, f"{url}/ok/6", "-H", f"Authorization: token {token}")
        assert sent == ("200", "")
        status, _, metrics = admin_get(serve.ready["admin"], "/metrics")
        assert status == 200
        assert serve.stop() == 0
        err, out = serve.stderr(), serve.stdout()
    paths = [path for _, path, auth in setup.origin.seen if TOKEN in auth]
    assert paths == ["/ok/added", "/ok/sent", "/ok/3", "/ok/5", "/ok/6"]
    assert len(setup.origin.seen) == len(paths)  # nothing refused reached it
    records = audit_lines(audit)  # every line whole, exactly the six keys
    refused = [r["reason"] for r in records if r["decision"] == "deny"]
    assert refused == ["method_denied", "path_denied", "budget_exceeded"]
    for text in (err, out, audit.read_text(), metrics.decode()):
        assert TOKEN not in text


def test_the_flags_win_over_the_policy_keys(setup: Setup) -> None:
    """--ca-cert/--ca-key over a policy naming another CA (as --upstream over [egress])."""
    (setup.tmp / "other").mkdir()
    in_policy = make_operator_ca(setup.tmp / "other")
    policy = setup.policy(ca=in_policy)
    args = ["--policy", str(policy), "--ca-cert", str(setup.ca_cert), "--ca-key", str(setup.ca_key)]
    env = {"EGRESSBOX_TEST_REAL": TOKEN}
    with serving(setup.tmp / "serve", *args, env=env) as serve:
        url = f"https://127.0.0.1:{setup.origin.port}/ok"
        assert curl(serve.ready["http"], setup.ca_cert, url) == ("200", "")
        assert serve.stop() == 0
    assert TOKEN in setup.origin.seen[0][2]


def _start_fails(setup: Setup, policy: Path, *extra: str) -> str:
    """serve's stderr when it refuses to start (exit 2, no ready line, no traceback)."""
    done = subprocess.run(
        [sys.executable, "-m", "egressbox", "serve", "--policy", str(policy), *extra],
        capture_output=True,
        text=True,
        env=clean_env({"EGRESSBOX_TEST_REAL": TOKEN}),
        timeout=START_TIMEOUT,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""  # no ready line: nothing was served
    assert "Traceback" not in done.stderr and TOKEN not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_serve_without_a_ca_fails_at_start_saying_what_to_do(setup: Setup) -> None:
    line = _start_fails(setup, setup.policy(ca_in_policy=False))
    assert "[[secret]] API_TOKEN and [[request_rule]]" in line
    assert "[tls] ca_cert and ca_key (or --ca-cert and --ca-key)" in line
    assert "openssl req -x509" in line


def test_a_ca_key_open_to_others_is_refused(setup: Setup) -> None:
    setup.ca_key.chmod(0o640)
    line = _start_fails(setup, setup.policy())
    assert f"{setup.ca_key}: the CA key is open to group or others (mode 0640)" in line
    assert f"chmod 600 {setup.ca_key}" in line


def test_a_key_that_is_not_the_certificates_is_refused(setup: Setup) -> None:
    (setup.tmp / "other").mkdir()
    other, _ = make_operator_ca(setup.tmp / "other")
    line = _start_fails(
        setup, setup.policy(), "--ca-cert", str(other), "--ca-key", str(setup.ca_key)
    )
    assert f"{setup.ca_key} is not the key of the certificate {other}" in line


def test_the_ca_flags_go_together(setup: Setup) -> None:
    line = _start_fails(setup, setup.policy(), "--ca-cert", str(setup.ca_cert))
    assert "--ca-cert and --ca-key go together" in line


@pytest.mark.parametrize(
    ("command", "said"),
    [
        ('["false"]', "from_command false exited with 1"),
        ('["egressbox-no-such-command"]', "from_command egressbox-no-such-command cannot run"),
        ('["sh", "-c", "echo partial; kill -9 $$"]', "was killed by signal 9"),
    ],
)
def test_a_failing_from_command_ends_serve_at_start(setup: Setup, command: str, said: str) -> None:
    text = setup.policy().read_text().replace('from_env = "EGRESSBOX_TEST_REAL"', "")
    policy = setup.tmp / "command.toml"
    policy.write_text(
        text.replace('name = "API_TOKEN"', f'name = "API_TOKEN"\nfrom_command = {command}')
    )
    line = _start_fails(setup, policy)
    assert line.startswith("egressbox: [[secret]] API_TOKEN: ")
    assert said in line


def test_workers_share_the_ca_and_the_placeholder(setup: Setup) -> None:
    """--workers 2: the CA and values are loaded once, before the fork; every worker signs
    with the operator's CA and knows the one placeholder the start said."""
    args = ["--policy", str(setup.policy(max_requests=100)), "--workers", "2"]
    with serving(setup.tmp / "serve", *args, env={"EGRESSBOX_TEST_REAL": TOKEN}) as serve:
        token = placeholder_in(serve.stderr())
        url = f"https://127.0.0.1:{setup.origin.port}/ok"
        for _ in range(6):  # new connections: the kernel spreads them over the workers
            sent = curl(
                serve.ready["http"], setup.ca_cert, url, "-H", f"Authorization: token {token}"
            )
            assert sent == ("200", "")
        assert serve.stop() == 0
        assert serve.stderr().count("clients send") == 1
        assert TOKEN not in serve.stderr() + serve.stdout()
    assert all(TOKEN in auth for _, _, auth in setup.origin.seen)
    assert len(setup.origin.seen) == 6
