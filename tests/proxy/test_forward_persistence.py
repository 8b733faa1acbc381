"""Plain HTTP forwarding keeps an upstream connection only for the same client connection.

Each request is still decided and audited on its own; the upstream connection
is kept for the next request of the same client connection only when that
decision admits the same host, port and address and the response ended
cleanly. These tests run the proxy against scripted loopback origins that
count connections and misbehave on purpose: closing a kept connection just as
the next request arrives, sending bytes after a response, answering with
`Connection: close` or HTTP/1.0.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import pytest

from egressbox.proxy.server import EgressProxy
from egressbox.proxy.tunnel import Connection
from proxy_fixtures import StreamOrigin

if TYPE_CHECKING:
    from proxy_fixtures import HttpOrigin, Wire

IO_TIMEOUT = 10.0


@dataclass(frozen=True)
class AndClose:
    """Send these bytes, then close the connection."""

    data: bytes


# What a scripted connection does with its n-th request: send these bytes
# (None: close the connection without answering).
Script = Callable[[int, int], "bytes | AndClose | None"]


def ok(body: bytes, *extra: str) -> bytes:
    fields = "".join(f"{item}\r\n" for item in extra)
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{fields}\r\n".encode() + body


class ScriptOrigin(StreamOrigin):
    """Answers requests per (connection index, request index) from a script."""

    def __init__(self, script: Script) -> None:
        super().__init__()
        self.script = script
        self.requests: list[tuple[int, bytes]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self.accepted - 1
        for n in range(100):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
            self.requests.append((index, head))
            answer = self.script(index, n)
            if answer is None:
                return
            writer.write(answer.data if isinstance(answer, AndClose) else answer)
            await writer.drain()
            if isinstance(answer, AndClose):
                return


StartOrigin = Callable[[Script], Awaitable[ScriptOrigin]]


@pytest.fixture
async def scripted() -> AsyncIterator[StartOrigin]:
    started: list[ScriptOrigin] = []

    async def start(script: Script) -> ScriptOrigin:
        origin = await ScriptOrigin(script).start()
        started.append(origin)
        return origin

    try:
        yield start
    finally:
        for origin in started:
            await origin.close()


def get(port: int, path: str, host: str = "origin.test", extra: str = "") -> bytes:
    authority = f"{host}:{port}"
    return f"GET http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\n{extra}\r\n".encode()


async def ask(
    wire: Wire, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[int, dict[str, str], bytes]:
    writer.write(request)
    await writer.drain()
    status, headers, _ = await wire.read_head(reader)
    body = await wire.read_exactly(reader, int(headers.get("content-length", "0")))
    return status, headers, body


async def test_same_host_on_one_client_connection_rides_one_upstream_connection(
    proxy: EgressProxy, origin: HttpOrigin, wire: Wire
) -> None:
    reader, writer = await wire.open(proxy.http_address)
    try:
        for _ in range(3):
            status, _, body = await ask(wire, reader, writer, get(origin.port, "/hello"))
            assert (status, body) == (200, b"hello from v4")
    finally:
        await wire.close(writer)
    # Three decisions, three records, one upstream connection.
    assert len(proxy.records) == 3
    assert origin.accepted == 1


async def test_upstream_connections_are_never_shared_between_client_connections(
    proxy: EgressProxy, origin: HttpOrigin, wire: Wire
) -> None:
    for _ in range(3):
        reader, writer = await wire.open(proxy.http_address)
        try:
            status, _, _ = await ask(wire, reader, writer, get(origin.port, "/hello"))
            assert status == 200
        finally:
            await wire.close(writer)
    assert origin.accepted == 3


async def test_another_host_name_gets_its_own_upstream_connection(
    proxy: EgressProxy, origin: HttpOrigin, wire: Wire
) -> None:
    reader, writer = await wire.open(proxy.http_address)
    try:
        for host in ("origin.test", "127.0.0.1", "origin.test"):
            status, _, _ = await ask(wire, reader, writer, get(origin.port, "/hello", host))
            assert status == 200
    finally:
        await wire.close(writer)
    assert origin.accepted == 3


async def test_a_kept_connection_closed_under_a_get_is_retried_once_on_a_new_one(
    proxy: EgressProxy, scripted: StartOrigin, wire: Wire
) -> None:
    # Connection 0 answers its first request, then closes on reading the
    # second without a byte (its keep-alive timer raced our write).
    origin = await scripted(
        lambda conn, n: (ok(b"first") if n == 0 else None) if conn == 0 else ok(b"again")
    )
    reader, writer = await wire.open(proxy.http_address)
    try:
        assert (await ask(wire, reader, writer, get(origin.port, "/a")))[2] == b"first"
        assert (await ask(wire, reader, writer, get(origin.port, "/b")))[2] == b"again"
    finally:
        await wire.close(writer)
    assert origin.accepted == 2
    assert [conn for conn, _ in origin.requests] == [0, 0, 1]
    assert len(proxy.records) == 2  # the retry is the same decision: no second record


async def test_a_kept_connection_closed_under_a_post_is_not_retried(
    proxy: EgressProxy, scripted: StartOrigin, wire: Wire
) -> None:
    origin = await scripted(lambda conn, n: ok(b"first") if (conn, n) == (0, 0) else None)
    reader, writer = await wire.open(proxy.http_address)
    try:
        assert (await ask(wire, reader, writer, get(origin.port, "/a")))[2] == b"first"
        post = get(origin.port, "/b", extra="Content-Length: 4\r\n").replace(b"GET", b"POST", 1)
        status, headers, _ = await ask(wire, reader, writer, post + b"data")
    finally:
        await wire.close(writer)
    assert status == 502
    assert headers["x-egressbox-reason"] == "bad_upstream_response"
    assert origin.accepted == 1


async def test_bytes_after_a_response_are_never_read_as_the_next_response(
    proxy: EgressProxy, scripted: StartOrigin, wire: Wire
) -> None:
    smuggled = ok(b"first") + ok(b"evil")
    origin = await scripted(lambda conn, n: smuggled if conn == 0 else ok(b"good"))
    reader, writer = await wire.open(proxy.http_address)
    try:
        assert (await ask(wire, reader, writer, get(origin.port, "/a")))[2] == b"first"
        assert (await ask(wire, reader, writer, get(origin.port, "/b")))[2] == b"good"
    finally:
        await wire.close(writer)
    assert origin.accepted == 2


@pytest.mark.parametrize(
    "first",
    [
        ok(b"first", "Connection: close"),
        b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nfirst",
    ],
    ids=["connection-close", "http10"],
)
async def test_an_upstream_that_did_not_offer_persistence_is_not_reused(
    proxy: EgressProxy, scripted: StartOrigin, wire: Wire, first: bytes
) -> None:
    origin = await scripted(lambda conn, n: first if n == 0 else ok(b"second"))
    reader, writer = await wire.open(proxy.http_address)
    try:
        assert (await ask(wire, reader, writer, get(origin.port, "/a")))[2] == b"first"
        # The proxy never sends the next request into that connection: a new one answers.
        assert (await ask(wire, reader, writer, get(origin.port, "/b")))[2] == b"first"
    finally:
        await wire.close(writer)
    assert origin.accepted == 2
    assert [conn for conn, _ in origin.requests] == [0, 1]


async def test_the_request_upstream_asks_for_persistence_only_when_the_client_does(
    proxy: EgressProxy, scripted: StartOrigin, wire: Wire
) -> None:
    origin = await scripted(lambda conn, n: ok(b"x"))
    reader, writer = await wire.open(proxy.http_address)
    try:
        await ask(wire, reader, writer, get(origin.port, "/a"))
        await ask(wire, reader, writer, get(origin.port, "/b", extra="Connection: close\r\n"))
        assert await wire.read_to_eof(reader) == b""  # the proxy closes after the last one
    finally:
        await wire.close(writer)
    heads = [head for _, head in origin.requests]
    assert b"connection: close" not in heads[0].lower()
    assert b"\r\nconnection: close\r\n" in heads[1].lower()


async def test_an_idle_kept_connection_closed_by_the_upstream_is_dialed_anew(
    proxy: EgressProxy, scripted: StartOrigin, wire: Wire
) -> None:
    origin = await scripted(lambda conn, n: AndClose(ok(b"one")) if conn == 0 else ok(b"two"))
    reader, writer = await wire.open(proxy.http_address)
    try:
        assert (await ask(wire, reader, writer, get(origin.port, "/a")))[2] == b"one"
        await asyncio.sleep(0.2)  # the upstream's close reaches the proxy while idle
        assert (await ask(wire, reader, writer, get(origin.port, "/b")))[2] == b"two"
    finally:
        await wire.close(writer)
    assert origin.accepted == 2
    assert len(proxy.records) == 2


async def test_a_client_that_stops_reading_holds_back_the_upstream_across_requests(
    proxy: EgressProxy, origin: HttpOrigin, wire: Wire
) -> None:
    # Three pipelined 4 MiB downloads, and the client reads nothing for a while: the
    # proxy must stop reading each upstream (a new one too) instead of buffering.
    reader, writer = await wire.open(proxy.http_address)
    try:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        # Another host name each time: each response comes on a new upstream connection.
        hosts = ("origin.test", "127.0.0.1", "origin.test")
        writer.write(b"".join(get(origin.port, "/big", host) for host in hosts))
        await writer.drain()
        await asyncio.sleep(0.5)
        held = [cast(Connection, c) for c in proxy.state.connections]
        buffered = [c.transport.get_write_buffer_size() for c in held if c.transport]
        assert buffered and max(buffered) < 2 * 1024 * 1024
        for _ in range(3):
            status, headers, _ = await wire.read_head(reader)
            body = await wire.read_exactly(reader, int(headers["content-length"]))
            assert status == 200 and len(body) == len(wire.big_body)
            assert body == wire.big_body
    finally:
        await wire.close(writer)
    assert origin.accepted == 3


async def test_a_body_cut_short_while_the_upstream_is_dialed_ends_the_connection(
    proxy: EgressProxy, origin: HttpOrigin, wire: Wire
) -> None:
    # Head, part of the body and the client's FIN arrive together: the FIN comes
    # while the upstream connection is being made, and the request can never be
    # whole, so the proxy must end the connection now, not at the idle timeout.
    reader, writer = await wire.open(proxy.http_address)
    try:
        head = get(origin.port, "/echo", extra="Content-Length: 10\r\n").replace(b"GET", b"POST")
        writer.write(head + b"abc")
        writer.write_eof()
        async with asyncio.timeout(2.0):
            assert await reader.read() == b""
    finally:
        await wire.close(writer)
    async with asyncio.timeout(2.0):
        while proxy.state.connections:
            await asyncio.sleep(0.01)
