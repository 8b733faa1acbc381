"""A policy reload re-judges what is open: `egressbox serve` as a real process, real clients
and real origins on loopback.

A CONNECT tunnel, a SOCKS5 tunnel, a WebSocket-upgraded plain-HTTP connection and an idle
kept-alive forwarding connection are open to hosts a reload then puts in `deny`; an allowed
host's tunnel is open beside them. Judged at the origins: each denied one sees its connection
closed, the allowed one keeps carrying bytes, and the audit log (read from its file) holds one
`policy_reloaded` record per closure. With --keep-open-on-reload all of them stay open. A
--watch-policy reload under --workers closes the tunnels of every worker.

With --ask-command: a deny entry added by a reload while a question is held wins over the
decider's later `once` or `session`; open questions are capped per client; a `once` answer
about a plain-HTTP request does not admit a CONNECT waiting for the same host and port.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from serving import (
    IO_TIMEOUT,
    audit_lines,
    connect_through,
    serving,
    wait_until,
    write_atomically,
)

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="serve is tested on Linux"),
    pytest.mark.timeout(120),
]

LOOPBACK = "127.0.0.1"
# How long an origin's connection must stay open to count as "left open" by a reload.
STAYS_OPEN = 1.0
# A --watch-policy reload is seen within two polls of a second; more on a loaded machine.
RELOAD_TIMEOUT = 20.0


class Origin:
    """A threaded TCP origin on 127.0.0.1 that says, for each connection it accepted,
    whether it has been closed (the proxy's side seen from the origin). Its kind:
    `echo` echoes bytes; `http` answers each request head with a small 200 and keeps the
    connection alive; `upgrade` answers the first head with 101 Switching Protocols (a
    WebSocket handshake) and echoes the bytes after it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.listener = socket.create_server((LOOPBACK, 0))
        self.port: int = self.listener.getsockname()[1]
        self.accepted = 0
        self.closed = 0
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            if self.kind == "echo":
                self._echo(conn, b"")
            else:
                self._http(conn)
        with self._lock:
            self.closed += 1

    @staticmethod
    def _echo(conn: socket.socket, first: bytes) -> None:
        if first:
            conn.sendall(first)
        while data := conn.recv(65536):
            conn.sendall(data)

    def _http(self, conn: socket.socket) -> None:
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                data = conn.recv(65536)
                if not data:
                    return
                buffer += data
            _, _, buffer = buffer.partition(b"\r\n\r\n")
            if self.kind == "upgrade":
                conn.sendall(
                    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                    b"Connection: Upgrade\r\n"
                    b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"
                )
                self._echo(conn, buffer)
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    def wait_closed(self, count: int = 1) -> None:
        wait_until(
            f"{self.kind} origin :{self.port} sees {count} closed", lambda: self.closed >= count
        )

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()


@contextlib.contextmanager
def origins(*kinds: str) -> Iterator[list[Origin]]:
    made = [Origin(kind) for kind in kinds]
    try:
        yield made
    finally:
        for origin in made:
            origin.close()


def policy(allow: Sequence[int], deny: Sequence[int] = ()) -> str:
    entries = [f"{LOOPBACK}:{port}" for port in allow]
    denied = [f"{LOOPBACK}:{port}" for port in deny]
    return (
        f'[egress]\nallow = {entries!r}\ndeny = {denied!r}\nallow_cidrs = ["127.0.0.0/8"]\n'
    ).replace("'", '"')


def socks_connect(proxy: tuple[str, int], port: int) -> socket.socket:
    """A SOCKS5 tunnel to 127.0.0.1:port (no authentication), checked for success."""
    sock = socket.create_connection(proxy, timeout=IO_TIMEOUT)
    sock.sendall(b"\x05\x01\x00")
    assert _read(sock, 2) == b"\x05\x00"
    sock.sendall(b"\x05\x01\x00\x01" + socket.inet_aton(LOOPBACK) + struct.pack("!H", port))
    reply = _read(sock, 10)
    assert reply[:2] == b"\x05\x00", reply
    return sock


def websocket(proxy: tuple[str, int], port: int) -> socket.socket:
    """A WebSocket handshake as a plain-HTTP request through the proxy; after its 101."""
    sock = socket.create_connection(proxy, timeout=IO_TIMEOUT)
    target = f"{LOOPBACK}:{port}"
    sock.sendall(
        f"GET ws://{target}/ws HTTP/1.1\r\nHost: {target}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = _head(sock)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def kept_alive(proxy: tuple[str, int], port: int) -> socket.socket:
    """A plain-HTTP request answered, its connection kept alive (and idle) afterwards."""
    sock = socket.create_connection(proxy, timeout=IO_TIMEOUT)
    target = f"{LOOPBACK}:{port}"
    sock.sendall(f"GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = _head(sock)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert _read(sock, 2) == b"ok"
    return sock


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1)
        if not chunk:
            break
        data += chunk
    return data


def carries(sock: socket.socket, payload: bytes = b"ping") -> bool:
    """True when the tunnel echoes `payload` (the origin at its end echoes)."""
    try:
        sock.sendall(payload)
        return _read(sock, len(payload)) == payload
    except OSError:
        return False


def sees_end(sock: socket.socket) -> bool:
    """True when the client's connection ends (EOF or reset) within IO_TIMEOUT."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def closures(log: Path) -> list[tuple[str, int]]:
    return sorted(
        (r["protocol"], r["port"]) for r in audit_lines(log) if r["reason"] == "policy_reloaded"
    )


@pytest.mark.parametrize("keep_open", [False, True], ids=["default", "keep-open-on-reload"])
def test_a_reload_closes_every_kind_of_open_connection_it_denies(
    tmp_path: Path, keep_open: bool
) -> None:
    with origins("echo", "echo", "upgrade", "http", "echo") as found:
        tunneled, socksed, upgraded, kept, allowed = found
        denied = [tunneled, socksed, upgraded, kept]
        path, log = tmp_path / "policy.toml", tmp_path / "audit.jsonl"
        path.write_text(policy([o.port for o in found]))
        flags = ["--keep-open-on-reload"] if keep_open else []
        args = ["--policy", str(path), "--audit-log", str(log), *flags]
        with serving(tmp_path / "serve", *args) as proc:
            http, socks = proc.address("http"), proc.address("socks5")
            clients = []
            try:
                tunnel, status = connect_through(http, f"{LOOPBACK}:{tunneled.port}")
                clients.append(tunnel)
                assert status == 200
                clients.append(socks_connect(socks, socksed.port))
                clients.append(websocket(http, upgraded.port))
                clients.append(kept_alive(http, kept.port))
                stays, status = connect_through(http, f"{LOOPBACK}:{allowed.port}")
                clients.append(stays)
                assert status == 200
                for client in [*clients[:3], stays]:
                    assert carries(client)
                assert [o.accepted for o in found] == [1] * 5
                write_atomically(path, policy([o.port for o in found], [o.port for o in denied]))
                proc.send(signal.SIGHUP)
                proc.wait_stderr("policy reloaded")
                if keep_open:
                    time.sleep(STAYS_OPEN)
                    assert [o.closed for o in found] == [0] * 5
                    for client in clients[:3]:
                        assert carries(client)  # today's behaviour, by name
                    assert closures(log) == []
                else:
                    for origin in denied:
                        origin.wait_closed()  # judged at the origin
                    for client in clients[:4]:
                        assert sees_end(client)
                    assert closures(log) == sorted(
                        [
                            ("connect", tunneled.port),
                            ("socks5", socksed.port),
                            ("http", upgraded.port),
                            ("http", kept.port),
                        ]
                    )
                    err = proc.stderr()
                    assert err.count("closed: the reloaded policy denies it (deny_rule)") == 4
                # The allowed host's tunnel carries bytes across the reload either way.
                assert carries(stays, b"still here")
                assert allowed.closed == 0
                # A new request to a denied host is refused under the new policy.
                again, status = connect_through(http, f"{LOOPBACK}:{tunneled.port}")
                clients.append(again)
                assert status == 403
            finally:
                for client in clients:
                    client.close()
            assert proc.stop() == 0
        records = audit_lines(log)
        assert records[-1]["reason"] == "deny_rule"
        assert all(r["decision"] == "deny" for r in records if r["reason"] == "policy_reloaded")


def test_a_watched_reload_reaches_every_worker(tmp_path: Path) -> None:
    """--watch-policy with --workers 2: the parent sees the change and every worker closes
    the tunnels it holds (the kernel spread them across the workers)."""
    tunnels = 8
    with origins("echo", "echo") as (denied, allowed):
        path, log = tmp_path / "policy.toml", tmp_path / "audit.jsonl"
        path.write_text(policy([denied.port, allowed.port]))
        args = ["--policy", str(path), "--audit-log", str(log), "--watch-policy"]
        with serving(tmp_path / "serve", *args, "--workers", "2") as proc:
            http = proc.address("http")
            clients = []
            try:
                for _ in range(tunnels):
                    sock, status = connect_through(http, f"{LOOPBACK}:{denied.port}")
                    clients.append(sock)
                    assert status == 200 and carries(sock)
                stays, status = connect_through(http, f"{LOOPBACK}:{allowed.port}")
                clients.append(stays)
                assert status == 200
                write_atomically(path, policy([denied.port, allowed.port], [denied.port]))
                proc.wait_stderr("policy reloaded", timeout=RELOAD_TIMEOUT)
                denied.wait_closed(tunnels)
                assert carries(stays)
                assert allowed.closed == 0
            finally:
                for client in clients:
                    client.close()
            assert proc.stop() == 0
        assert closures(log) == [("connect", denied.port)] * tunnels


# -- approval questions held across a reload (serve --ask-command) ---------------------------

# The decider: logs its pid and question, waits (bounded) until the test says go, then
# answers what the test wrote for the question's protocols (deny when nothing was written).
ASK_SCRIPT = """\
#!/bin/sh
read line
dir=$(dirname "$0")
echo "$$ $line" >> "$dir/asked.log"
i=0
while [ ! -e "$dir/go" ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done
cat "$dir/answer.$EGRESSBOX_PROTOCOLS" 2>/dev/null || echo deny
"""


class Asker:
    """The --ask-command script in its own directory, and what it was asked."""

    def __init__(self, root: Path, answers: dict[str, str]) -> None:
        root.mkdir()
        self.root = root
        self.script = root / "ask.sh"
        self.script.write_text(ASK_SCRIPT)
        self.script.chmod(0o755)
        for protocols, answer in answers.items():
            (root / f"answer.{protocols}").write_text(answer + "\n")

    def asked(self) -> list[tuple[int, dict[str, object]]]:
        log = self.root / "asked.log"
        lines = log.read_text().splitlines() if log.exists() else []
        found = []
        for line in lines:
            pid, _, question = line.partition(" ")
            found.append((int(pid), json.loads(question)))
        return found

    def wait_asked(self, count: int) -> None:
        wait_until(f"{count} questions asked", lambda: len(self.asked()) >= count)

    def go(self) -> None:
        (self.root / "go").touch()


def _send_connect(proxy: tuple[str, int], target: str, source: str = LOOPBACK) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(IO_TIMEOUT)
    sock.bind((source, 0))
    sock.connect(proxy)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    return sock


def _reason(head: bytes) -> str:
    for line in head.decode("latin-1").split("\r\n"):
        name, _, value = line.partition(":")
        if name.lower() == "x-egressbox-reason":
            return value.strip()
    return ""


def _no_reply_yet(sock: socket.socket) -> bool:
    sock.settimeout(0.3)
    try:
        sock.recv(1)
    except TimeoutError:
        return True
    finally:
        sock.settimeout(IO_TIMEOUT)
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("answer", ["once", "session"])
@pytest.mark.parametrize("keep_open", [False, True], ids=["default", "keep-open-on-reload"])
def test_a_deny_entry_added_while_a_question_is_held_wins_over_the_answer(
    tmp_path: Path, answer: str, keep_open: bool
) -> None:
    asker = Asker(tmp_path / "ask", {"connect": answer})
    with origins("echo") as (tripwire,):
        path, log = tmp_path / "policy.toml", tmp_path / "audit.jsonl"
        path.write_text(policy([]))  # 127.0.0.1:port is a miss: asked about
        flags = ["--keep-open-on-reload"] if keep_open else []
        args = ["--policy", str(path), "--audit-log", str(log), "--ask-command", str(asker.script)]
        with serving(tmp_path / "serve", *args, "--ask-timeout", "30", *flags) as proc:
            target = f"{LOOPBACK}:{tripwire.port}"
            client = _send_connect(proc.address("http"), target)
            try:
                asker.wait_asked(1)
                write_atomically(path, policy([], [tripwire.port]))
                proc.send(signal.SIGHUP)
                proc.wait_stderr("policy reloaded")
                if keep_open:
                    # The question stands through the reload; its answer comes under the
                    # new policy, whose deny entry wins.
                    assert _no_reply_yet(client)
                    asker.go()
                    expected = "deny_rule"
                else:
                    # The reload refused the held request at once and killed the decider.
                    expected = "policy_reloaded"
                    (pid, _), *_ = asker.asked()
                    wait_until("the decider killed", lambda: not _alive(pid))
                head = _head(client)
                assert head.startswith(b"HTTP/1.1 403"), head
                assert _reason(head) == expected
                asker.go()
            finally:
                client.close()
            assert proc.stop() == 0
        assert tripwire.accepted == 0  # judged at the origin: never reached
        seen = [(r["protocol"], r["port"], r["decision"], r["reason"]) for r in audit_lines(log)]
        assert seen == [("connect", tripwire.port, "deny", expected)]


def test_open_questions_are_capped_per_client(tmp_path: Path) -> None:
    """Four slow questions from one client address: its fifth is denied unasked, while
    another client's miss is still asked."""
    asker = Asker(tmp_path / "ask", {})
    path, log = tmp_path / "policy.toml", tmp_path / "audit.jsonl"
    path.write_text(policy([]))
    args = ["--policy", str(path), "--audit-log", str(log), "--ask-command", str(asker.script)]
    with serving(tmp_path / "serve", *args) as proc:
        http = proc.address("http")
        clients = []
        try:
            # Distinct destinations (a question per host and port), all from 127.0.0.1.
            for n in range(4):
                clients.append(_send_connect(http, f"127.0.0.{2 + n}:9"))
            asker.wait_asked(4)
            fifth = _send_connect(http, "127.0.0.6:9")
            clients.append(fifth)
            head = _head(fifth)
            assert head.startswith(b"HTTP/1.1 403") and _reason(head) == "approval_denied"
            other = _send_connect(http, "127.0.0.7:9", source="127.0.0.9")
            clients.append(other)
            asker.wait_asked(5)  # asked, not denied unasked
            assert [q["host"] for _, q in asker.asked()][-1] == "127.0.0.7"
            assert len(asker.asked()) == 5
            asker.go()  # every answer is deny
            for client in [*clients[:4], other]:
                assert _reason(_head(client)) == "approval_denied"
        finally:
            for client in clients:
                client.close()
        assert proc.stop() == 0
    reasons = sorted(r["reason"] for r in audit_lines(log))
    assert reasons == ["approval_denied"] * 6


def test_once_about_http_does_not_admit_a_waiting_connect(tmp_path: Path) -> None:
    asker = Asker(tmp_path / "ask", {"http": "once", "connect": "deny"})
    with origins("http") as (origin,):
        path, log = tmp_path / "policy.toml", tmp_path / "audit.jsonl"
        path.write_text(policy([]))
        args = ["--policy", str(path), "--audit-log", str(log), "--ask-command", str(asker.script)]
        with serving(tmp_path / "serve", *args) as proc:
            http = proc.address("http")
            target = f"{LOOPBACK}:{origin.port}"
            plain = socket.create_connection(http, timeout=IO_TIMEOUT)
            tunnel = None
            try:
                plain.sendall(f"GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
                asker.wait_asked(1)
                tunnel = _send_connect(http, target)  # joins the question put about http
                time.sleep(0.3)
                asker.go()
                assert _head(plain).startswith(b"HTTP/1.1 200")
                head = _head(tunnel)
                assert head.startswith(b"HTTP/1.1 403") and _reason(head) == "approval_denied"
            finally:
                plain.close()
                if tunnel is not None:
                    tunnel.close()
            assert proc.stop() == 0
        assert origin.accepted == 1  # the tunnel never reached it
    assert [q["protocols"] for _, q in asker.asked()] == [["http"], ["connect"]]
    seen = sorted((r["protocol"], r["reason"]) for r in audit_lines(log))
    assert seen == [("connect", "approval_denied"), ("http", "approved")]
