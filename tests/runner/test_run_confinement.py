"""`egressbox run` confinement, end to end, as the invoking user and as an unprivileged user.

One probe program (generated from the `probe_*` functions below into a workspace under /tmp)
performs named checks and prints one JSON line per check. The test runs it twice with the same
checks: plainly, to prove the probe really reaches what it aims at, and under `egressbox run`,
where it must not. Each run is its own process tree; the unprivileged user's runs go through
`runuser` with a venv built for it (tests/unprivileged.py). A `grandchild` variant
makes the probe re-run itself as a child of the confined command: confinement is inherited.

Listeners the probe aims at are started here, in the test process, on loopback only: TCP over
IPv4 and IPv6, UDP over both, a NETLINK_USERSOCK socket, pathname unix sockets in the host's
/tmp and /run, an abstract unix socket, and two HTTP origins (one the policy admits, one it
does not). Each listener records the tokens it receives, so "reached" is seen from the
listener's side, not only from the probe's. No byte leaves 127.0.0.0/8, ::1 or namespaces
created here. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import inspect
import json
import mmap
import os
import platform
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from unprivileged import (
    BASE_DIR,
    Actor,
    invoking_actor,
)

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="confinement is Linux only"),
    # The first test as the unprivileged user may build its venv (pip install) once.
    pytest.mark.timeout(900),
]

# A whole probe run (egressbox start-up, every check, the proxy's shutdown).
RUN_TIMEOUT = 120.0
# How long the test waits for the probe's handshake file, and the probe for the answer.
HANDSHAKE_WAIT = 30.0
POLL = 0.02
# How long a listener may take to record a datagram the probe reports sent.
DELIVERY_WAIT = 5.0
# One socket operation in a listener thread.
IO_TIMEOUT = 5.0
# A listener thread's accept/recv tick (how quickly it notices it should stop).
TICK = 0.1
NETLINK_USERSOCK = 2
IPPROTO_MPTCP = 262
SIGSYS_EXIT = 128 + signal.SIGSYS
# TCP dials that capture takes to the proxy (which refuses them) instead of failing in the child.
CAPTURED_TCP = frozenset({"tcp4", "tcp6", "proxy_port_on_127.0.0.2", "proxy_port_on_::1"})
SSH_SECRET = "-----BEGIN OPENSSH PRIVATE KEY----- egressbox test key\n"
AWS_SECRET = "[default]\naws_secret_access_key = egressbox-test-secret\n"


# ======================================================================================
# The probe. These functions are copied verbatim (inspect.getsource) into probe.py, which
# runs with the standard library only: no pytest, no egressbox. A check returns (ok, detail);
# an OSError becomes ok=false with its errno name.
# ======================================================================================


def probe_main(argv: list[str]) -> int:
    """probe.py SPEC [DEPTH]: run SPEC's checks, or (DEPTH > 0) a child that runs them."""
    with open(argv[1], encoding="utf-8") as handle:
        spec = json.load(handle)
    depth = int(argv[2]) if len(argv) > 2 else int(spec["depth"])
    if depth > 0:
        command = [sys.executable, os.path.abspath(__file__), argv[1], str(depth - 1)]
        child = subprocess.run(command, check=False, timeout=300)
        probe_emit("__child__", child.returncode == 0, None, str(child.returncode))
        return 0
    for item in spec["checks"]:
        probe_one(item["name"], item["kind"], item["args"])
    return 0


def probe_emit(name: str, ok: bool, err: int | None, detail: str) -> None:
    code = errno.errorcode.get(err, str(err)) if err else None
    line = {"check": name, "ok": ok, "errno": code, "detail": detail, "pid": os.getpid()}
    print(json.dumps(line), flush=True)


def probe_one(name: str, kind: str, args: list[Any]) -> None:
    function = globals()[f"probe_{kind}"]
    try:
        ok, detail = function(*args)
    except OSError as exc:
        probe_emit(name, False, exc.errno, f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        probe_emit(name, False, None, repr(exc))
    else:
        probe_emit(name, bool(ok), None, str(detail))


def probe_echo(sock: socket.socket, token: str) -> tuple[bool, str]:
    """Send a token line on a connected stream and read the listener's echo."""
    line = token.encode() + b"\n"
    sock.sendall(line)
    reply = b""
    while not reply.endswith(b"\n") and len(reply) < 4096:
        data = sock.recv(4096)
        if not data:
            break
        reply += data
    return reply == line, f"echo {reply[:100]!r}"


def probe_stream(address: str, port: int, token: str, protocol: int = 0) -> tuple[bool, str]:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM, protocol) as sock:
        sock.settimeout(5)
        sock.connect((address, port))
        return probe_echo(sock, token)


def probe_udp(address: str, port: int, token: str) -> tuple[bool, str]:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        sock.sendto(token.encode() + b"\n", (address, port))
        reply, _ = sock.recvfrom(4096)
        return reply == token.encode() + b"\n", f"echo {reply[:100]!r}"


def probe_unix(path: str, token: str) -> tuple[bool, str]:
    address = "\0" + path[1:] if path.startswith("@") else path
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(address)
        return probe_echo(sock, token)


def probe_udp_datagram(port: int, token: str) -> bytes:
    """A UDP header (source port 9, checksum 0) and the token line."""
    payload = token.encode() + b"\n"
    return struct.pack("!HHHH", 9, port, 8 + len(payload), 0) + payload


def probe_raw(port: int, token: str) -> tuple[bool, str]:
    # The kernel adds the IP header; the datagram reaches the UDP listener.
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP) as sock:
        sock.sendto(probe_udp_datagram(port, token), ("127.0.0.1", 0))
    return True, "sent a UDP datagram through a raw IP socket"


def probe_packet(port: int, token: str) -> tuple[bool, str]:
    """A whole Ethernet frame on lo: the loopback device hands it to the local IP stack.

    IPv6, because IPv4 drops 127.0.0.1 arriving without a route attached as a martian.
    """
    payload = token.encode() + b"\n"
    loopback = socket.inet_pton(socket.AF_INET6, "::1")
    length = 8 + len(payload)
    udp = struct.pack("!HHHH", 9, port, length, 0) + payload
    pseudo = loopback + loopback + struct.pack("!I3xB", length, socket.IPPROTO_UDP) + udp
    pseudo += bytes(len(pseudo) % 2)
    total = sum(struct.unpack(f"!{len(pseudo) // 2}H", pseudo))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    udp = udp[:6] + struct.pack("!H", (~total & 0xFFFF) or 0xFFFF) + udp[8:]
    header = struct.pack(
        "!IHBB16s16s", 0x60000000, length, socket.IPPROTO_UDP, 64, loopback, loopback
    )
    frame = bytes(12) + b"\x86\xdd" + header + udp
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as sock:
        sock.sendto(frame, ("lo", 0))
    return True, "sent an Ethernet frame on lo through a packet socket"


def probe_netlink(portid: int, token: str) -> tuple[bool, str]:
    payload = token.encode() + b"\n"
    message = struct.pack("=LHHLL", 16 + len(payload), 0x10, 0, 1, 0) + payload
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 2) as sock:  # NETLINK_USERSOCK
        sock.sendto(message, (portid, 0))
    return True, f"sent a NETLINK_USERSOCK message to port id {portid}"


def probe_fastopen(port: int, token: str) -> tuple[bool, str]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        line = token.encode() + b"\n"
        # Blocking: without a cookie yet, the kernel connects first, then sends.
        sock.sendto(line, 0x20000000, ("127.0.0.1", port))  # MSG_FASTOPEN
        sock.settimeout(5)
        reply = b""
        while not reply.endswith(b"\n") and len(reply) < 4096:
            data = sock.recv(4096)
            if not data:
                break
            reply += data
        return reply == line, f"echo {reply[:100]!r}"


def probe_syscall(number: int, *args: Any) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    converted = [a if isinstance(a, ctypes.Array) or a is None else ctypes.c_long(a) for a in args]
    result = int(libc.syscall(ctypes.c_long(number), *converted))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), f"syscall {number}")
    return result


def probe_io_uring(port: int, token: str) -> tuple[bool, str]:
    """IORING_OP_CONNECT to the TCP listener (io_uring's operations never pass seccomp)."""
    params = ctypes.create_string_buffer(120)  # struct io_uring_params
    ring = probe_syscall(425, 4, params)  # io_uring_setup: one number on every arch
    try:
        sq_entries, cq_entries = struct.unpack_from("=II", params, 0)
        sq_head, sq_tail, sq_mask, _, _, _, sq_array = struct.unpack_from("=7I", params, 40)
        cq_head, _, cq_mask_at, _, _, cq_cqes = struct.unpack_from("=6I", params, 80)
        sq_ring = mmap.mmap(ring, sq_array + 4 * sq_entries, offset=0)
        cq_ring = mmap.mmap(ring, cq_cqes + 16 * cq_entries, offset=0x8000000)
        sqes = mmap.mmap(ring, 64 * sq_entries, offset=0x10000000)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with sock:
            raw = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port)
            address = ctypes.create_string_buffer(raw + socket.inet_aton("127.0.0.1") + bytes(8))
            # opcode IORING_OP_CONNECT (16), fd, off = addrlen, addr, user_data
            sqe = (16, 0, 0, sock.fileno(), 16, ctypes.addressof(address), 0, 0, 7)
            struct.pack_into("=BBHiQQIIQ", sqes, 0, *sqe)
            tail = struct.unpack_from("=I", sq_ring, sq_tail)[0]
            mask = struct.unpack_from("=I", sq_ring, sq_mask)[0]
            struct.pack_into("=I", sq_ring, sq_array + 4 * (tail & mask), 0)
            struct.pack_into("=I", sq_ring, sq_tail, tail + 1)
            probe_syscall(426, ring, 1, 1, 1, None, 0)  # io_uring_enter(..., GETEVENTS)
            head = struct.unpack_from("=I", cq_ring, cq_head)[0]
            cq_mask = struct.unpack_from("=I", cq_ring, cq_mask_at)[0]
            _, result, _ = struct.unpack_from("=QiI", cq_ring, cq_cqes + 16 * (head & cq_mask))
            del sq_head
            if result < 0:
                raise OSError(-result, os.strerror(-result), "IORING_OP_CONNECT")
            sock.settimeout(5)
            return probe_echo(sock, token)
    finally:
        os.close(ring)


def probe_int80(port: int, token: str) -> tuple[bool, str]:
    """socket(AF_INET, SOCK_DGRAM) through the i386 ABI, then a datagram to the listener."""
    if platform.machine() != "x86_64":
        return False, f"not x86_64 ({platform.machine()})"
    # push rbx; mov eax, 359 (i386 socket); mov ebx, 2; mov ecx, 2; xor edx, edx;
    # int 0x80; pop rbx; ret
    code = bytes.fromhex("53b867010000bb02000000b90200000031d2cd805bc3")
    prot = mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=prot)
    page.write(code)
    function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    fd = int(function())
    if fd < 0:
        raise OSError(-fd, os.strerror(-fd), "i386 socket")
    with socket.socket(fileno=fd) as sock:
        sock.sendto(token.encode() + b"\n", ("127.0.0.1", port))
    return True, f"an i386 socket() gave fd {fd}"


def probe_proxy_port(variable: str, address: str, token: str, handshake: str) -> tuple[bool, str]:
    """The proxy's port (from the proxy variable) on another address, after a handshake.

    The probe writes the port; the test then listens on `address` at that port on the host
    and answers with a `go` file.
    """
    port = int(os.environ[variable].rstrip("/").rsplit(":", 1)[1])
    go = os.path.join(handshake, "go")
    if not os.path.exists(go):
        staged = os.path.join(handshake, "port.tmp")
        with open(staged, "w", encoding="ascii") as handle:
            handle.write(str(port))
        os.rename(staged, os.path.join(handshake, "port"))
        for _ in range(int(30 / 0.02)):
            if os.path.exists(go):
                break
            time.sleep(0.02)
        else:
            raise TimeoutError("no answer to the handshake")
    ok, detail = probe_stream(address, port, token)
    return ok, f"port {port}: {detail}"


def probe_kill_parent(variable: str) -> tuple[bool, str]:
    pid = int(os.environ[variable])
    os.kill(pid, signal.SIGCONT)  # harmless to a running process, but a real signal
    return True, f"sent SIGCONT to {pid}"


def probe_ptrace_parent(variable: str) -> tuple[bool, str]:
    """PTRACE_SEIZE (no stop) from a forked child; its exit detaches at once."""
    pid = int(os.environ[variable])
    child = os.fork()
    if child == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.ptrace.restype = ctypes.c_long
        result = libc.ptrace(ctypes.c_long(0x4206), ctypes.c_long(pid), None, None)
        os._exit(0 if result == 0 else min(ctypes.get_errno() or 254, 254))
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise OSError(code, os.strerror(code), f"PTRACE_SEIZE {pid}")
    return True, f"seized {pid}"


def probe_read(path: str, expected: str) -> tuple[bool, str]:
    with open(path, encoding="utf-8") as handle:
        data = handle.read()
    return data == expected, f"read {len(data)} bytes"


def probe_write(path: str, content: str) -> tuple[bool, str]:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(content)
    return True, "written"


def probe_http_curl(url: str) -> tuple[bool, str]:
    """GET with curl (proxy from the environment); detail starts with the status."""
    command = ["curl", "-q", "--silent", "--show-error", "--output", "/dev/null"]
    command += ["--write-out", "%{http_code}", "--max-time", "20", url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    status = done.stdout.strip() or "000"
    return status == "200", f"{status} curl exit {done.returncode} {done.stderr.strip()[-200:]}"


def probe_http_python(url: str) -> tuple[bool, str]:
    """GET with urllib (proxy from the environment); detail starts with the status."""
    try:
        with urllib.request.urlopen(url, timeout=20) as response:
            return response.status == 200, f"{response.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{exc.code}"


PROBE_FUNCTIONS: tuple[Callable[..., Any], ...] = (
    probe_main,
    probe_emit,
    probe_one,
    probe_echo,
    probe_stream,
    probe_udp,
    probe_unix,
    probe_udp_datagram,
    probe_raw,
    probe_packet,
    probe_netlink,
    probe_fastopen,
    probe_syscall,
    probe_io_uring,
    probe_int80,
    probe_proxy_port,
    probe_kill_parent,
    probe_ptrace_parent,
    probe_read,
    probe_write,
    probe_http_curl,
    probe_http_python,
)
PROBE_IMPORTS = (
    "ctypes errno json mmap os platform signal socket struct subprocess sys time "
    "urllib.error urllib.request"
)


def probe_source() -> str:
    head = '"""Generated by test_run_confinement.py: runs named checks, one JSON line each."""\n'
    head += "from __future__ import annotations\n\n"
    head += "".join(f"import {name}\n" for name in PROBE_IMPORTS.split())
    head += "from typing import Any\n\n\n"
    body = "\n\n".join(inspect.getsource(function) for function in PROBE_FUNCTIONS)
    return head + body + '\n\nif __name__ == "__main__":\n    sys.exit(probe_main(sys.argv))\n'


# ======================================================================================
# Listeners (in this process, loopback only)
# ======================================================================================


class Recorder:
    """Threads that serve listening sockets and remember every token line they receive."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []

    def record(self, data: bytes) -> None:
        with self._lock:
            self._seen.update(line.decode(errors="replace") for line in data.split(b"\n") if line)

    def seen(self, token: str, wait: float = 0.0) -> bool:
        deadline = time.monotonic() + wait
        while True:
            with self._lock:
                if token in self._seen:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL)

    def serve(self, sock: socket.socket, kind: str) -> socket.socket:
        """kind: stream (echo a line), dgram (echo each datagram) or netlink (record)."""
        sock.settimeout(TICK)
        loops = {"stream": self._accept_loop, "dgram": self._dgram_loop}
        loops["netlink"] = self._netlink_loop
        thread = threading.Thread(target=loops[kind], args=(sock,), daemon=True)
        self._sockets.append(sock)
        self._threads.append(thread)
        thread.start()
        return sock

    def _accept_loop(self, sock: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._echo_line, args=(conn,), daemon=True).start()

    def _echo_line(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(IO_TIMEOUT)
            data = b""
            with contextlib.suppress(OSError):
                while not data.endswith(b"\n") and len(data) < 4096:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
            self.record(data)
            with contextlib.suppress(OSError):
                conn.sendall(data)

    def _dgram_loop(self, sock: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                data, peer = sock.recvfrom(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self.record(data)
            with contextlib.suppress(OSError):
                sock.sendto(data, peer)

    def _netlink_loop(self, sock: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self.record(data[16:])  # after struct nlmsghdr

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        for sock in self._sockets:
            sock.close()


class Origin:
    """An HTTP origin on 127.0.0.1 that counts connections and keeps request paths."""

    def __init__(self) -> None:
        paths: list[str] = []
        self.paths = paths

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                paths.append(self.path)
                body = b"hello from the origin\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                del format, args

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            connections = 0

            def verify_request(self, request: Any, client_address: Any) -> bool:
                self.connections += 1
                return True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port: int = self.server.server_address[1]
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": TICK}, daemon=True
        )
        self.thread.start()

    @property
    def connections(self) -> int:
        return int(self.server.connections)

    def url(self, token: str) -> str:
        return f"http://127.0.0.1:{self.port}/{token}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _listen(family: socket.AddressFamily, kind: socket.SocketKind, address: Any) -> socket.socket:
    sock = socket.socket(family, kind)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if family != socket.AF_UNIX:
            # A port reused by the next run may still have connections in TIME_WAIT.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        if kind == socket.SOCK_STREAM:
            sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock


def _run_dir() -> str | None:
    if os.access("/run", os.W_OK):
        return "/run"
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    return runtime if runtime.startswith("/run/") and os.access(runtime, os.W_OK) else None


class Lab:
    """Every listener the probe aims at, shared by all tests of this module."""

    def __init__(self) -> None:
        self.recorder = Recorder()
        self.id = uuid.uuid4().hex[:12]
        serve = self.recorder.serve
        self.tcp4 = serve(_listen(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0)), "stream")
        self.tcp6 = serve(_listen(socket.AF_INET6, socket.SOCK_STREAM, ("::1", 0)), "stream")
        self.udp4 = serve(_listen(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0)), "dgram")
        self.udp6 = serve(_listen(socket.AF_INET6, socket.SOCK_DGRAM, ("::1", 0)), "dgram")
        netlink = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_USERSOCK)
        netlink.bind((0, 0))
        self.netlink = serve(netlink, "netlink")
        # Pathname sockets where a docker socket or a session bus would live: the host's /tmp,
        # and /run (or, for a non-root session, its runtime directory under /run).
        self.dirs: list[Path] = []
        self.unix_paths: dict[str, str] = {}
        for label, parent in (("unix_tmp", "/tmp"), ("unix_run", _run_dir())):
            if parent is None:
                continue
            directory = Path(parent) / f"egressbox-test-{self.id}"
            directory.mkdir(mode=0o755)
            self.dirs.append(directory)
            path = str(directory / "listener.sock")
            self._unix(path)
            os.chmod(path, 0o777)  # the unprivileged user's unconfined run connects too
            self.unix_paths[label] = path
        self.abstract = f"@egressbox-test-{self.id}"
        self._unix("\0" + self.abstract[1:])
        self.allowed = Origin()
        self.denied = Origin()
        # Where an unconfined probe "finds the proxy": a port free on the other addresses.
        self.fake_proxy_port = self._free_twin_port()
        self._elsewhere: list[socket.socket] = []

    def _unix(self, address: str) -> None:
        self.recorder.serve(_listen(socket.AF_UNIX, socket.SOCK_STREAM, address), "stream")

    def port(self, sock: socket.socket) -> int:
        port: int = sock.getsockname()[1]
        return port

    @property
    def netlink_portid(self) -> int:
        portid: int = self.netlink.getsockname()[0]
        return portid

    @staticmethod
    def _free_twin_port() -> int:
        for _ in range(50):
            with socket.socket() as probe:
                probe.bind(("127.0.0.2", 0))
                port: int = probe.getsockname()[1]
            with contextlib.suppress(OSError):
                _listen(socket.AF_INET6, socket.SOCK_STREAM, ("::1", port)).close()
                return port
        raise RuntimeError("no port free on both 127.0.0.2 and ::1")

    def listen_elsewhere(self, port: int) -> str | None:
        """Listen at `port` on 127.0.0.2 and ::1 (the proxy's port on other addresses)."""
        try:
            for family, host in ((socket.AF_INET, "127.0.0.2"), (socket.AF_INET6, "::1")):
                sock = _listen(family, socket.SOCK_STREAM, (host, port))
                self._elsewhere.append(self.recorder.serve(sock, "stream"))
        except OSError as exc:
            return f"cannot listen on port {port} of 127.0.0.2 and ::1: {exc}"
        return None

    def stop_elsewhere(self) -> None:
        for sock in self._elsewhere:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._elsewhere.clear()

    def close(self) -> None:
        self.stop_elsewhere()
        self.recorder.close()
        self.allowed.close()
        self.denied.close()
        for directory in self.dirs:
            shutil.rmtree(directory, ignore_errors=True)


# ======================================================================================
# Running the probe
# ======================================================================================


@dataclass(frozen=True)
class Result:
    check: str
    ok: bool
    errno: str | None
    detail: str

    @property
    def status(self) -> int:
        """The HTTP status of an http_* check (0 when there is none)."""
        head = self.detail.split(" ", 1)[0]
        return int(head) if head.isdigit() else 0


@dataclass
class Batch:
    """One probe run: its results by check name, plus what the test saw around it."""

    label: str
    confined: bool
    returncode: int
    results: dict[str, Result]
    stdout: str
    stderr: str
    tokens: dict[str, str]
    paths: dict[str, Path]
    denied_origin_connections: int
    notes: list[str] = field(default_factory=list)

    def __getitem__(self, check: str) -> Result:
        assert check in self.results, f"{self.label}: no result for {check}\n{self.describe()}"
        return self.results[check]

    def describe(self) -> str:
        return (
            f"--- {self.label} (exit {self.returncode})\nstdout:\n{self.stdout}\n"
            f"stderr:\n{self.stderr[-3000:]}\nnotes: {self.notes}"
        )


@dataclass(frozen=True)
class Check:
    name: str
    kind: str
    # (side, token, confined) -> the check's arguments
    args: Callable[[Side, str, bool], list[Any]]


class Side:
    """One actor's workspace, fake home and directories, with its cached probe runs."""

    def __init__(self, actor: Actor, lab: Lab) -> None:
        self.actor = actor
        self.lab = lab
        self._made: list[Path] = []
        # A workspace under /tmp: part of the contract ("--write-root /tmp/work just works").
        self.workspace = self._dir("/tmp", "egressbox-ws-")
        self.home = self._dir("/tmp", "egressbox-home-")
        self.caller_home = self._dir("/tmp", "egressbox-caller-home-")
        # Neither granted nor hidden: a host directory the child may not write.
        outside_parent = BASE_DIR if os.geteuid() == 0 else Path.home()
        outside_parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.outside = self._dir(outside_parent, "outside-")
        # In the host's /tmp, not granted: hidden from the child.
        self.host_tmp = self._dir("/tmp", "egressbox-hosttmp-")
        self._secrets()
        self.probe = self.workspace / "probe.py"
        self.probe.write_text(probe_source(), encoding="utf-8")
        self.policy = self.workspace / "policy.toml"
        self.policy.write_text(
            "[egress]\n"
            f'allow = ["localhost:{lab.allowed.port}", "127.0.0.1:{lab.allowed.port}"]\n'
            'allow_cidrs = ["127.0.0.1/32"]\n',
            encoding="utf-8",
        )
        self._batches: dict[tuple[str, bool, int], Batch] = {}
        self._count = 0

    def _dir(self, parent: str | Path, prefix: str) -> Path:
        path = self.actor.make_dir(parent, prefix)
        self._made.append(path)
        return path

    def _secrets(self) -> None:
        for sub, name, text in (
            (".ssh", "id_rsa", SSH_SECRET),
            (".aws", "credentials", AWS_SECRET),
        ):
            directory = self.home / sub
            directory.mkdir(mode=0o700)
            self.actor.own(directory, 0o700)
            path = directory / name
            path.write_text(text, encoding="utf-8")
            self.actor.own(path, 0o600)

    def close(self) -> None:
        for path in self._made:
            shutil.rmtree(path, ignore_errors=True)

    # -- running ----------------------------------------------------------------------

    def batch(
        self,
        checks: Sequence[Check],
        *,
        confined: bool,
        depth: int,
        group: str = "main",
        home_via: str = "grant",
    ) -> Batch:
        """The probe run for these checks, cached per (group, confined, depth)."""
        key = (group, confined, depth)
        if key not in self._batches:
            self._batches[key] = self._run(checks, confined, depth, group, home_via)
        return self._batches[key]

    def _run(
        self, checks: Sequence[Check], confined: bool, depth: int, group: str, home_via: str
    ) -> Batch:
        self._count += 1
        mode = "confined" if confined else "unconfined"
        label = f"{self.actor.name}/{group}/{mode}/depth{depth}"
        batch_id = f"{self.lab.id}-{self.actor.name}-{group}-{mode}-{depth}"
        handshake = self.workspace / f"handshake-{self._count}"
        handshake.mkdir()
        self.actor.own(handshake, 0o755)
        tokens = {check.name: f"{batch_id}.{check.name}" for check in checks}
        items = [
            {"name": c.name, "kind": c.kind, "args": c.args(self, tokens[c.name], confined)}
            for c in checks
        ]
        for item in items:
            item["args"] = [str(handshake) if a == "{handshake}" else a for a in item["args"]]
        spec = self.workspace / f"spec-{self._count}.json"
        spec.write_text(json.dumps({"depth": depth, "checks": items}), encoding="utf-8")
        argv, env = self._command(spec, confined, home_via)
        before = self.lab.denied.connections
        notes: list[str] = []
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=self.workspace,
            text=True,
        )
        try:
            self._answer_handshake(proc, handshake, notes)
            out, err = proc.communicate(timeout=RUN_TIMEOUT)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
        finally:
            self.lab.stop_elsewhere()
        results = {}
        for line in out.splitlines():
            with contextlib.suppress(ValueError, KeyError):
                data = json.loads(line)
                results[data["check"]] = Result(
                    data["check"], data["ok"], data["errno"], data["detail"]
                )
        paths = {name: Path(p) for name, p in self._paths(tokens).items()}
        delta = self.lab.denied.connections - before
        return Batch(
            label, confined, proc.returncode, results, out, err, tokens, paths, delta, notes
        )

    def _command(
        self, spec: Path, confined: bool, home_via: str
    ) -> tuple[list[str], dict[str, str]]:
        probe = [self.actor.python, str(self.probe), str(spec)]
        env = self.actor.base_env(self.caller_home if home_via == "grant" else self.home)
        if not confined:
            env["HOME"] = str(self.home)
            env["EB_FAKE_PROXY"] = f"http://127.0.0.1:{self.lab.fake_proxy_port}"
            # No exec: the shell stays the probe's parent, whose pid is EB_PARENT.
            script = 'EB_PARENT=$$; export EB_PARENT; "$@"'
            return self.actor.command(["/bin/sh", "-c", script, "sh", *probe], env)
        run = [*self.actor.egressbox, "run", "--policy", str(self.policy), "--report", "-v"]
        run += ["--write-root", str(self.workspace), "--read-root", str(self.home)]
        run += ["--grant", "EB_PARENT"]
        if home_via == "grant":
            run += ["--grant", f"HOME={self.home}"]
        # exec: EB_PARENT is the pid of `egressbox run` itself, the unconfined proxy.
        script = 'EB_PARENT=$$; export EB_PARENT; exec "$@"'
        return self.actor.command(["/bin/sh", "-c", script, "sh", *run, "--", *probe], env)

    def _answer_handshake(
        self, proc: subprocess.Popen[str], handshake: Path, notes: list[str]
    ) -> None:
        port_file = handshake / "port"
        deadline = time.monotonic() + HANDSHAKE_WAIT
        while time.monotonic() < deadline and proc.poll() is None:
            if port_file.exists():
                problem = self.lab.listen_elsewhere(int(port_file.read_text(encoding="ascii")))
                if problem:
                    notes.append(problem)
                go = handshake / "go"
                go.write_text("go", encoding="ascii")
                self.actor.own(go, 0o644)
                return
            time.sleep(POLL)

    def _paths(self, tokens: Mapping[str, str]) -> dict[str, str]:
        """Files the write checks create, by check name (one set per run)."""
        return {
            name: write_target(self, name, token)
            for name, token in tokens.items()
            if name.startswith("write_")
        }


def write_target(side: Side, name: str, token: str) -> str:
    directory = {
        "write_workspace": side.workspace,
        "write_outside": side.outside,
        "write_home": side.home,
        "write_host_tmp": side.host_tmp,
    }[name]
    return str(directory / f"{token}.txt")


# ======================================================================================
# The checks
# ======================================================================================


def _proxy_variable(confined: bool) -> str:
    return "http_proxy" if confined else "EB_FAKE_PROXY"


NETWORK_CHECKS = (
    Check("tcp4", "stream", lambda s, t, c: ["127.0.0.1", s.lab.port(s.lab.tcp4), t]),
    Check("tcp6", "stream", lambda s, t, c: ["::1", s.lab.port(s.lab.tcp6), t]),
    Check("udp4", "udp", lambda s, t, c: ["127.0.0.1", s.lab.port(s.lab.udp4), t]),
    Check("udp6", "udp", lambda s, t, c: ["::1", s.lab.port(s.lab.udp6), t]),
    Check("raw", "raw", lambda s, t, c: [s.lab.port(s.lab.udp4), t]),
    Check("packet", "packet", lambda s, t, c: [s.lab.port(s.lab.udp6), t]),
    Check("netlink", "netlink", lambda s, t, c: [s.lab.netlink_portid, t]),
    Check(
        "mptcp", "stream", lambda s, t, c: ["127.0.0.1", s.lab.port(s.lab.tcp4), t, IPPROTO_MPTCP]
    ),
    Check("tcp_fast_open", "fastopen", lambda s, t, c: [s.lab.port(s.lab.tcp4), t]),
    Check("io_uring", "io_uring", lambda s, t, c: [s.lab.port(s.lab.tcp4), t]),
    Check(
        "proxy_port_on_127.0.0.2",
        "proxy_port",
        lambda s, t, c: [_proxy_variable(c), "127.0.0.2", t, "{handshake}"],
    ),
    Check(
        "proxy_port_on_::1",
        "proxy_port",
        lambda s, t, c: [_proxy_variable(c), "::1", t, "{handshake}"],
    ),
    Check("unix_tmp", "unix", lambda s, t, c: [s.lab.unix_paths.get("unix_tmp", ""), t]),
    Check("unix_run", "unix", lambda s, t, c: [s.lab.unix_paths.get("unix_run", ""), t]),
    Check("unix_abstract", "unix", lambda s, t, c: [s.lab.abstract, t]),
)
PROCESS_CHECKS = (
    Check("kill_parent", "kill_parent", lambda s, t, c: ["EB_PARENT"]),
    Check("ptrace_parent", "ptrace_parent", lambda s, t, c: ["EB_PARENT"]),
)
READ_CHECKS = (
    Check("read_ssh_key", "read", lambda s, t, c: [str(s.home / ".ssh/id_rsa"), SSH_SECRET]),
    Check(
        "read_aws_credentials",
        "read",
        lambda s, t, c: [str(s.home / ".aws/credentials"), AWS_SECRET],
    ),
)


def _write_check(name: str) -> Check:
    return Check(name, "write", lambda s, t, c: [write_target(s, name, t), t])


WRITE_CHECKS = tuple(
    _write_check(name)
    for name in ("write_workspace", "write_outside", "write_home", "write_host_tmp")
)
HTTP_CHECKS = (
    Check("http_curl_allowed", "http_curl", lambda s, t, c: [s.lab.allowed.url(t)]),
    Check("http_python_allowed", "http_python", lambda s, t, c: [s.lab.allowed.url(t)]),
    Check("http_curl_denied", "http_curl", lambda s, t, c: [s.lab.denied.url(t)]),
    Check("http_python_denied", "http_python", lambda s, t, c: [s.lab.denied.url(t)]),
)
MAIN_CHECKS = NETWORK_CHECKS + PROCESS_CHECKS + READ_CHECKS + WRITE_CHECKS + HTTP_CHECKS
INT80_CHECKS = (Check("int80", "int80", lambda s, t, c: [s.lab.port(s.lab.udp4), t]),)

# Root alone may open raw and packet sockets: for the unprivileged user the baseline
# ("the probe would see the access") comes from the invoking root's unconfined run.
NEEDS_ROOT = frozenset({"raw", "packet"})
DEPTHS = {"child": 0, "grandchild": 1}


# ======================================================================================
# Fixtures
# ======================================================================================


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    built = Lab()
    try:
        yield built
    finally:
        built.close()


class Sides:
    def __init__(self, lab: Lab, request: pytest.FixtureRequest) -> None:
        self.lab = lab
        self.request = request
        self._sides: dict[str, Side] = {}

    def get(self, who: str) -> Side:
        if who not in self._sides:
            actor = (
                invoking_actor() if who == "self" else self.request.getfixturevalue("unprivileged")
            )
            self._sides[who] = Side(actor, self.lab)
        return self._sides[who]

    def close(self) -> None:
        for side in self._sides.values():
            side.close()


@pytest.fixture(scope="module")
def sides(lab: Lab, request: pytest.FixtureRequest) -> Iterator[Sides]:
    made = Sides(lab, request)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(params=["self", "unprivileged"])
def side(request: pytest.FixtureRequest, sides: Sides) -> Side:
    return sides.get(request.param)


def _main(side: Side, confined: bool, depth: int) -> Batch:
    return side.batch(MAIN_CHECKS, confined=confined, depth=depth)


def _pair(side: Side, depth: int) -> tuple[Batch, Batch]:
    free = _main(side, False, depth)
    boxed = _main(side, True, depth)
    return free, boxed


def _context(*batches: Batch) -> str:
    return "\n".join(batch.describe() for batch in batches)


# ======================================================================================
# Tests
# ======================================================================================


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
def test_confined_run_succeeds_and_reports_full_enforcement(side: Side, depth: int) -> None:
    free, boxed = _pair(side, depth)
    assert free.returncode == 0, _context(free)
    assert boxed.returncode == 0, _context(boxed)
    assert "enforcement: network_boundary: full" in boxed.stderr, _context(boxed)
    if depth:
        assert boxed["__child__"].ok, _context(boxed)


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("check", [c.name for c in NETWORK_CHECKS])
def test_no_listener_is_reachable_directly(
    side: Side, sides: Sides, check: str, depth: int
) -> None:
    if check.startswith("unix_") and check != "unix_abstract" and check not in side.lab.unix_paths:
        pytest.skip(f"no writable directory for the {check} listener in this session")
    free, boxed = _pair(side, depth)
    baseline = free
    if check in NEEDS_ROOT and side.actor.uid != 0:
        assert not free[check].ok and free[check].errno == "EPERM", _context(free)
        root = sides.get("self")
        if root.actor.uid != 0:
            pytest.skip(f"{check} sockets need root, and this session is not root")
        baseline = _main(root, False, depth)
    # The probe reaches the listener when nothing confines it...
    assert baseline[check].ok, _context(baseline)
    assert side.lab.recorder.seen(baseline.tokens[check], wait=DELIVERY_WAIT), _context(baseline)
    # ...and under `egressbox run` it cannot, with an error rather than a silent drop.
    result = boxed[check]
    if check in CAPTURED_TCP and "enforcement: capture: full" in boxed.stderr:
        # Captured: the child's connect ends at the proxy, which decides it (a refusal, said
        # on stderr) and resets it; the listener itself still sees nothing.
        assert any(
            " tcp " in f" {line} " and " deny " in line for line in boxed.stderr.splitlines()
        ), _context(boxed)
    else:
        assert not result.ok, _context(boxed)
        assert result.errno is not None, _context(boxed)
    assert not side.lab.recorder.seen(boxed.tokens[check]), _context(boxed)
    assert not any(note.startswith("cannot listen") for note in boxed.notes), _context(boxed)


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("check", [c.name for c in PROCESS_CHECKS])
def test_cannot_signal_or_ptrace_the_parent(side: Side, check: str, depth: int) -> None:
    free, boxed = _pair(side, depth)
    assert free[check].ok, _context(free)
    assert not boxed[check].ok, _context(boxed)
    assert boxed[check].errno in {"ESRCH", "EPERM"}, _context(boxed)


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("check", [c.name for c in READ_CHECKS])
def test_credentials_are_unreadable_even_under_a_read_root(
    side: Side, check: str, depth: int
) -> None:
    free, boxed = _pair(side, depth)
    assert free[check].ok, _context(free)
    assert not boxed[check].ok, _context(boxed)
    assert boxed[check].errno in {"EACCES", "EPERM"}, _context(boxed)


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("check", ["write_outside", "write_home", "write_host_tmp"])
def test_cannot_write_outside_the_write_roots(side: Side, check: str, depth: int) -> None:
    free, boxed = _pair(side, depth)
    assert free[check].ok and free.paths[check].exists(), _context(free)
    assert not boxed[check].ok, _context(boxed)
    assert boxed[check].errno in {"EACCES", "EROFS", "ENOENT", "EPERM"}, _context(boxed)
    assert not boxed.paths[check].exists(), _context(boxed)


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
def test_writes_in_the_workspace_under_tmp_reach_the_host(side: Side, depth: int) -> None:
    _, boxed = _pair(side, depth)
    assert boxed["write_workspace"].ok, _context(boxed)
    written = boxed.paths["write_workspace"]
    assert written.read_text(encoding="utf-8") == boxed.tokens["write_workspace"]
    assert written.stat().st_uid == side.actor.uid


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("client", ["curl", "python"])
def test_allowed_origin_is_reached_through_the_proxy(side: Side, client: str, depth: int) -> None:
    if client == "curl" and shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    check = f"http_{client}_allowed"
    free, boxed = _pair(side, depth)
    assert free[check].status == 200, _context(free)
    assert boxed[check].status == 200, _context(boxed)
    assert f"/{boxed.tokens[check]}" in side.lab.allowed.paths
    # The request went through the proxy: it logged the destination (run -v).
    assert f"127.0.0.1:{side.lab.allowed.port}" in boxed.stderr, _context(boxed)


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("client", ["curl", "python"])
def test_denied_origin_is_refused_and_never_contacted(side: Side, client: str, depth: int) -> None:
    if client == "curl" and shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    check = f"http_{client}_denied"
    free, boxed = _pair(side, depth)
    assert free[check].status == 200, _context(free)
    assert f"/{free.tokens[check]}" in side.lab.denied.paths
    assert boxed[check].status == 403, _context(boxed)
    assert f"/{boxed.tokens[check]}" not in side.lab.denied.paths
    assert boxed.denied_origin_connections == 0, _context(boxed)


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
def test_i386_syscalls_kill_the_confined_child(side: Side, depth: int) -> None:
    if platform.machine() != "x86_64":
        pytest.skip(f"the int 0x80 probe is x86_64 machine code; this is {platform.machine()}")
    free = side.batch(INT80_CHECKS, confined=False, depth=depth, group="int80")
    if depth == 0 and not free["int80"].ok:
        pytest.skip(f"this kernel runs no i386 syscalls ({free['int80']}): nothing to refuse")
    assert side.lab.recorder.seen(free.tokens["int80"], wait=DELIVERY_WAIT), _context(free)
    boxed = side.batch(INT80_CHECKS, confined=True, depth=depth, group="int80")
    assert "int80" not in boxed.results, _context(boxed)
    assert not side.lab.recorder.seen(boxed.tokens["int80"]), _context(boxed)
    if depth == 0:
        assert boxed.returncode == SIGSYS_EXIT, _context(boxed)
    else:
        assert boxed.returncode == 0, _context(boxed)
        assert boxed["__child__"].detail == str(-signal.SIGSYS), _context(boxed)


def test_callers_own_home_credentials_are_unreadable(side: Side) -> None:
    """HOME from the caller's environment (no --grant): its credentials are denied too."""
    free = side.batch(READ_CHECKS, confined=False, depth=0, group="home", home_via="caller")
    boxed = side.batch(READ_CHECKS, confined=True, depth=0, group="home", home_via="caller")
    for check in READ_CHECKS:
        assert free[check.name].ok, _context(free)
        assert not boxed[check.name].ok, _context(boxed)
