"""What egressbox says to a newcomer: each message names the cause and the fix.

Each case is met as a user would meet it, through the real command line: a tool dialling
directly inside `run`, a file left in the private /tmp, `explain` with a URL or with only the
port wrong, a port already taken, `run` without a policy, a read root the deny list covers, a
wildcard `--listen`, and `run`'s stderr kept for refusals. Traffic stays on loopback; every
wait is bounded.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="run confines on Linux only")

TIMEOUT = 120.0
EGRESSBOX = [sys.executable, "-m", "egressbox"]


def egressbox(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd.parent)}
    environment |= {k: v for k, v in os.environ.items() if k.startswith("EGRESSBOX_PURE")}
    return subprocess.run(
        [*EGRESSBOX, *args],
        cwd=cwd,
        env=environment | (env or {}),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "ws"
    path.mkdir()
    return path


def policy(workspace: Path, text: str) -> str:
    path = workspace.parent / "policy.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture
def origin() -> Iterator[int]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            del format, args

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


DIRECT = "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)"


def test_a_direct_dial_inside_run_names_the_proxy(workspace: Path, origin: int) -> None:
    # Without capture a direct dial fails in the child's namespace (with capture it is
    # decided like a request: test_capture_clients.py).
    code = DIRECT.format(port=origin)
    done = egressbox("run", "--no-capture", "--", sys.executable, "-c", code, cwd=workspace)
    assert done.returncode == 1, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "refused by egress (direct connection refused: only the proxy at 127.0.0.1:" in line
    assert "use the proxy variables" in line


def test_a_lookup_inside_run_says_the_proxy_resolves(workspace: Path) -> None:
    code = "import socket; socket.getaddrinfo('example.com', 443)"
    done = egressbox("run", "--no-capture", "--", sys.executable, "-c", code, cwd=workspace)
    assert done.returncode == 1, done.stderr
    assert "no name resolution inside run" in done.stderr.strip().splitlines()[-1], done.stderr


def test_a_file_left_in_the_private_tmp_is_announced(workspace: Path) -> None:
    done = egressbox("run", "--", "touch", "/tmp/egressbox-left-here", cwd=workspace)
    assert done.returncode == 0, done.stderr
    note = "left /tmp/egressbox-left-here on its private /tmp: not kept"
    assert note in done.stderr, done.stderr
    quiet = egressbox("run", "--", "true", cwd=workspace)
    assert "private /tmp" not in quiet.stderr, quiet.stderr


def _explain(workspace: Path, target: str, allow: str) -> dict[str, object]:
    path = policy(workspace, f'[egress]\nallow = ["{allow}"]\n')
    done = egressbox("explain", "--json", "--policy", path, target, cwd=workspace)
    assert done.returncode == 0, done.stderr
    found: dict[str, object] = json.loads(done.stdout)
    return found


def test_explain_takes_a_url(workspace: Path) -> None:
    found = _explain(workspace, "http://localhost:38993/some/path", "localhost:38993")
    assert (found["host"], found["port"]) == ("localhost", 38993)
    https = _explain(workspace, "https://example.com/", "example.com:443")
    assert (https["host"], https["port"]) == ("example.com", 443)


def test_explain_says_when_only_the_port_differs(workspace: Path) -> None:
    found = _explain(workspace, "127.0.0.1:22", "127.0.0.1:38993")
    assert found["reason"] == "no_allow_rule"
    detail = str(found["detail"])
    assert "port 22" in detail and "38993" in detail and "never admits" not in detail


def test_a_taken_port_is_named(workspace: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        path = policy(workspace, "[egress]\nallow = []\n")
        done = egressbox("serve", "--policy", path, "--http-port", str(port), cwd=workspace)
    assert done.returncode == 3, done.stderr
    assert f"127.0.0.1:{port}: Address already in use" in done.stderr


def test_run_without_a_policy_says_everything_is_denied(workspace: Path) -> None:
    done = egressbox("run", "--", "true", cwd=workspace)
    assert "no policy: every destination is denied" in done.stderr
    assert "--policy FILE" in done.stderr


def test_a_read_root_on_the_deny_list_is_pointed_out(workspace: Path) -> None:
    ssh = workspace.parent / ".ssh"
    ssh.mkdir()
    done = egressbox("run", "--read-root", str(ssh), "--", "true", cwd=workspace)
    assert f"{ssh} is on the credential deny list" in done.stderr, done.stderr


def test_a_wildcard_listen_warns_of_an_open_proxy(workspace: Path) -> None:
    path = policy(workspace, "[egress]\nallow = []\n")
    proc = subprocess.Popen(
        [*EGRESSBOX, "serve", "--policy", path, "--listen", "0.0.0.0"],
        cwd=workspace,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=TIMEOUT)
    assert "warning: --listen 0.0.0.0 accepts connections from other hosts" in err


def test_run_says_refusals_by_default_and_allowed_lines_with_verbose(
    workspace: Path, origin: int
) -> None:
    path = policy(
        workspace,
        f'[egress]\nallow = ["127.0.0.1:{origin}"]\nallow_cidrs = ["127.0.0.1/32"]\n',
    )
    code = (
        "import urllib.request\n"
        f"urllib.request.urlopen('http://127.0.0.1:{origin}/', timeout=10).read()\n"
        "try:\n"
        "    urllib.request.urlopen('http://127.0.0.1:1/', timeout=10)\n"
        "except Exception:\n"
        "    pass\n"
    )
    plain = egressbox("run", "--policy", path, "--", sys.executable, "-c", code, cwd=workspace)
    assert plain.returncode == 0, plain.stderr
    assert "allow allowed" not in plain.stderr, plain.stderr
    assert "deny" in plain.stderr and "no_allow_rule" in plain.stderr, plain.stderr
    loud = egressbox("run", "-v", "--policy", path, "--", sys.executable, "-c", code, cwd=workspace)
    assert "allow allowed" in loud.stderr, loud.stderr
