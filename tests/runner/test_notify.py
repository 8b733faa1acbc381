"""The connect supervisor (runner/notify.py) where no namespace can be made: judged on the host.

`egressbox run` is started under a seccomp filter that refuses namespace creation (what Docker's
default profile does to an unprivileged container). The command then tries the attacks a
hostile child would make: a direct connect to the proxy's port number on another loopback
address, and to another listener; the listeners say whether anything arrived. Allowed traffic
through HTTP_PROXY and a proxy-unaware curl must work, the latter audited as `tcp`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from egressbox.confine import notify
from egressbox.net.original import Destinations

pytest.importorskip("pyseccomp")
WHY = notify.support()
pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY or "supported")
RUN_TIMEOUT = 60  # seconds for one confined run (start-up is ~0.1 s; the child waits on us)

# Loads a filter refusing unshare, setns, mount, clone with any CLONE_NEW* flag (ENOSYS for
# clone3, whose flags a filter cannot see), then execs the rest of its arguments.
HOSTILE = textwrap.dedent(
    """
    import errno, os, sys, pyseccomp
    new_any = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
    new_any |= 0x20000000 | 0x40000000 | 0x80
    f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in ("unshare", "setns", "mount"):
        f.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
    for i in range(32):
        if new_any & (1 << i):
            arg = pyseccomp.Arg(0, pyseccomp.MASKED_EQ, 1 << i, 1 << i)
            f.add_rule(pyseccomp.ERRNO(errno.EPERM), "clone", arg)
    f.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    f.load()
    os.execv(sys.argv[1], sys.argv[1:])
    """
)

# The command: says the proxy's port, waits for the host's word, then attacks and works.
CHILD = textwrap.dedent(
    """
    import os, select, socket, subprocess, sys, urllib.request
    port = int(os.environ["http_proxy"].rstrip("/").rsplit(":", 1)[1])
    print(port, flush=True)
    other, origin = (int(x) for x in sys.stdin.readline().split())
    for host, p in (("127.0.0.2", port), ("127.0.0.1", other), ("::1", other)):
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        s.settimeout(3)
        try:
            s.connect((host, p))
            s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
            print("ATTACK", host, p, s.recv(100), flush=True)
        except OSError as exc:
            print("ATTACK", host, p, "failed", exc.errno, flush=True)
        s.close()
    # A non-blocking connect: EINPROGRESS, then SO_ERROR 0 on the same socket.
    s = socket.socket()
    s.setblocking(False)
    print("NONBLOCK", s.connect_ex(("127.0.0.1", origin)), flush=True)
    select.select([], [s], [], 5)
    print("SOERROR", s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR), flush=True)
    s.sendall(b"GET /nonblocking HTTP/1.0\\r\\n\\r\\n")
    select.select([s], [], [], 5)
    print("NONBLOCK-READ", s.recv(100)[:12], flush=True)
    s.close()
    try:
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        print("UDP made", flush=True)
    except OSError as exc:
        print("UDP", exc.errno, flush=True)
    body = urllib.request.urlopen(f"http://localhost:{origin}/via-proxy", timeout=10).read()
    print("PROXY", body, flush=True)
    curl = subprocess.run(["curl", "-sS", "--noproxy", "*", "-m", "10",
                           f"http://localhost:{origin}/captured"], capture_output=True)
    print("CURL", curl.returncode, curl.stdout, flush=True)
    """
)


class _Listener:
    """A loopback listener that records every connection it accepts (and answers HTTP)."""

    def __init__(self, host: str, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    self.accepted.append(conn.recv(1000))
                    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 6\r\n\r\norigin")
                except OSError:
                    self.accepted.append(b"")

    def close(self) -> None:
        self.sock.close()


def _run_hostile(
    tmp_path: Path, origin: _Listener, other: _Listener
) -> tuple[str, str, list[dict[str, object]]]:
    work = tmp_path / "work"
    work.mkdir()
    state = Path(os.environ.get("EGRESSBOX_TEST_STATE_ROOT", "/root")) / ".egressbox-test-notify"
    shutil.rmtree(state, ignore_errors=True)
    (tmp_path / "hostile.py").write_text(HOSTILE)
    (tmp_path / "child.py").write_text(CHILD)
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[egress]\nallow = ["localhost:{origin.port}", "127.0.0.1:{origin.port}"]\n'
        'allow_cidrs = ["127.0.0.0/8"]\n'
    )
    audit = tmp_path / "audit.jsonl"
    egressbox = [sys.executable, "-m", "egressbox", "run", "--policy", str(policy), "--report"]
    egressbox += ["--audit-log", str(audit), "--read-root", str(tmp_path), "--"]
    cmd = [sys.executable, str(tmp_path / "hostile.py"), *egressbox]
    cmd += [shutil.which("python3") or "/usr/bin/python3", str(tmp_path / "child.py")]
    env = {**os.environ, "EGRESSBOX_STATE_DIR": str(state), "EGRESSBOX_PURE": "1"}
    proc = subprocess.Popen(
        cmd, cwd=work, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        trap = _Listener("127.0.0.2", port)  # the proxy's port number on another address
        try:
            proc.stdin.write(f"{other.port} {origin.port}\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=RUN_TIMEOUT)
        finally:
            trap.close()
        assert trap.accepted == [], "a direct connect reached 127.0.0.2 on the proxy's port"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(state, ignore_errors=True)
    lines = audit.read_text().splitlines() if audit.exists() else []
    records = [json.loads(line) for line in lines]
    return out, err, records


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_a_container_without_namespaces_gets_the_boundary_by_address(tmp_path: Path) -> None:
    origin, other = _Listener("127.0.0.1"), _Listener("127.0.0.1")
    try:
        out, err, records = _run_hostile(tmp_path, origin, other)
    finally:
        origin.close()
        other.close()
    assert other.accepted == [], f"another listener was reached: {out}"
    assert "network_boundary: full" in err and "connect supervisor" in err, err
    assert "network_namespace: none" in err, err  # really without a namespace
    assert "seccomp filter refuses unshare" in err or "namespace" in err
    assert "NONBLOCK 115" in out and "SOERROR 0" in out, out
    assert f"UDP {1}" in out, out  # EPERM: no UDP socket without a namespace
    assert "PROXY b'origin'" in out, out
    assert "CURL 0 b'origin'" in out, out
    paths = {line.split(b" ")[1] for line in origin.accepted if line}
    assert {b"/via-proxy", b"/captured", b"/nonblocking"} <= paths, origin.accepted
    captured = [r for r in records if r["protocol"] == "tcp" and r["port"] == origin.port]
    assert captured and all(r["decision"] == "allow" for r in captured), records
    refused = {(r["host"], r["port"]) for r in records if r["decision"] == "deny"}
    assert ("127.0.0.1", other.port) in refused, records
    assert ("::1", other.port) in refused, records


def test_destinations_are_taken_once_and_bounded() -> None:
    table = Destinations(limit=2)
    table.put(("127.0.0.1", 1), ("198.51.100.7", 443))
    table.put(("127.0.0.1", 2), ("203.0.113.9", 22))
    table.put(("127.0.0.1", 3), ("192.0.2.1", 80))  # the oldest goes
    assert table.take(("127.0.0.1", 1)) is None
    assert table.take(("127.0.0.1", 2)) == ("203.0.113.9", 22)
    assert table.take(("127.0.0.1", 2)) is None  # once
    assert len(table) == 1


def test_the_filter_program_is_well_formed() -> None:
    code = notify.program()
    assert code and len(code) % 8 == 0
    # Ends with the shared return blocks: notify, allow, EPERM, ENOSYS, kill.
    tail = range(len(code) - 40, len(code), 8)
    last = [int.from_bytes(code[i + 4 : i + 8], "little") for i in tail]
    assert last == [notify.RET_USER_NOTIF, notify.RET_ALLOW, notify.RET_ERRNO | 1,
                    notify.RET_ERRNO | 38, notify.RET_KILL_PROCESS]  # fmt: skip
