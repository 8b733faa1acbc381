"""`run` without namespaces (an unprivileged user on a host without user namespaces). With
the connect supervisor (runner/notify.py) every connect of the command reaches the proxy:
its own port, or the capture listener, where the proxy decides the destination. Without the
supervisor (an older kernel, a filter above us refusing pidfd_getfd) Landlock TCP ports and
seccomp still hold the child to the proxy's port numbers, and the report says `partial` for
the network. Either way it is judged at the listeners."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressbox.confine import notify
from egressbox.confine.grants import Enforcement, HostFacts, Profile
from egressbox.core.policy import parse_policy
from egressbox.runner.api import run_options_sync
from egressbox.runner.facts import host_facts
from egressbox.runner.options import RunOptions, RunResult
from recording import ORIGIN_ANSWER, Recording

NO_NAMESPACES = {
    "network_namespace": "cannot_attach",
    "mount_namespace": "cannot_attach",
    "pid_namespace": "cannot_attach",
    "user_namespace": "cannot_attach",
}


def _http_listener() -> Recording:
    """An HTTP listener on 127.0.0.1 that records the first bytes of every connection."""
    return Recording(socket.create_server(("127.0.0.1", 0)), ORIGIN_ANSWER)


@pytest.fixture
def listeners() -> Iterator[tuple[Recording, Recording]]:
    """The origin the policy admits, and another listener it does not."""
    origin, other = _http_listener(), _http_listener()
    try:
        yield origin, other
    finally:
        origin.close()
        other.close()


# The command: one request through HTTP_PROXY, then the attack: a direct connect to each
# listener, with a request, as a proxy-unaware tool makes it.
PROBE = """
import socket, sys, urllib.request
origin, other = int(sys.argv[1]), int(sys.argv[2])
print("proxy", urllib.request.urlopen(f"http://localhost:{origin}/via-proxy", timeout=10).status)
for label, port in (("origin", origin), ("other", other)):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(f"GET /direct-{label} HTTP/1.0\\r\\n\\r\\n".encode())
            s.settimeout(5)
            print(label, "answered", repr(s.recv(100)[-6:]))
    except OSError as exc:
        print(label, "refused", exc.errno)
"""


def _run_probe(tmp_path: Path, origin: int, other: int, profile: Profile) -> RunResult:
    real = host_facts()
    if not {"landlock", "seccomp"} <= real.available or real.landlock_abi < 4:
        pytest.skip("needs Landlock ABI >= 4 and seccomp: " + str(dict(real.status)))
    facts = HostFacts(frozenset({"landlock", "seccomp", "no_new_privs"}), NO_NAMESPACES, 7, 0)
    policy = parse_policy(
        {"egress": {"allow": [f"localhost:{origin}"], "allow_cidrs": ["127.0.0.1/32"]}}, env={}
    )
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    options = RunOptions(
        argv=(sys.executable, str(script), str(origin), str(other)),
        policy=policy,
        profile=profile,
        write_roots=(str(tmp_path),),
        cwd=str(tmp_path),
    )
    # The probe's output goes to our stdout: capture it through a pipe.
    result = run_options_sync(options, facts=facts, capture_output=True)
    assert result.exit_code == 0, result.stderr
    return result


def _said(result: RunResult) -> dict[str, str]:
    lines = (result.stdout or b"").decode().splitlines()
    return dict(line.split(" ", 1) for line in lines)


@pytest.mark.parametrize("profile", [Profile.WORKTREE, Profile.UNRESTRICTED])
def test_without_namespaces_every_connect_of_the_child_reaches_only_the_proxy(
    listeners: tuple[Recording, Recording], tmp_path: Path, profile: Profile
) -> None:
    why = notify.support()
    if why:
        pytest.skip(f"no connect supervisor here: {why}")
    origin, other = listeners
    result = _run_probe(tmp_path, origin.port, other.port, profile)
    said = _said(result)
    assert said["proxy"] == "200", said
    # The direct connects complete (to the capture listener, as with a namespace): the proxy
    # forwards the admitted one, audited as tcp, and closes the other.
    assert said["origin"] == "answered b'origin'", said
    assert said["other"] == "answered b''", said
    # Judged at the listeners: nothing reached the other; the origin only what the proxy let by.
    assert other.accepted == [], other.accepted
    assert origin.paths() == ["/direct-origin", "/via-proxy"], origin.accepted
    decided = sorted((r.host, r.port, r.protocol, r.decision.value) for r in result.records)
    assert decided == sorted(
        [
            ("localhost", origin.port, "http", "allow"),
            ("localhost", origin.port, "tcp", "allow"),
            ("127.0.0.1", other.port, "tcp", "deny"),
        ]
    ), result.records
    network = next(r for r in result.report if r.mechanism == "network_boundary")
    assert network.enforcement is Enforcement.FULL, network
    assert "connect supervisor" in network.detail, network


def test_without_namespaces_or_supervisor_the_proxy_ports_are_all_the_child_reaches(
    listeners: tuple[Recording, Recording], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a host without seccomp user notification or pidfd_getfd gets: Landlock's ports.
    monkeypatch.setattr(notify, "support", lambda: "pidfd_getfd(2) fails: (for this test)")
    origin, other = listeners
    result = _run_probe(tmp_path, origin.port, other.port, Profile.WORKTREE)
    said = _said(result)
    assert said["proxy"] == "200", said
    assert said["origin"].startswith("refused") and said["other"].startswith("refused"), said
    assert other.accepted == [], other.accepted
    assert origin.paths() == ["/via-proxy"], origin.accepted
    assert [(r.host, r.port, r.decision.value) for r in result.records] == [
        ("localhost", origin.port, "allow")
    ]
    network = next(r for r in result.report if r.mechanism == "network_boundary")
    assert network.enforcement is Enforcement.PARTIAL, network
    assert "no connect supervisor: pidfd_getfd(2) fails" in network.detail, network


def test_the_probe_unconfined_reaches_both_listeners(
    listeners: tuple[Recording, Recording], tmp_path: Path
) -> None:
    # The attack is real: without egressbox the same direct connects reach both listeners.
    origin, other = listeners
    script = tmp_path / "probe.py"
    script.write_text(PROBE.replace('print("proxy"', '0 and print("proxy"'))
    clean = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    plain = subprocess.run(
        [sys.executable, str(script), str(origin.port), str(other.port)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env=clean,
    )
    assert "origin answered b'origin'" in plain.stdout, plain.stdout
    assert "other answered b'origin'" in plain.stdout, plain.stdout
    assert origin.paths() == ["/direct-origin"] and other.paths() == ["/direct-other"]


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
