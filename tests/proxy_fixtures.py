"""Fixtures for the proxy integration tests: loopback origins, test DNS, a proxy.

Network rule: every byte stays on 127.0.0.0/8 and ::1. The test DNS server
answers loopback addresses, or 10.0.0.1 for names the proxy must refuse
before dialing; the `dials` fixture (used by every test of the proxy test
modules) wraps the proxy's dialer so that an attempt to connect anywhere off
loopback is refused and fails the test.
Clients are pointed at names only through the proxy (curl with `-x`,
`--socks5-hostname`, python-socks with rdns), so they never resolve a test
name themselves; paths where the client resolves use IP literals.

Every wait is bounded: IO_TIMEOUT per client step, curl's --max-time, and
bounded loops when draining a listener's backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import os
import random
import shutil
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Self

import pytest
from aiohttp import web

from dnsserver import AAAA, SILENT, A, DnsServer
from egressbox.audit.record import AuditRecord
from egressbox.core.ip import IPAddress
from egressbox.core.policy import Policy, parse_policy
from egressbox.net.dial import (
    DEFAULT_STAGGER,
    DialCallback,
    DialError,
    DialFailure,
    Dialing,
    start_connect,
)
from egressbox.net.resolve import DnsResolver
from egressbox.proxy.server import EgressProxy
from unprivileged import (
    Actor,
    UnavailableError,
    invoking_actor,
    unprivileged_actor,
)

# Longest a single client step (connect, a reply, an echo) may take. Generous
# for a loaded CI machine; a hang fails the test instead of blocking the run.
IO_TIMEOUT = 15.0
# curl's own --max-time, and how much longer we wait for its process to end.
CURL_MAX_TIME = 30
CURL_GRACE = 10.0
# The proxy's resolver timeout: generous, as a loaded machine can be slow
# (a test that waits for a DNS timeout on purpose passes a short one).
DNS_TIMEOUT = 5.0
# A download big enough to cross many relay reads and splice chunks (a few MiB).
BIG_SIZE = 4 * 1024 * 1024
BIG_BODY = random.Random(20_240_611).randbytes(BIG_SIZE)
BIG_SHA256 = hashlib.sha256(BIG_BODY).hexdigest()
# Upper bound on connections drained from a tripwire's backlog in one look.
MAX_DRAIN = 1000
# Tries to find a port free on two loopback addresses at once.
BIND_ATTEMPTS = 20

LOOPBACK = "127.0.0.1"
LOOPBACK6 = "::1"
# Loopback addresses with a meaning in BASE_POLICY:
NOT_ADMITTED = "127.0.0.2"  # loopback outside allow_cidrs: private_address
REBOUND = "127.0.0.3"  # the "rebinding" answer: also outside allow_cidrs
DENIED_CIDR = "127.0.0.9"  # inside deny_cidrs
# Never dialed: the decision refuses it (and the dial guard would too).
TEN = "10.0.0.1"

BASE_POLICY: dict[str, Any] = {
    "egress": {
        "allow": [
            "origin.test",
            "v6.test",
            "*.ok.test",
            "rebind.test",
            "mixed.test",
            "127.0.0.1",
            "[::1]",
        ],
        "deny": ["blocked.ok.test"],
        "allow_cidrs": ["127.0.0.1/32", "::1/128"],
        "deny_cidrs": [f"{DENIED_CIDR}/32"],
    }
}


def program_zone(server: DnsServer) -> None:
    """The names BASE_POLICY talks about (anything else is NXDOMAIN)."""
    server.set("origin.test", A(LOOPBACK))
    server.set("v6.test", AAAA(LOOPBACK6))
    server.set("tls.ok.test", A(LOOPBACK))
    server.set("blocked.ok.test", A(LOOPBACK))
    server.set("cidr.ok.test", A(DENIED_CIDR))
    server.set("private.ok.test", A(NOT_ADMITTED))
    server.set("ten.ok.test", A(TEN))
    server.set("unlisted.test", A(LOOPBACK))
    server.set("ten.test", A(TEN))
    server.set_behaviour("slow.ok.test", SILENT)


def make_policy(data: Mapping[str, Any] | Policy | None) -> Policy | None:
    if data is None or isinstance(data, Policy):
        return data
    return parse_policy(data, env={})


def listening_socket(host: str, port: int = 0) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def ipv6_available() -> bool:
    try:
        listening_socket(LOOPBACK6).close()
    except OSError:
        return False
    return True


# -- event loops -----------------------------------------------------------------------

# The proxy runs on uvloop under `egressbox serve` and on asyncio's loop as a
# library: the tests in these files run on both (other files: asyncio only).
BOTH_LOOPS_IN = frozenset(
    {"test_proxy_clients.py", "test_proxy_decisions.py", "test_tls_name_check.py"}
)


def loop_factories() -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    with contextlib.suppress(ImportError):
        import uvloop

        factories["uvloop"] = uvloop.new_event_loop
    return factories


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.path.name in BOTH_LOOPS_IN:
        return loop_factories()
    return {"asyncio": asyncio.new_event_loop}


# -- origins ---------------------------------------------------------------------------


class Tripwire:
    """A listener nobody serves: any connection that reaches it sits in its backlog.

    The kernel completes the handshake before the dialer returns, so once the
    proxy has answered, a connection it made is already queued here: counting
    is exact, with no sleep.
    """

    def __init__(self, host: str, port: int = 0) -> None:
        self.sock = listening_socket(host, port)
        self.host = host
        self.port: int = self.sock.getsockname()[1]
        self.seen = 0

    def connections(self) -> int:
        for _ in range(MAX_DRAIN):
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                break
            conn.close()
            self.seen += 1
        return self.seen

    def close(self) -> None:
        self.sock.close()


class EchoOrigin:
    """A raw TCP echo server that keeps what each connection sent, in accept order."""

    def __init__(self) -> None:
        self.accepted = 0
        self.received: list[bytearray] = []
        self.host = ""
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, sock: socket.socket) -> EchoOrigin:
        self.host, self.port = sock.getsockname()[:2]
        self._server = await asyncio.start_server(self._serve, sock=sock)
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.accepted += 1
        seen = bytearray()
        self.received.append(seen)
        try:
            while data := await reader.read(65536):
                seen += data
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        except ConnectionError:
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class StreamOrigin:
    """An asyncio stream server on 127.0.0.1 that tracks its connections; a subclass
    answers each one in `handle` (a reset, timeout or short read just ends it)."""

    def __init__(self) -> None:
        self.accepted = 0
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> Self:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.writers.add(writer)
        try:
            await self.handle(reader, writer)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        if self.server is None:
            return
        self.server.close()
        for writer in list(self.writers):
            writer.transport.abort()
        await self.server.wait_closed()


class ScriptedOrigin:
    """Reads one request head, writes fixed bytes, then closes (a close-delimited reply)."""

    def __init__(self, response: bytes) -> None:
        self.response = response
        self.accepted = 0
        self.heads: list[bytes] = []
        self.host = ""
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self, sock: socket.socket) -> ScriptedOrigin:
        self.host, self.port = sock.getsockname()[:2]
        self._server = await asyncio.start_server(self._serve, sock=sock)
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
            self.heads.append(head)
            writer.write(self.response)
            await writer.drain()
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()


@dataclass(frozen=True)
class SeenRequest:
    method: str
    path_qs: str
    headers: tuple[tuple[str, str], ...]
    body: bytes


class HttpOrigin:
    """An aiohttp origin that counts accepted TCP connections and logs requests.

    /hello: a short text; /echo: JSON about the request and its body;
    /big: BIG_BODY with Content-Length; /big-chunked: BIG_BODY chunked;
    /status/NNN: that status with a short text body.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.accepted = 0
        self.requests: list[SeenRequest] = []
        self.host = ""
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None

    @property
    def authority(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def url(self, host: str, path: str = "/hello", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"

    async def start(self, sock: socket.socket, tls: ssl.SSLContext | None = None) -> HttpOrigin:
        self.host, self.port = sock.getsockname()[:2]
        app = web.Application(client_max_size=BIG_SIZE * 2)
        app.router.add_get("/hello", self._hello)
        app.router.add_route("*", "/echo", self._echo)
        app.router.add_get("/big", self._big)
        app.router.add_get("/big-chunked", self._big_chunked)
        app.router.add_route("*", "/status/{code:[0-9]{3}}", self._status)
        app.router.add_route("*", "/{tail:.*}", self._echo)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        self._runner = runner
        handler_factory = runner.server
        assert handler_factory is not None

        def factory() -> asyncio.BaseProtocol:
            self.accepted += 1
            return handler_factory()

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(factory, sock=sock, ssl=tls)
        return self

    async def _record(self, request: web.Request) -> bytes:
        body = await request.read()
        headers = tuple((k.lower(), v) for k, v in request.headers.items())
        self.requests.append(SeenRequest(request.method, request.path_qs, headers, body))
        return body

    async def _hello(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        return web.Response(text=f"hello from {self.label}")

    async def _echo(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        info = {
            "method": request.method,
            "path_qs": request.path_qs,
            "body_length": len(body),
            "body_sha256": hashlib.sha256(body).hexdigest(),
            "content_length": request.headers.get("Content-Length"),
            "transfer_encoding": request.headers.get("Transfer-Encoding"),
        }
        return web.json_response(info)

    async def _status(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        status = int(request.match_info["code"])
        return web.Response(status=status, text=f"status {status} from {self.label}")

    async def _big(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        return web.Response(body=BIG_BODY, content_type="application/octet-stream")

    async def _big_chunked(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        response.content_type = "application/octet-stream"
        await response.prepare(request)
        step = 256 * 1024
        for start in range(0, len(BIG_BODY), step):
            await response.write(BIG_BODY[start : start + step])
        await response.write_eof()
        return response

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()


class Origins:
    """Starts origins and tripwires for one test and closes them all afterwards."""

    def __init__(self) -> None:
        self._closers: list[Any] = []

    async def http(
        self, host: str = LOOPBACK, *, label: str | None = None, tls: ssl.SSLContext | None = None
    ) -> HttpOrigin:
        if ":" in host and not ipv6_available():
            pytest.skip("IPv6 loopback (::1) is not available here")
        origin = await HttpOrigin(label or host).start(listening_socket(host), tls)
        self._closers.append(origin)
        return origin

    async def echo(self, host: str = LOOPBACK) -> EchoOrigin:
        origin = await EchoOrigin().start(listening_socket(host))
        self._closers.append(origin)
        return origin

    async def scripted(self, response: bytes, host: str = LOOPBACK) -> ScriptedOrigin:
        origin = await ScriptedOrigin(response).start(listening_socket(host))
        self._closers.append(origin)
        return origin

    def refusing_port(self, host: str = LOOPBACK) -> int:
        """A port that refuses connections: bound (so nobody else takes it), not listening."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((host, 0))
        self._closers.append(sock)
        port: int = sock.getsockname()[1]
        return port

    def tripwire(self, host: str = LOOPBACK, port: int = 0) -> Tripwire:
        wire = Tripwire(host, port)
        self._closers.append(wire)
        return wire

    async def echo_with_twin(self, twin_host: str) -> tuple[EchoOrigin, Tripwire]:
        """An echo origin on 127.0.0.1 and a tripwire on `twin_host`, same port."""
        for _ in range(BIND_ATTEMPTS):
            sock = listening_socket(LOOPBACK)
            try:
                wire = Tripwire(twin_host, sock.getsockname()[1])
            except OSError:
                sock.close()
                continue
            self._closers.append(wire)
            origin = await EchoOrigin().start(sock)
            self._closers.append(origin)
            return origin, wire
        raise OSError(f"no port free on both {LOOPBACK} and {twin_host}")

    async def close(self) -> None:
        for item in reversed(self._closers):
            result = item.close()
            if asyncio.iscoroutine(result):
                await result


@pytest.fixture
async def origins() -> AsyncIterator[Origins]:
    registry = Origins()
    try:
        yield registry
    finally:
        await registry.close()


@pytest.fixture
async def origin(origins: Origins) -> HttpOrigin:
    """An HTTP origin on 127.0.0.1 (origin.test and 127.0.0.1 reach it)."""
    return await origins.http(LOOPBACK, label="v4")


# -- DNS, the dial guard and the proxy -----------------------------------------------


@pytest.fixture
def zone(dns_server: DnsServer) -> DnsServer:
    """The test DNS server, programmed with the names BASE_POLICY talks about."""
    program_zone(dns_server)
    return dns_server


@dataclass
class DialGuard:
    """What the proxy tried to dial; anything off loopback is refused and recorded."""

    calls: list[tuple[tuple[IPAddress, ...], int]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def addresses(self) -> list[IPAddress]:
        return [ip for addresses, _ in self.calls for ip in addresses]


class _Refused(Dialing):
    """The guard's answer to an off-loopback dial: a refusal already scheduled."""

    __slots__ = ("handle",)

    def __init__(self, handle: asyncio.Handle) -> None:
        self.handle = handle

    def cancel(self) -> None:
        self.handle.cancel()


@pytest.fixture
def dials(monkeypatch: pytest.MonkeyPatch) -> Iterator[DialGuard]:
    """Record every dial of the in-process proxy; refuse (and fail on) non-loopback ones.

    Test modules that start proxies use it for every test:
    `pytestmark = pytest.mark.usefixtures("dials")`. It patches the server's
    `start_connect`, which a compiled core calls directly: there it records
    nothing, so the tests that read its records are `pure_only`, and the
    interpreted pass of scripts/test runs every test with the guard in force.
    """
    guard = DialGuard()

    def guarded_connect(
        addresses: Sequence[IPAddress],
        port: int,
        protocol: asyncio.Protocol,
        on_done: DialCallback,
        *,
        timeout: float,
        stagger: float = DEFAULT_STAGGER,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> Dialing:
        addresses = tuple(addresses)
        guard.calls.append((addresses, port))
        outside = [str(ip) for ip in addresses if not ip.is_loopback]
        if outside:
            guard.violations.append(f"the proxy tried to dial {outside} port {port}")
            error = DialError(DialFailure.CONNECT_FAILED, "test guard: not a loopback address")
            handle = asyncio.get_running_loop().call_soon(on_done, None, error)
            return _Refused(handle)
        return start_connect(
            addresses, port, protocol, on_done, timeout=timeout, stagger=stagger, loop=loop
        )

    monkeypatch.setattr("egressbox.proxy.tunnel.start_connect", guarded_connect)
    monkeypatch.setattr("egressbox.proxy.forward.start_connect", guarded_connect)
    yield guard
    assert guard.violations == [], "the proxy dialed outside loopback"


class StartProxy(Protocol):
    def __call__(
        self,
        policy: Mapping[str, Any] | Policy | None = ...,
        *,
        dns_timeout: float = ...,
        **kwargs: Any,
    ) -> Awaitable[EgressProxy]: ...


@pytest.fixture
async def start_proxy(zone: DnsServer) -> AsyncIterator[StartProxy]:
    """Start an EgressProxy (BASE_POLICY, the test DNS, keep_records); closed afterwards."""
    started: list[EgressProxy] = []

    async def start(
        policy: Mapping[str, Any] | Policy | None = BASE_POLICY,
        *,
        dns_timeout: float = DNS_TIMEOUT,
        **kwargs: Any,
    ) -> EgressProxy:
        kwargs.setdefault("resolver", DnsResolver([zone.nameserver], timeout=dns_timeout))
        kwargs.setdefault("keep_records", True)
        proxy = EgressProxy(make_policy(policy), **kwargs)
        await proxy.start()
        started.append(proxy)
        return proxy

    try:
        yield start
    finally:
        for proxy in reversed(started):
            await proxy.close(0)


@pytest.fixture
def proxy_log() -> list[str]:
    """The diagnostic lines of the `proxy` fixture."""
    return []


@pytest.fixture
async def proxy(start_proxy: StartProxy, proxy_log: list[str]) -> EgressProxy:
    """A started proxy with BASE_POLICY; its records are in proxy.records."""
    return await start_proxy(log=proxy_log.append)


# -- clients -------------------------------------------------------------------------


@dataclass(frozen=True)
class CurlResult:
    returncode: int
    stdout: bytes
    stderr: str


def client_env() -> dict[str, str]:
    """The environment without any proxy variable, so only the flags choose the route."""
    return {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}


class Curl:
    """Runs curl (config files ignored, bounded in time) and captures its output."""

    def __init__(self, path: str) -> None:
        self.path = path

    async def __call__(self, *args: str, check: bool = True) -> CurlResult:
        proc = await asyncio.create_subprocess_exec(
            self.path,
            "-q",  # first argument: ignore ~/.curlrc
            "--silent",
            "--show-error",
            "--max-time",
            str(CURL_MAX_TIME),
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=client_env(),
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), CURL_MAX_TIME + CURL_GRACE)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        result = CurlResult(proc.returncode or 0, out, err.decode(errors="replace"))
        if check and result.returncode != 0:
            raise AssertionError(f"curl {' '.join(args)} failed: {result}")
        return result


@pytest.fixture
def curl() -> Curl:
    path = shutil.which("curl")
    if path is None:
        pytest.skip("curl is not installed")
    return Curl(path)


@dataclass(frozen=True)
class Reply:
    """An HTTP reply read off a raw connection."""

    status: int
    headers: dict[str, str]  # lower-case names; the last value wins
    head: bytes
    body: bytes
    closed: bool  # the proxy ended the connection after the reply

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


class Wire:
    """Raw-socket helpers for the proxy's listeners (a fixture, so tests need no import).

    Every read is bounded by IO_TIMEOUT.
    """

    big_body = BIG_BODY
    big_sha256 = BIG_SHA256

    @staticmethod
    def summary(records: list[AuditRecord]) -> list[tuple[str, str, int, str, str]]:
        """Records without their timestamps, for equality assertions."""
        return [
            (r.protocol.value, r.host, r.port, r.decision.value, r.reason.value) for r in records
        ]

    @staticmethod
    async def wait_for_records(proxy: EgressProxy, count: int) -> None:
        """Until the proxy has made `count` decisions (polled, bounded by IO_TIMEOUT)."""
        async with asyncio.timeout(IO_TIMEOUT):
            while len(proxy.records) < count:
                await asyncio.sleep(0.01)

    @staticmethod
    async def open(
        address: tuple[str, int] | None,
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        assert address is not None
        return await asyncio.wait_for(asyncio.open_connection(*address), IO_TIMEOUT)

    @staticmethod
    async def close(writer: asyncio.StreamWriter) -> None:
        writer.close()
        with contextlib.suppress(ConnectionError, TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), IO_TIMEOUT)

    @staticmethod
    async def read_exactly(reader: asyncio.StreamReader, size: int) -> bytes:
        return await asyncio.wait_for(reader.readexactly(size), IO_TIMEOUT)

    @staticmethod
    async def read_to_eof(reader: asyncio.StreamReader) -> bytes:
        return await asyncio.wait_for(reader.read(), IO_TIMEOUT)

    @staticmethod
    async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        return status, headers, head

    @classmethod
    async def read_reply(cls, reader: asyncio.StreamReader, *, expect_close: bool = True) -> Reply:
        """A reply whose body has a Content-Length; then whether the proxy closed."""
        status, headers, head = await cls.read_head(reader)
        length = int(headers.get("content-length", "0"))
        body = await cls.read_exactly(reader, length)
        closed = False
        if expect_close:
            closed = await asyncio.wait_for(reader.read(1), IO_TIMEOUT) == b""
        return Reply(status, headers, head, body, closed)

    @classmethod
    async def exchange(cls, address: tuple[str, int] | None, request: bytes) -> Reply:
        """Send raw bytes to the HTTP listener and read one reply (then expect a close)."""
        reader, writer = await cls.open(address)
        try:
            writer.write(request)
            await writer.drain()
            return await cls.read_reply(reader)
        finally:
            await cls.close(writer)

    @staticmethod
    def socks_target(host: str, port: int, *, as_domain: bool = False) -> bytes:
        """ATYP, address and port of a SOCKS5 request (an IP literal as an address)."""
        if not as_domain:
            with contextlib.suppress(ValueError):
                ip = ipaddress.ip_address(host)
                atyp = b"\x01" if ip.version == 4 else b"\x04"
                return atyp + ip.packed + port.to_bytes(2, "big")
        name = host.encode()
        return b"\x03" + bytes([len(name)]) + name + port.to_bytes(2, "big")

    @classmethod
    def socks_hello(
        cls,
        host: str,
        port: int,
        *,
        credentials: tuple[str, str] | None = None,
        as_domain: bool = False,
    ) -> bytes:
        """Greeting, optional RFC 1929 sub-negotiation and CONNECT request, as one write."""
        if credentials is None:
            data = b"\x05\x01\x00"
        else:
            user, password = (part.encode() for part in credentials)
            data = b"\x05\x01\x02\x01" + bytes([len(user)]) + user
            data += bytes([len(password)]) + password
        return data + b"\x05\x01\x00" + cls.socks_target(host, port, as_domain=as_domain)

    @classmethod
    async def read_socks_reply(
        cls, reader: asyncio.StreamReader, *, with_auth: bool = False
    ) -> int:
        """Read the method choice (and auth status), then the CONNECT reply; its REP code.

        -1 when the credentials were refused (no CONNECT reply follows).
        """
        choice = await cls.read_exactly(reader, 2)
        assert choice == (b"\x05\x02" if with_auth else b"\x05\x00"), choice
        if with_auth:
            status = await cls.read_exactly(reader, 2)
            if status[1] != 0:
                return -1
        head = await cls.read_exactly(reader, 4)
        assert head[0] == 5 and head[2] == 0, head
        size = {1: 4, 4: 16}.get(head[3])
        if size is None:
            size = (await cls.read_exactly(reader, 1))[0]
        await cls.read_exactly(reader, size + 2)
        return head[1]

    @classmethod
    async def socks_exchange(
        cls,
        address: tuple[str, int] | None,
        host: str,
        port: int,
        *,
        credentials: tuple[str, str] | None = None,
        as_domain: bool = False,
    ) -> tuple[int, bool]:
        """One SOCKS5 CONNECT that is expected to fail: (REP code, proxy closed after)."""
        reader, writer = await cls.open(address)
        try:
            hello = cls.socks_hello(host, port, credentials=credentials, as_domain=as_domain)
            writer.write(hello)
            await writer.drain()
            code = await cls.read_socks_reply(reader, with_auth=credentials is not None)
            closed = await asyncio.wait_for(reader.read(1), IO_TIMEOUT) == b""
            return code, closed
        finally:
            await cls.close(writer)


@pytest.fixture
def wire() -> Wire:
    return Wire()


# -- TLS (optional: needs the openssl command) ---------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        return context

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cert))


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A self-signed certificate for tls.ok.test (skips without the openssl command)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is not installed")
    folder = tmp_path_factory.mktemp("tls")
    files = TlsFiles(folder / "cert.pem", folder / "key.pem")
    command = [
        openssl,
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=tls.ok.test",
        "-addext",
        "subjectAltName=DNS:tls.ok.test",
        "-keyout",
        str(files.key),
        "-out",
        str(files.cert),
    ]
    done = subprocess.run(command, capture_output=True, timeout=60, check=False)
    if done.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {done.stderr[-200:]!r}")
    return files


# -- actors: the invoking user, and an unprivileged one ------------------------------------------


@pytest.fixture(scope="session")
def unprivileged() -> Actor:
    try:
        return unprivileged_actor()
    except UnavailableError as exc:
        pytest.skip(f"cannot run as an unprivileged user: {exc}")


@pytest.fixture(params=["self", "unprivileged"])
def actor(request: pytest.FixtureRequest) -> Actor:
    if request.param == "self":
        return invoking_actor()
    found: Actor = request.getfixturevalue("unprivileged")
    return found
