"""`egressbox serve` as a real process: the DESIGN §4 contract, end to end.

Each test starts `python -m egressbox serve` with stdout and stderr going to
files (no pipe can fill up and block the proxy), waits for the ready line and
talks to it with blocking sockets over loopback. The origin is a small echo
server on 127.0.0.1; no test sends anything beyond 127.0.0.0/8 and ::1.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(sys.platform != "linux", reason="serve's contract is tested on Linux"),
]

# Python start-up plus imports on a loaded CI machine: generous, yet a hang fails.
READY_TIMEOUT = 20.0
# How long a stopping proxy may take to exit (drain_timeout below is 2 s).
EXIT_TIMEOUT = 20.0
# One socket operation against the proxy or the origin.
IO_TIMEOUT = 10.0
# Poll interval while waiting for a file to change or a port to close.
POLL = 0.02
# [limits] drain_timeout of the drain tests: small, with room for a slow machine
# to do the few round trips the test makes inside the window.
DRAIN_TIMEOUT = 2
# Exactly the keys of an audit record (DESIGN §6).
RECORD_KEYS = {"ts", "protocol", "host", "port", "decision", "reason"}
# A name no policy here allows (never resolved: the name rules deny it first).
DENIED = "denied.test"


# -- the DNS fixture, typed structurally --------------------------------------------
#
# tests/dnsserver.py is importable at run time (tests/conftest.py puts tests/ on
# sys.path), but a per-file mypy run cannot find it, so it is reached through
# importlib and used through this Protocol.


class DnsFixture(Protocol):
    @property
    def nameserver(self) -> tuple[str, int]: ...

    def set(self, name: str, *records: Any, truncate: bool = False) -> None: ...

    def queries_for(self, name: str) -> Sequence[object]: ...


def a_record(address: str) -> object:
    record: object = importlib.import_module("dnsserver").A(address)
    return record


# -- an echo origin on loopback -------------------------------------------------------


class EchoOrigin:
    """A threaded TCP echo server that counts the connections it accepts."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.listener = socket.create_server((host, 0))
        self.port: int = self.listener.getsockname()[1]
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                self._conns.append(conn)
                thread = threading.Thread(target=self._echo, args=(conn,), daemon=True)
                self._threads.append(thread)
            thread.start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                conn.sendall(data)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        # shutdown() wakes a thread blocked in accept() or recv() on Linux.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._acceptor.join(IO_TIMEOUT)
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(IO_TIMEOUT)
        for conn in conns:
            conn.close()


@pytest.fixture
def origin() -> Iterator[EchoOrigin]:
    server = EchoOrigin()
    try:
        yield server
    finally:
        server.close()


# -- the serve process ------------------------------------------------------------------


def split_authority(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


class Serve:
    """One `egressbox serve` process, its output files and its ready line."""

    def __init__(self, argv: list[str], workdir: Path) -> None:
        self.stdout_path = workdir / "serve.stdout"
        self.stderr_path = workdir / "serve.stderr"
        env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSBOX_")}
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env
            )
        self.ready: dict[str, str] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stdout(self) -> str:
        return self.stdout_path.read_text()

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_ready(self) -> dict[str, str]:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            text = self.stdout()
            if "\n" in text:
                line = text.split("\n", 1)[0]
                loaded = json.loads(line)
                assert isinstance(loaded, dict), line
                self.ready = {str(k): str(v) for k, v in loaded.items()}
                return self.ready
            code = self.proc.poll()
            if code is not None:
                pytest.fail(f"serve exited with {code} before its ready line:\n{self.stderr()}")
            time.sleep(POLL)
        pytest.fail(f"no ready line within {READY_TIMEOUT} s:\n{self.stderr()}")

    @property
    def http(self) -> tuple[str, int]:
        return split_authority(self.ready["http"])

    @property
    def socks(self) -> tuple[str, int]:
        return split_authority(self.ready["socks5"])

    def send(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = EXIT_TIMEOUT) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> int:
        """SIGTERM and wait for the exit code."""
        if self.proc.poll() is None:
            self.send(signal.SIGTERM)
        return self.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(EXIT_TIMEOUT)

    def wait_stderr(self, text: str, count: int = 1) -> str:
        """Wait until `text` appears `count` times on stderr; return all of stderr."""
        deadline = time.monotonic() + IO_TIMEOUT
        while time.monotonic() < deadline:
            err = self.stderr()
            if err.count(text) >= count:
                return err
            time.sleep(POLL)
        pytest.fail(f"{text!r} not seen {count}x on stderr:\n{self.stderr()}")


ServeFactory = Callable[..., Serve]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[ServeFactory]:
    """Start `egressbox serve --policy POLICY ARGS...`; every process is killed at the end."""
    started: list[Serve] = []

    def start(
        policy: Path, *args: str, nofile_soft: int | None = None, ready: bool = True
    ) -> Serve:
        argv = [sys.executable, "-m", "egressbox", "serve", "--policy", str(policy), *args]
        if nofile_soft is not None:
            # Lower the soft limit in a shell that then execs the proxy (same pid).
            argv = ["sh", "-c", 'ulimit -S -n "$0" && exec "$@"', str(nofile_soft), *argv]
        workdir = tmp_path / f"serve{len(started)}"
        workdir.mkdir()
        process = Serve(argv, workdir)
        started.append(process)
        if ready:
            process.wait_ready()
        return process

    try:
        yield start
    finally:
        for process in started:
            process.kill()


def write_policy(path: Path, text: str) -> Path:
    """Replace the policy file atomically (a reload never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def policy_text(allow: Sequence[str] = (), *, drain_timeout: float | None = None) -> str:
    lines = ["[egress]", f"allow = {json.dumps(list(allow))}", 'allow_cidrs = ["127.0.0.0/8"]']
    if drain_timeout is not None:
        lines += ["[limits]", f"drain_timeout = {drain_timeout}"]
    return "\n".join(lines) + "\n"


@pytest.fixture
def policy_file(tmp_path: Path, origin: EchoOrigin) -> Path:
    """A policy that allows the echo origin (by IP literal) and nothing else."""
    text = policy_text([f"127.0.0.1:{origin.port}"], drain_timeout=DRAIN_TIMEOUT)
    return write_policy(tmp_path / "policy.toml", text)


# -- clients ------------------------------------------------------------------------------


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def read_head(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """An HTTP response head: (status, lower-cased headers, bytes after the head)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError(f"connection closed inside the response head: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, rest


def http_connect(proxy: tuple[str, int], target: str) -> tuple[socket.socket, int, dict[str, str]]:
    """CONNECT through the proxy; returns the open socket, the status and the headers."""
    sock = socket.create_connection(proxy, timeout=IO_TIMEOUT)
    try:
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        status, headers, rest = read_head(sock)
    except BaseException:
        sock.close()
        raise
    if status == 200:
        assert rest == b""  # nothing from the origin yet: it only echoes
    return sock, status, headers


def connect_status(proxy: tuple[str, int], target: str) -> tuple[int, dict[str, str]]:
    sock, status, headers = http_connect(proxy, target)
    sock.close()
    return status, headers


def socks_connect(proxy: tuple[str, int], host: str, port: int) -> tuple[socket.socket, int]:
    """A SOCKS5 CONNECT (no auth, domain address); returns the socket and the reply code."""
    sock = socket.create_connection(proxy, timeout=IO_TIMEOUT)
    try:
        sock.sendall(b"\x05\x01\x00")
        assert recv_exact(sock, 2) == b"\x05\x00"
        name = host.encode()
        sock.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + port.to_bytes(2, "big"))
        reply = recv_exact(sock, 4)
        size = {1: 4, 4: 16}.get(reply[3]) or recv_exact(sock, 1)[0]
        recv_exact(sock, size + 2)
    except BaseException:
        sock.close()
        raise
    return sock, reply[1]


def roundtrip(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(payload)
    assert recv_exact(sock, len(payload)) == payload


def closed_by_peer(sock: socket.socket) -> bool:
    """Block until the peer ends the connection (EOF or reset); False on timeout."""
    try:
        return sock.recv(65536) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


def wait_refused(address: tuple[str, int]) -> None:
    """Wait until nothing accepts on `address` any more."""
    deadline = time.monotonic() + IO_TIMEOUT
    while time.monotonic() < deadline:
        try:
            probe = socket.create_connection(address, timeout=IO_TIMEOUT)
        except ConnectionRefusedError:
            return
        except ConnectionResetError:
            # A SYN that meets the listener while it closes is answered with
            # a reset: it is going away, and the next probe is refused.
            time.sleep(POLL)
            continue
        probe.close()
        time.sleep(POLL)
    pytest.fail(f"{address} still accepts connections")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def ipv6_loopback_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


def traffic(proc: Serve, origin: EchoOrigin) -> None:
    """One allowed tunnel, one denied CONNECT and one denied SOCKS request."""
    sock, status, _ = http_connect(proc.http, f"127.0.0.1:{origin.port}")
    with sock:
        assert status == 200
        roundtrip(sock, b"ping")
    assert connect_status(proc.http, f"{DENIED}:443")[0] == 403
    sock, code = socks_connect(proc.socks, DENIED, 443)
    sock.close()
    assert code == 0x02


# -- tests --------------------------------------------------------------------------------


def test_ready_line_then_nothing_on_stdout(
    serve: ServeFactory, policy_file: Path, origin: EchoOrigin
) -> None:
    proc = serve(policy_file)
    assert set(proc.ready) == {"event", "http", "socks5"}
    assert proc.ready["event"] == "ready"
    for host, port in (proc.http, proc.socks):
        assert host == "127.0.0.1"
        assert 0 < port < 65536
    traffic(proc, origin)
    # One diagnostic line per connection on stderr (no --quiet).
    err = proc.wait_stderr(f"socks5 {DENIED}:443 deny no_allow_rule")
    assert f"connect {DENIED}:443 deny no_allow_rule" in err
    assert proc.stop() == 0
    lines = proc.stdout().splitlines()
    assert len(lines) == 1, lines
    assert json.loads(lines[0]) == proc.ready


def test_ports_are_honoured(serve: ServeFactory, policy_file: Path) -> None:
    http_port, socks_port = free_port(), free_port()
    if http_port == socks_port:
        pytest.skip("the OS handed out the same free port twice")
    proc = serve(policy_file, "--http-port", str(http_port), "--socks-port", str(socks_port))
    assert proc.ready["http"] == f"127.0.0.1:{http_port}"
    assert proc.ready["socks5"] == f"127.0.0.1:{socks_port}"
    assert connect_status(proc.http, f"{DENIED}:443")[0] == 403
    assert proc.stop() == 0


@pytest.mark.skipif(not ipv6_loopback_available(), reason="no IPv6 loopback here")
def test_listen_on_ipv6_loopback(
    serve: ServeFactory, policy_file: Path, origin: EchoOrigin
) -> None:
    proc = serve(policy_file, "--listen", "::1")
    assert proc.ready["http"].startswith("[::1]:")
    assert proc.ready["socks5"].startswith("[::1]:")
    assert proc.http[0] == "::1"
    traffic(proc, origin)
    assert proc.stop() == 0


def test_bad_policy_exits_2_naming_the_key_and_the_fix(serve: ServeFactory, tmp_path: Path) -> None:
    bad = write_policy(tmp_path / "bad.toml", '[egress]\nallow = ["a.test"]\nalow_cidrs = []\n')
    proc = serve(bad, ready=False)
    assert proc.wait() == 2
    err = proc.stderr()
    assert "egress.alow_cidrs" in err
    assert 'did you mean "allow_cidrs"' in err
    assert proc.stdout() == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--http-port", "70000"], "--http-port: 70000 is not a TCP port"),
        (["--socks-port", "-1"], "--socks-port: -1 is not a TCP port"),
        (["--listen", "localhost"], "--listen: 'localhost' is not an IP address"),
    ],
    ids=["http-port", "socks-port", "listen"],
)
def test_bad_listen_arguments_are_usage_errors(
    serve: ServeFactory, policy_file: Path, args: list[str], message: str
) -> None:
    proc = serve(policy_file, *args, ready=False)
    assert proc.wait() == 2
    assert message in proc.stderr()
    assert proc.stdout() == ""


@pytest.mark.parametrize("flag", ["--http-port", "--socks-port"])
def test_port_in_use_exits_3(serve: ServeFactory, policy_file: Path, flag: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        proc = serve(policy_file, flag, str(taken.getsockname()[1]), ready=False)
        assert proc.wait() == 3
    assert "cannot start" in proc.stderr()
    assert proc.stdout() == ""


def test_sighup_reloads_a_valid_policy_and_keeps_the_old_on_a_broken_one(
    serve: ServeFactory, tmp_path: Path, origin: EchoOrigin
) -> None:
    target = f"127.0.0.1:{origin.port}"
    path = write_policy(tmp_path / "policy.toml", policy_text(["placeholder.test:443"]))
    proc = serve(path, "--quiet")
    status, headers = connect_status(proc.http, target)
    assert (status, headers["x-egressbox-reason"]) == (403, "no_allow_rule")

    write_policy(path, policy_text([target]))
    proc.send(signal.SIGHUP)
    proc.wait_stderr("policy reloaded")
    sock, status, _ = http_connect(proc.http, target)
    with sock:
        assert status == 200
        roundtrip(sock, b"after reload")

    write_policy(path, policy_text([target]) + "alow = []\n")  # in [egress]: unknown key
    proc.send(signal.SIGHUP)
    err = proc.wait_stderr("reload refused")
    assert "egress.alow" in err
    sock, status, _ = http_connect(proc.http, target)
    with sock:
        assert status == 200  # the old (second) policy still decides
        roundtrip(sock, b"still allowed")
    assert proc.stop() == 0
    assert proc.stdout().count("\n") == 1


def read_line_raw(fd: int) -> bytes:
    """One line from a pipe with plain read(2)s (no buffering delay), within READY_TIMEOUT."""
    line = b""
    deadline = time.monotonic() + READY_TIMEOUT
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            pytest.fail(f"no ready line within {READY_TIMEOUT} s")
        chunk = os.read(fd, 4096)
        assert chunk, "serve closed stdout before its ready line"
        line += chunk
    return line


def test_sighup_right_after_the_ready_line_reloads(policy_file: Path) -> None:
    # A supervisor may signal the moment it reads the ready line, so the
    # handlers must be in place by then (SIGHUP's default action kills).
    # Read through a pipe to signal as early as possible; a few rounds,
    # since a missing handler loses this race often, not always.
    argv = [sys.executable, "-m", "egressbox", "serve", "--policy", str(policy_file), "--quiet"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSBOX_")}
    for _ in range(3):
        with subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        ) as proc:
            try:
                assert proc.stdout is not None
                line = read_line_raw(proc.stdout.fileno())
                proc.send_signal(signal.SIGHUP)
                assert json.loads(line)["event"] == "ready"
                proc.send_signal(signal.SIGTERM)
                _, err = proc.communicate(timeout=EXIT_TIMEOUT)
            finally:
                if proc.poll() is None:
                    proc.kill()
            assert proc.returncode == 0, err
            assert b"policy reloaded" in err


def test_sighup_applies_changed_dns_settings(
    serve: ServeFactory, tmp_path: Path, origin: EchoOrigin, dns_server: DnsFixture
) -> None:
    dns_server.set("echo.test", a_record("127.0.0.1"))
    allow = policy_text([f"echo.test:{origin.port}"])
    host, port = dns_server.nameserver
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))  # a "DNS server" that never answers
        dead = silent.getsockname()[1]
        path = tmp_path / "policy.toml"
        write_policy(path, allow + f'[dns]\nnameservers = ["127.0.0.1:{dead}"]\ntimeout = 0.2\n')
        proc = serve(path, "--quiet")
        status, headers = connect_status(proc.http, f"echo.test:{origin.port}")
        assert (status, headers["x-egressbox-reason"]) == (504, "dns_timeout")

        write_policy(path, allow + f'[dns]\nnameservers = ["{host}:{port}"]\n')
        proc.send(signal.SIGHUP)
        proc.wait_stderr("policy reloaded")
        sock, status, _ = http_connect(proc.http, f"echo.test:{origin.port}")
        with sock:
            assert status == 200
            roundtrip(sock, b"new resolver")
    assert proc.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_then_aborts_and_exits_0(
    serve: ServeFactory, policy_file: Path, origin: EchoOrigin, sig: signal.Signals
) -> None:
    proc = serve(policy_file, "--quiet")
    target = f"127.0.0.1:{origin.port}"
    finishing, status_a, _ = http_connect(proc.http, target)
    lingering, status_b, _ = http_connect(proc.http, target)
    with finishing, lingering:
        assert (status_a, status_b) == (200, 200)
        roundtrip(finishing, b"a")
        roundtrip(lingering, b"b")

        proc.send(sig)
        # Stop accepting: both listeners go away while the tunnels stay up.
        wait_refused(proc.http)
        wait_refused(proc.socks)
        # An open tunnel can finish its work inside drain_timeout...
        roundtrip(finishing, b"finishing during the drain")
        finishing.shutdown(socket.SHUT_WR)
        assert closed_by_peer(finishing)
        # ...while the other one is still up...
        roundtrip(lingering, b"still up")
        # ...until drain_timeout passes and it is aborted.
        lingering.settimeout(EXIT_TIMEOUT)
        assert closed_by_peer(lingering)
    assert proc.wait() == 0
    assert proc.stdout().count("\n") == 1
    assert origin.accepted == 2


def test_soft_nofile_limit_is_raised_to_the_hard_limit(
    serve: ServeFactory, policy_file: Path
) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    soft = hard if hard == resource.RLIM_INFINITY else min(256, hard)
    proc = serve(policy_file, nofile_soft=soft)
    limits = Path(f"/proc/{proc.pid}/limits").read_text()
    line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
    fields = line.split()  # Max open files SOFT HARD files
    assert fields[3] == fields[4], line
    assert fields[4] == ("unlimited" if hard == resource.RLIM_INFINITY else str(hard))
    assert proc.stop() == 0


def test_quiet_silences_the_per_connection_lines(
    serve: ServeFactory, policy_file: Path, origin: EchoOrigin
) -> None:
    proc = serve(policy_file, "--quiet")
    traffic(proc, origin)
    assert proc.stop() == 0
    assert proc.stderr() == ""
    assert proc.stdout().count("\n") == 1


def expected_records(origin: EchoOrigin) -> list[tuple[str, str, int, str, str]]:
    return [
        ("connect", "127.0.0.1", origin.port, "allow", "allowed"),
        ("connect", DENIED, 443, "deny", "no_allow_rule"),
        ("socks5", DENIED, 443, "deny", "no_allow_rule"),
    ]


def parse_records(lines: Sequence[str]) -> list[tuple[str, str, int, str, str]]:
    found = []
    for line in lines:
        record = json.loads(line)
        assert set(record) == RECORD_KEYS, record
        found.append(
            (
                record["protocol"],
                record["host"],
                record["port"],
                record["decision"],
                record["reason"],
            )
        )
    return found


def test_audit_log_file_gets_one_record_per_decision(
    serve: ServeFactory, policy_file: Path, origin: EchoOrigin, tmp_path: Path
) -> None:
    log = tmp_path / "audit.jsonl"
    proc = serve(policy_file, "--quiet", "--audit-log", str(log))
    traffic(proc, origin)
    assert proc.stop() == 0
    assert parse_records(log.read_text().splitlines()) == expected_records(origin)
    assert proc.stdout().count("\n") == 1


def test_audit_log_dash_puts_only_records_after_the_ready_line(
    serve: ServeFactory, policy_file: Path, origin: EchoOrigin
) -> None:
    proc = serve(policy_file, "--quiet", "--audit-log", "-")
    traffic(proc, origin)
    assert proc.stop() == 0
    first, *rest = proc.stdout().splitlines()
    assert json.loads(first) == proc.ready
    assert parse_records(rest) == expected_records(origin)


def test_nameserver_is_the_only_resolver(
    serve: ServeFactory, tmp_path: Path, origin: EchoOrigin, dns_server: DnsFixture
) -> None:
    dns_server.set("echo.test", a_record("127.0.0.1"))
    allow = [f"echo.test:{origin.port}", f"localhost:{origin.port}"]
    path = write_policy(tmp_path / "policy.toml", policy_text(allow))
    host, port = dns_server.nameserver
    proc = serve(path, "--quiet", "--nameserver", f"{host}:{port}")

    sock, status, _ = http_connect(proc.http, f"echo.test:{origin.port}")
    with sock:
        assert status == 200
        roundtrip(sock, b"via the test DNS server")
    assert dns_server.queries_for("echo.test")
    # The hosts file is not consulted: the test server knows no "localhost".
    status, headers = connect_status(proc.http, f"localhost:{origin.port}")
    assert (status, headers["x-egressbox-reason"]) == (502, "dns_failure")
    assert dns_server.queries_for("localhost")
    # Names outside every allow entry are never resolved.
    assert connect_status(proc.http, f"{DENIED}:443")[0] == 403
    assert not dns_server.queries_for(DENIED)
    assert proc.stop() == 0
    assert origin.accepted == 1


# -- --workers N ----------------------------------------------------------------------------
#
# Black-box: which process serves a connection is read from /proc (the workers are
# the serve process's children; a worker holds an accepted connection as a socket
# whose inode /proc/net/tcp lists with the proxy's port as its local port).

# Connections held open at once to see both workers accept: with SO_REUSEPORT the
# kernel hashes each connection's addresses, so all 40 on one of 2 workers has a
# chance of 2**-39.
SPREAD = 40
# TCP state ESTABLISHED in /proc/net/tcp.
TCP_ESTABLISHED = "01"


def child_pids(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    found.append(int(entry))
    return sorted(found)


def gone(pid: int) -> bool:
    """True when pid no longer runs (absent, or a zombie nobody has reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def wait_gone(pids: Sequence[int]) -> None:
    deadline = time.monotonic() + EXIT_TIMEOUT
    while time.monotonic() < deadline:
        if all(gone(pid) for pid in pids):
            return
        time.sleep(POLL)
    pytest.fail(f"still running: {[pid for pid in pids if not gone(pid)]}")


def worker_pids(proc: Serve, count: int) -> list[int]:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        pids = child_pids(proc.pid)
        if len(pids) == count:
            return pids
        time.sleep(POLL)
    pytest.fail(f"expected {count} workers, found {child_pids(proc.pid)}")


def established_on(pid: int, port: int) -> int:
    """Established TCP connections that `pid` holds with local port `port`."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].rsplit(":", 1)[1], 16)
        if local_port == port and fields[3] == TCP_ESTABLISHED and fields[9] in inodes:
            count += 1
    return count


class HttpOrigin:
    """A threaded loopback HTTP server answering every GET with a short body."""

    BODY = b"hello from the origin\n"

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        body = self.BODY

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port: int = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(IO_TIMEOUT)


@pytest.fixture
def http_origin() -> Iterator[HttpOrigin]:
    server = HttpOrigin()
    try:
        yield server
    finally:
        server.close()


def http_get(proxy: tuple[str, int], port: int) -> tuple[int, bytes]:
    """A plain-HTTP GET for the origin on 127.0.0.1:port through the proxy."""
    with socket.create_connection(proxy, timeout=IO_TIMEOUT) as sock:
        sock.sendall(
            f"GET http://127.0.0.1:{port}/x HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        status, headers, rest = read_head(sock)
        length = int(headers.get("content-length", "0"))
        return status, rest + recv_exact(sock, length - len(rest))


def audit_lines(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert set(record) == RECORD_KEYS, record
        records.append(record)
    return records


def test_workers_share_the_ports_and_each_serves(
    serve: ServeFactory,
    tmp_path: Path,
    origin: EchoOrigin,
    http_origin: HttpOrigin,
) -> None:
    allow = [f"127.0.0.1:{origin.port}", f"127.0.0.1:{http_origin.port}"]
    path = write_policy(tmp_path / "policy.toml", policy_text(allow, drain_timeout=DRAIN_TIMEOUT))
    log = tmp_path / "audit.jsonl"
    proc = serve(path, "--workers", "2", "--quiet", "--audit-log", str(log))
    assert set(proc.ready) == {"event", "http", "socks5"}
    workers = worker_pids(proc, 2)
    tunnels = []
    try:
        for _ in range(SPREAD):
            sock, status, _ = http_connect(proc.http, f"127.0.0.1:{origin.port}")
            tunnels.append(sock)
            assert status == 200
            roundtrip(sock, b"ping")
        held = [established_on(pid, proc.http[1]) for pid in workers]
    finally:
        for sock in tunnels:
            sock.close()
    assert sum(held) == SPREAD, held
    assert all(count > 0 for count in held), held
    for _ in range(10):
        assert http_get(proc.http, http_origin.port) == (200, HttpOrigin.BODY)
    sock, code = socks_connect(proc.socks, "127.0.0.1", origin.port)
    with sock:
        assert code == 0
        roundtrip(sock, b"socks")
    assert proc.stop() == 0
    wait_gone(workers)
    assert proc.stdout().splitlines() == [json.dumps(proc.ready)]
    records = audit_lines(log)
    assert len(records) == SPREAD + 10 + 1
    assert {r["decision"] for r in records} == {"allow"}


def test_workers_audit_log_under_load_has_whole_lines(
    serve: ServeFactory, policy_file: Path, origin: EchoOrigin, tmp_path: Path
) -> None:
    log = tmp_path / "audit.jsonl"
    proc = serve(policy_file, "--workers", "2", "--quiet", "--audit-log", str(log))
    threads, per_thread = 4, 40
    errors: list[BaseException] = []

    def load() -> None:
        try:
            for i in range(per_thread):
                if i % 2:
                    assert connect_status(proc.http, f"{DENIED}:443")[0] == 403
                else:
                    sock, status, _ = http_connect(proc.http, f"127.0.0.1:{origin.port}")
                    with sock:
                        assert status == 200
                        roundtrip(sock, b"x" * 100)
        except BaseException as exc:
            errors.append(exc)

    runners = [threading.Thread(target=load) for _ in range(threads)]
    for runner in runners:
        runner.start()
    for runner in runners:
        runner.join(EXIT_TIMEOUT * 2)
    assert not errors, errors
    assert proc.stop() == 0
    records = audit_lines(log)
    assert len(records) == threads * per_thread
    assert sum(r["decision"] == "deny" for r in records) == threads * per_thread // 2


def test_workers_sighup_reloads_every_worker_and_says_it_once(
    serve: ServeFactory, tmp_path: Path, origin: EchoOrigin
) -> None:
    target = f"127.0.0.1:{origin.port}"
    path = write_policy(tmp_path / "policy.toml", policy_text([target]))
    proc = serve(path, "--workers", "2", "--quiet")
    for _ in range(10):
        assert connect_status(proc.http, target)[0] == 200

    write_policy(path, policy_text(["placeholder.test:443"]))
    proc.send(signal.SIGHUP)
    proc.wait_stderr("policy reloaded")
    for _ in range(SPREAD):  # fresh connections, spread over both workers
        status, headers = connect_status(proc.http, target)
        assert (status, headers["x-egressbox-reason"]) == (403, "no_allow_rule")

    write_policy(path, policy_text([target]) + "alow = []\n")  # in [egress]: unknown key
    proc.send(signal.SIGHUP)
    err = proc.wait_stderr("reload refused")
    assert "egress.alow" in err
    for _ in range(10):
        assert connect_status(proc.http, target)[0] == 403  # the second policy still decides
    assert proc.stop() == 0
    err = proc.stderr()
    # Said once, after every worker answered, not once per worker.
    assert err.count("policy reloaded") == 1, err
    assert err.count("reload refused") == 1, err


def test_workers_sigusr1_reopens_the_log_in_every_worker(
    serve: ServeFactory, policy_file: Path, tmp_path: Path
) -> None:
    log = tmp_path / "audit.jsonl"
    proc = serve(policy_file, "--workers", "2", "--quiet", "--audit-log", str(log))
    for _ in range(5):
        assert connect_status(proc.http, f"{DENIED}:443")[0] == 403
    moved = tmp_path / "audit.jsonl.1"
    log.rename(moved)
    proc.send(signal.SIGUSR1)
    # Both workers reopen within moments; wait until a fresh file exists, then some more.
    deadline = time.monotonic() + IO_TIMEOUT
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(POLL)
    time.sleep(0.5)
    for _ in range(SPREAD):
        assert connect_status(proc.http, f"{DENIED}:443")[0] == 403
    assert proc.stop() == 0
    assert len(audit_lines(moved)) == 5
    assert len(audit_lines(log)) == SPREAD


def test_workers_a_dead_worker_stops_the_others(serve: ServeFactory, policy_file: Path) -> None:
    proc = serve(policy_file, "--workers", "3", "--quiet")
    victim, *others = worker_pids(proc, 3)
    os.kill(victim, signal.SIGKILL)
    assert proc.wait() == 1
    assert f"worker {victim} was killed by SIGKILL unexpectedly" in proc.stderr()
    wait_gone(others)
    wait_refused(proc.http)


def test_workers_die_with_a_killed_parent(serve: ServeFactory, policy_file: Path) -> None:
    proc = serve(policy_file, "--workers", "2", "--quiet")
    workers = worker_pids(proc, 2)
    proc.kill()
    wait_gone(workers)
    wait_refused(proc.http)


def test_workers_sigterm_drains_and_exits_0(
    serve: ServeFactory, policy_file: Path, origin: EchoOrigin
) -> None:
    proc = serve(policy_file, "--workers", "2", "--quiet")
    workers = worker_pids(proc, 2)
    sock, status, _ = http_connect(proc.http, f"127.0.0.1:{origin.port}")
    with sock:
        assert status == 200
        proc.send(signal.SIGTERM)
        wait_refused(proc.http)
        roundtrip(sock, b"finishing during the drain")
    assert proc.wait() == 0
    wait_gone(workers)
    assert proc.stderr() == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "argument --workers: 0 is out of range"),
        (["--workers", "257"], "argument --workers: 257 is out of range"),
        (["--workers", "two"], "argument --workers: 'two' is not a number"),
        (
            ["--workers", "2", "--audit-log", "a.jsonl", "--audit-max-bytes", "1000"],
            "--audit-max-bytes cannot be combined with --workers",
        ),
    ],
    ids=["zero", "too-many", "not-a-number", "rotation"],
)
def test_workers_usage_errors(
    serve: ServeFactory, policy_file: Path, args: list[str], message: str
) -> None:
    proc = serve(policy_file, *args, ready=False)
    assert proc.wait() == 2
    assert message in proc.stderr()
    assert proc.stdout() == ""


def test_workers_port_in_use_exits_3(serve: ServeFactory, policy_file: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        proc = serve(policy_file, "--workers", "2", "--http-port", port, ready=False)
        assert proc.wait() == 3
    assert "cannot start" in proc.stderr()
    assert proc.stdout() == ""
    assert child_pids(proc.pid) == []


def test_workers_auto_starts(serve: ServeFactory, policy_file: Path) -> None:
    proc = serve(policy_file, "--workers", "auto", "--quiet")
    assert connect_status(proc.http, f"{DENIED}:443")[0] == 403
    assert proc.stop() == 0


def test_workers_sigterm_while_starting_stops_everything(
    serve: ServeFactory, policy_file: Path
) -> None:
    # Workers may be anywhere in their start (even waiting for the go after the
    # ready report): a stop must reach them all, and nobody may hang.
    for _ in range(3):
        proc = serve(policy_file, "--workers", "2", "--quiet", ready=False)
        workers = worker_pids(proc, 2)
        proc.send(signal.SIGTERM)
        assert proc.wait() == 0, proc.stderr()
        wait_gone(workers)
