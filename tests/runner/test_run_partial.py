"""`run` without namespaces (an unprivileged user on a host without user
namespaces): Landlock TCP ports and seccomp still hold the child to the
proxy's port numbers, and the report says `partial` for the network."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressbox.confine.plan import Enforcement, HostFacts, Profile
from egressbox.core.policy import parse_policy
from egressbox.runner.api import run_options_sync
from egressbox.runner.facts import host_facts
from egressbox.runner.options import RunOptions

NO_NAMESPACES = {
    "network_namespace": "cannot_attach",
    "mount_namespace": "cannot_attach",
    "pid_namespace": "cannot_attach",
    "user_namespace": "cannot_attach",
}


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


def test_without_namespaces_the_proxy_ports_are_all_the_child_reaches(
    origin: int, tmp_path: Path
) -> None:
    real = host_facts()
    if not {"landlock", "seccomp"} <= real.available or real.landlock_abi < 4:
        pytest.skip("needs Landlock ABI >= 4 and seccomp: " + str(dict(real.status)))
    facts = HostFacts(frozenset({"landlock", "seccomp", "no_new_privs"}), NO_NAMESPACES, 7, 0)
    policy = parse_policy(
        {"egress": {"allow": [f"localhost:{origin}"], "allow_cidrs": ["127.0.0.1/32"]}}, env={}
    )
    probe = (
        "import os, socket, urllib.request\n"
        f"print(urllib.request.urlopen('http://localhost:{origin}/', timeout=10).status)\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {origin}), timeout=5)\n"
        "    print('direct reached')\n"
        "except OSError as exc:\n"
        "    print('direct refused', exc.errno)\n"
    )
    script = tmp_path / "probe.py"
    script.write_text(probe)
    options = RunOptions(
        argv=(sys.executable, str(script)),
        policy=policy,
        profile=Profile.WORKTREE,
        write_roots=(str(tmp_path),),
        cwd=str(tmp_path),
    )
    # The probe's output goes to our stdout: capture it through a pipe.
    result = run_options_sync(options, facts=facts, capture_output=True)
    assert result.exit_code == 0, result.stderr
    lines = (result.stdout or b"").decode().split()
    assert lines[0] == "200"
    assert lines[1:3] == ["direct", "refused"]
    network = next(r for r in result.report if r.mechanism == "network_boundary")
    assert network.enforcement is Enforcement.PARTIAL
    assert [(r.host, r.port, r.decision.value) for r in result.records] == [
        ("localhost", origin, "allow")
    ]
    # The same probe unconfined reaches the origin directly.
    clean = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    plain = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env=clean,
    )
    assert "direct reached" in plain.stdout


def test_without_a_mount_namespace_landlock_alone_keeps_the_deny_list_and_read_only_roots(
    tmp_path: Path,
) -> None:
    real = host_facts()
    if "landlock" not in real.available or real.landlock_abi < 1:
        pytest.skip("needs Landlock: " + str(dict(real.status)))
    facts = HostFacts(frozenset({"landlock", "seccomp", "no_new_privs"}), NO_NAMESPACES, 7, 0)
    shared = tmp_path / "shared"
    (shared / "keys").mkdir(parents=True)
    (shared / "keys" / "secret").write_text("s3cret")
    (shared / "notes").write_text("fine")
    work = tmp_path / "work"
    (work / "vendor").mkdir(parents=True)
    (work / "src").mkdir()
    probe = (
        "import sys\n"
        "def attempt(label, action):\n"
        "    try:\n"
        "        action()\n"
        "        print(label, 'ok')\n"
        "    except OSError as exc:\n"
        "        print(label, 'refused', exc.errno)\n"
        f"attempt('notes', lambda: open({str(shared / 'notes')!r}).read())\n"
        f"attempt('secret', lambda: open({str(shared / 'keys' / 'secret')!r}).read())\n"
        f"attempt('work', lambda: open({str(work / 'src' / 'new')!r}, 'w').write('x'))\n"
        f"attempt('vendor', lambda: open({str(work / 'vendor' / 'new')!r}, 'w').write('x'))\n"
    )
    script = tmp_path / "probe.py"
    script.write_text(probe)
    options = RunOptions(
        argv=(sys.executable, str(script)),
        policy=parse_policy({"egress": {"allow": []}}, env={}),
        profile=Profile.WORKTREE,
        write_roots=(str(work),),
        read_roots=(str(shared), str(work / "vendor"), str(tmp_path)),
        deny=(str(shared / "keys"),),
        cwd=str(work),
    )
    result = run_options_sync(options, facts=facts, capture_output=True)
    assert result.exit_code == 0, result.stderr
    seen = dict(line.split(" ", 1) for line in (result.stdout or b"").decode().splitlines())
    assert seen["notes"] == "ok"
    assert seen["secret"].startswith("refused")
    assert seen["work"] == "ok"
    assert seen["vendor"].startswith("refused")
    # Unconfined, every one of these succeeds.
    (work / "src" / "new").unlink()
    plain = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, timeout=30
    )
    assert plain.stdout.split().count("ok") == 4
