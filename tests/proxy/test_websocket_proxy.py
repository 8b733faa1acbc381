"""WebSockets through the plain HTTP listener: `GET ws://...` with Upgrade.

aiohttp takes a ws:// URL's proxy from `ws_proxy` and sends the handshake as
an absolute-form request; the proxy decides (one audit record), forwards the
Upgrade, relays the 101 and then raw bytes both ways until either side ends.

Network rule: every byte stays on 127.0.0.1 (the proxy resolves `localhost`
with a fake resolver, and the conftest's dial guard refuses anything else).
Every wait is bounded by IO_TIMEOUT or the idle timeout under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from egressbox.audit.record import AuditRecord
from egressbox.core.limits import Limits
from egressbox.core.policy import parse_policy
from egressbox.proxy.server import EgressProxy
from fakes import FakeResolver

IO_TIMEOUT = 15.0
LOOPBACK = "127.0.0.1"
DENIED = "denied.test"  # no allow rule: refused before any DNS query
IDLE_TIMEOUT = 1.0  # the smallest idle_timeout a policy may set
# Binary messages across the WebSocket length encodings (7-bit, 16-bit, 64-bit)
# and larger than one proxy read (256 KiB).
SIZES = (0, 1, 125, 126, 65535, 65536, 1024 * 1024)
PAYLOADS = [random.Random(20_240_612).randbytes(size) for size in SIZES]
WS_KEY = "dGhlIHNhbXBsZSBub25jZQ=="

Summary = list[tuple[str, str, int, str, str]]


def summary(records: list[AuditRecord]) -> Summary:
    return [(r.protocol.value, r.host, r.port, r.decision.value, r.reason.value) for r in records]


def allowed(port: int) -> tuple[str, str, int, str, str]:
    return ("http", "localhost", port, "allow", "allowed")


# -- the origin ----------------------------------------------------------------------------


@dataclass
class WsOrigin:
    """An aiohttp WebSocket echo server on 127.0.0.1 (/ws), recording what it saw."""

    port: int = 0
    headers: list[dict[str, str]] = field(default_factory=list)
    close_codes: list[int | None] = field(default_factory=list)
    runner: web.AppRunner | None = None

    async def start(self) -> WsOrigin:
        app = web.Application()
        app.router.add_get("/ws", self._ws)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((LOOPBACK, 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self.runner, sock).start()
        return self

    async def _ws(self, request: web.Request) -> web.StreamResponse:
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            if message.type is aiohttp.WSMsgType.TEXT:
                await ws.send_str(message.data)
            elif message.type is aiohttp.WSMsgType.BINARY:
                await ws.send_bytes(message.data)
        self.close_codes.append(ws.close_code)
        return ws

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@contextlib.asynccontextmanager
async def running_origin() -> AsyncIterator[WsOrigin]:
    server = await WsOrigin().start()
    try:
        yield server
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def running_proxy(
    port: int, monkeypatch: pytest.MonkeyPatch, limits: Limits | None = None
) -> AsyncIterator[EgressProxy]:
    """A proxy that allows localhost:PORT only, with ws_proxy pointing at it."""
    policy = parse_policy(
        {"egress": {"allow": [f"localhost:{port}"], "allow_cidrs": ["127.0.0.1/32"]}}, env={}
    )
    resolver = FakeResolver({"localhost": [LOOPBACK]})
    proxy = EgressProxy(policy, resolver=resolver, keep_records=True, limits=limits)
    await proxy.start()
    try:
        for name in ("http", "https", "ws", "wss", "all", "no"):
            for variable in (f"{name}_proxy", f"{name.upper()}_PROXY"):
                monkeypatch.delenv(variable, raising=False)
        monkeypatch.setenv("ws_proxy", str(proxy.http_url))
        yield proxy
    finally:
        await proxy.close(0)


@pytest.fixture
async def origin() -> AsyncIterator[WsOrigin]:
    async with running_origin() as server:
        yield server


StartProxy = Callable[..., Awaitable[EgressProxy]]


@pytest.fixture
async def start_proxy(
    origin: WsOrigin, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[StartProxy]:
    """Start proxies for `running_proxy` (the origin's port by default); closed afterwards."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(port: int | None = None, limits: Limits | None = None) -> EgressProxy:
            allowed_port = origin.port if port is None else port
            return await stack.enter_async_context(running_proxy(allowed_port, monkeypatch, limits))

        yield start


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(trust_env=True, timeout=aiohttp.ClientTimeout(total=IO_TIMEOUT))


async def until_no_connections(proxy: EgressProxy) -> None:
    """The proxy let go of every client connection (the relay ended)."""
    deadline = time.monotonic() + IO_TIMEOUT
    while proxy.state.connections or proxy.state.tunnels:
        assert time.monotonic() < deadline, "the proxy still holds a connection"
        await asyncio.sleep(0.01)


# -- aiohttp through ws_proxy -----------------------------------------------------------------


async def echo_through_the_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    async with running_origin() as origin, running_proxy(origin.port, monkeypatch) as proxy:
        url = f"ws://localhost:{origin.port}/ws"
        async with session() as client, client.ws_connect(url) as ws:
            for index in range(5):
                text = f"message {index} " + "é" * index
                await ws.send_str(text)
                assert await ws.receive_str(timeout=IO_TIMEOUT) == text
            for payload in PAYLOADS:
                await ws.send_bytes(payload)
                assert await ws.receive_bytes(timeout=IO_TIMEOUT) == payload
            await ws.send_str("last")
            assert await ws.receive_str(timeout=IO_TIMEOUT) == "last"
            assert await ws.close()
        assert ws.close_code == aiohttp.WSCloseCode.OK
        await until_no_connections(proxy)
        assert origin.close_codes == [aiohttp.WSCloseCode.OK]
        # One record: the decision made for the GET, however many messages followed.
        assert summary(proxy.records) == [allowed(origin.port)]
        (seen,) = origin.headers
        assert seen["host"] == f"localhost:{origin.port}"
        assert seen["upgrade"] == "websocket"
        assert seen["connection"] == "Upgrade"
        assert "sec-websocket-key" in seen and seen["sec-websocket-version"] == "13"
        assert not any(name.startswith("proxy-") for name in seen)


async def test_websocket_echo_through_the_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    await echo_through_the_proxy(monkeypatch)


def test_websocket_echo_through_the_proxy_on_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    # `egressbox serve` runs the proxy on uvloop, whose transports are not asyncio's.
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(echo_through_the_proxy(monkeypatch))


async def test_denied_websocket_gets_403(origin: WsOrigin, start_proxy: StartProxy) -> None:
    proxy = await start_proxy()
    async with session() as client:
        with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
            await client.ws_connect(f"ws://{DENIED}:{origin.port}/ws")
        assert caught.value.status == 403
        async with client.ws_connect(f"ws://localhost:{origin.port}/ws") as ws:
            await ws.send_str("allowed")
            assert await ws.receive_str(timeout=IO_TIMEOUT) == "allowed"
    await until_no_connections(proxy)
    assert summary(proxy.records) == [
        ("http", DENIED, origin.port, "deny", "no_allow_rule"),
        allowed(origin.port),
    ]
    assert len(origin.headers) == 1  # the denied handshake never reached the origin


async def test_wss_absolute_form_is_refused(origin: WsOrigin, start_proxy: StartProxy) -> None:
    proxy = await start_proxy()
    reader, writer = await raw_connect(proxy)
    try:
        writer.write(handshake(f"wss://localhost:{origin.port}/ws", origin.port))
        status, head = await read_head(reader)
        assert status == 400, head
        assert b"use CONNECT" in await asyncio.wait_for(reader.read(), IO_TIMEOUT)
    finally:
        writer.close()
    assert proxy.records == []  # refused by the parser: no decision was made


async def test_idle_websocket_is_closed(origin: WsOrigin, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(limits=Limits(idle_timeout=IDLE_TIMEOUT))
    async with session() as client, client.ws_connect(f"ws://localhost:{origin.port}/ws") as ws:
        await ws.send_str("ping")
        assert await ws.receive_str(timeout=IO_TIMEOUT) == "ping"
        started = time.monotonic()
        message = await ws.receive(timeout=IO_TIMEOUT)
        waited = time.monotonic() - started
    assert message.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSE)
    assert IDLE_TIMEOUT * 0.5 <= waited < IO_TIMEOUT
    await until_no_connections(proxy)
    assert summary(proxy.records) == [allowed(origin.port)]


# -- raw bytes: what exactly goes over each side ------------------------------------------------


def handshake(url: str, port: int, *extra: str) -> bytes:
    lines = [
        f"GET {url} HTTP/1.1",
        f"Host: localhost:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {WS_KEY}",
        "Sec-WebSocket-Version: 13",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def raw_connect(proxy: EgressProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    assert proxy.http_address is not None
    return await asyncio.wait_for(asyncio.open_connection(*proxy.http_address), IO_TIMEOUT)


async def read_head(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
    return int(head.split(b" ", 2)[1]), head


@dataclass
class ScriptedUpgrade:
    """A raw upstream: reads the head, answers `reply` (+ bytes), echoes, says bye at EOF."""

    reply: bytes
    heads: list[bytes] = field(default_factory=list)
    port: int = 0
    server: asyncio.Server | None = None

    async def start(self) -> ScriptedUpgrade:
        self.server = await asyncio.start_server(self._serve, LOOPBACK, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # OSError: the proxy may abort this connection at any point (say,
        # after a refused upgrade), and write_eof() then fails with ENOTCONN.
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
            self.heads.append(head)
            writer.write(self.reply)
            while data := await asyncio.wait_for(reader.read(65536), IO_TIMEOUT):
                writer.write(data)
                await writer.drain()
            writer.write(b"bye")
            writer.write_eof()
            await writer.drain()
        writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


SWITCH = (
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"
)


async def scripted_proxy(
    start_proxy: StartProxy, reply: bytes
) -> tuple[EgressProxy, ScriptedUpgrade]:
    """A scripted upstream, and a proxy that allows its port."""
    upstream = await ScriptedUpgrade(reply).start()
    return await start_proxy(upstream.port), upstream


async def test_raw_upgrade_relays_early_bytes_and_half_close(start_proxy: StartProxy) -> None:
    proxy, upstream = await scripted_proxy(start_proxy, SWITCH + b"early|")
    try:
        reader, writer = await raw_connect(proxy)
        try:
            url = f"ws://localhost:{upstream.port}/raw?x=1"
            # Bytes right behind the head wait for the 101, then go upstream.
            writer.write(handshake(url, upstream.port, "Proxy-Connection: keep-alive") + b"ping|")
            status, head = await read_head(reader)
            assert status == 101
            assert head == (
                b"HTTP/1.1 101 Switching Protocols\r\n"
                b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n"
                b"Upgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
            )
            got = await asyncio.wait_for(reader.readexactly(len(b"early|ping|")), IO_TIMEOUT)
            assert got == b"early|ping|"
            writer.write(b"pong")
            assert await asyncio.wait_for(reader.readexactly(4), IO_TIMEOUT) == b"pong"
            writer.write_eof()  # half-close: the upstream sees EOF and still answers
            assert await asyncio.wait_for(reader.read(), IO_TIMEOUT) == b"bye"
        finally:
            writer.close()
        await until_no_connections(proxy)
    finally:
        upstream.close()
    assert upstream.heads == [
        f"GET /raw?x=1 HTTP/1.1\r\nHost: localhost:{upstream.port}\r\n"
        f"Sec-WebSocket-Key: {WS_KEY}\r\nSec-WebSocket-Version: 13\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\n\r\n".encode()
    ]
    assert summary(proxy.records) == [allowed(upstream.port)]


async def test_refused_upgrade_closes_the_connection(start_proxy: StartProxy) -> None:
    reply = b"HTTP/1.1 403 Forbidden\r\nContent-Length: 2\r\n\r\nno"
    proxy, upstream = await scripted_proxy(start_proxy, reply)
    try:
        reader, writer = await raw_connect(proxy)
        try:
            url = f"ws://localhost:{upstream.port}/ws"
            writer.write(handshake(url, upstream.port) + b"early frame")
            status, head = await read_head(reader)
            assert status == 403
            assert head == (
                b"HTTP/1.1 403 Forbidden\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
            )
            # The body, then the end: nothing after the head is parsed as a request.
            assert await asyncio.wait_for(reader.read(), IO_TIMEOUT) == b"no"
        finally:
            writer.close()
        await until_no_connections(proxy)
    finally:
        upstream.close()
    assert summary(proxy.records) == [allowed(upstream.port)]


async def test_upgrade_with_a_body_is_refused(origin: WsOrigin, start_proxy: StartProxy) -> None:
    proxy = await start_proxy()
    reader, writer = await raw_connect(proxy)
    try:
        url = f"ws://localhost:{origin.port}/ws"
        writer.write(handshake(url, origin.port, "Content-Length: 5") + b"hello")
        status, _ = await read_head(reader)
        assert status == 400
        assert b"cannot carry a body" in await asyncio.wait_for(reader.read(), IO_TIMEOUT)
    finally:
        writer.close()
    assert proxy.records == []
    assert origin.headers == []
