"""Kept-alive and pipelined plain HTTP connections: every later request passes the same gate
as a first one, nothing wedges a connection slot, and idle clients are let go.

Findings these tests hold: a CONNECT pipelined after a GET (or sent as a second request)
wedged the connection in its deciding phase for ever; a bad port on a second request was
refused without an audit record; an idle kept-alive client held its slot for the tunnel idle
timeout (300 s); a zero-padded Content-Length went upstream as written. Everything runs on
loopback against the test origins; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from egressbox.proxy.server import EgressProxy
from proxy_fixtures import BASE_POLICY, HttpOrigin, StartProxy, StreamOrigin, Wire

pytestmark = pytest.mark.usefixtures("dials")

IO_TIMEOUT = 10.0


def _policy(**limits: Any) -> dict[str, Any]:
    policy = copy.deepcopy(BASE_POLICY)
    policy["limits"] = limits
    return policy


def get(port: int, path: str = "/hello", host: str = "origin.test") -> bytes:
    authority = f"{host}:{port}"
    return f"GET http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()


def connect(port: int, host: str = "origin.test") -> bytes:
    return f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()


async def _reply(wire: Wire, reader: asyncio.StreamReader) -> tuple[int, bytes]:
    status, headers, _ = await wire.read_head(reader)
    body = await wire.read_exactly(reader, int(headers.get("content-length", "0")))
    return status, body


async def test_a_connect_pipelined_after_a_get_is_a_tunnel_and_frees_its_slot(
    start_proxy: StartProxy, origin: HttpOrigin, wire: Wire
) -> None:
    proxy = await start_proxy(_policy(max_connections=4))
    for _ in range(6):  # more than max_connections, one after another
        reader, writer = await wire.open(proxy.http_address)
        try:
            writer.write(get(origin.port) + connect(origin.port))
            await writer.drain()
            assert await _reply(wire, reader) == (200, b"hello from v4")
            status, _, _ = await wire.read_head(reader)
            assert status == 200  # the tunnel is open: plain HTTP to the origin through it
            writer.write(b"GET /hello HTTP/1.1\r\nHost: origin.test\r\n\r\n")
            assert await _reply(wire, reader) == (200, b"hello from v4")
        finally:
            await wire.close(writer)
    summary = wire.summary(proxy.records)
    assert summary.count(("connect", "origin.test", origin.port, "allow", "allowed")) == 6
    assert summary.count(("http", "origin.test", origin.port, "allow", "allowed")) == 6


async def test_a_denied_connect_as_a_second_request_is_audited_and_closed(
    proxy: EgressProxy, origin: HttpOrigin, wire: Wire
) -> None:
    reader, writer = await wire.open(proxy.http_address)
    try:
        writer.write(get(origin.port))
        assert await _reply(wire, reader) == (200, b"hello from v4")
        writer.write(connect(origin.port, "elsewhere.example"))
        reply = await wire.read_reply(reader)
        assert reply.status == 403 and reply.closed
    finally:
        await wire.close(writer)
    assert wire.summary(proxy.records)[-1] == (
        "connect",
        "elsewhere.example",
        origin.port,
        "deny",
        "no_allow_rule",
    )


async def test_a_bad_port_on_a_second_request_is_audited(
    proxy: EgressProxy, origin: HttpOrigin, wire: Wire
) -> None:
    bad = b"GET http://origin.test:0/ HTTP/1.1\r\nHost: origin.test:0\r\n\r\n"
    first = await wire.exchange(proxy.http_address, bad)
    reader, writer = await wire.open(proxy.http_address)
    try:
        writer.write(get(origin.port))
        assert await _reply(wire, reader) == (200, b"hello from v4")
        writer.write(bad)
        reply = await wire.read_reply(reader)
        assert (reply.status, reply.body) == (first.status, first.body) and reply.closed
    finally:
        await wire.close(writer)
    summary = wire.summary(proxy.records)
    assert [r[3:] for r in summary] == [("deny", "bad_port"), ("allow", "allowed")] * 1 + [
        ("deny", "bad_port")
    ], summary


async def test_idle_keepalive_clients_are_cut_at_the_keepalive_timeout(
    start_proxy: StartProxy, origin: HttpOrigin, wire: Wire
) -> None:
    proxy = await start_proxy(_policy(max_connections=2, keepalive_timeout=0.3))
    idle = []
    for _ in range(2):
        reader, writer = await wire.open(proxy.http_address)
        writer.write(get(origin.port))
        assert await _reply(wire, reader) == (200, b"hello from v4")
        idle.append((reader, writer))
    try:
        for reader, _ in idle:  # the proxy closes each within the keep-alive timeout
            assert await asyncio.wait_for(reader.read(1), IO_TIMEOUT) == b""
        reader, writer = await wire.open(proxy.http_address)
        try:
            writer.write(get(origin.port))
            assert await _reply(wire, reader) == (200, b"hello from v4")  # a slot is free
        finally:
            await wire.close(writer)
    finally:
        for _, writer in idle:
            await wire.close(writer)


async def test_a_client_address_over_its_cap_gets_an_audited_503(
    start_proxy: StartProxy, origin: HttpOrigin, wire: Wire
) -> None:
    proxy = await start_proxy(_policy(max_connections_per_client=1))
    first_reader, first_writer = await wire.open(proxy.http_address)
    try:
        first_writer.write(get(origin.port))
        assert await _reply(wire, first_reader) == (200, b"hello from v4")
        reply = await wire.exchange(proxy.http_address, get(origin.port))
        assert reply.status == 503
    finally:
        await wire.close(first_writer)
    assert wire.summary(proxy.records)[-1][3:] == ("deny", "too_many_connections")
    async with asyncio.timeout(IO_TIMEOUT):  # both connections are let go, and counted so
        while proxy.state.per_client:
            await asyncio.sleep(0.01)
    reader, writer = await wire.open(proxy.http_address)
    try:
        writer.write(get(origin.port))
        assert await _reply(wire, reader) == (200, b"hello from v4")
    finally:
        await wire.close(writer)


class HeadOrigin(StreamOrigin):
    """Records each request head and body as received, answers 200."""

    def __init__(self) -> None:
        super().__init__()
        self.heads: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
        body = await asyncio.wait_for(reader.readexactly(5), IO_TIMEOUT)
        self.heads.append(head + body)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()


async def test_a_forwarded_content_length_is_plain_decimal(proxy: EgressProxy, wire: Wire) -> None:
    origin = await HeadOrigin().start()
    try:
        request = (
            f"POST http://127.0.0.1:{origin.port}/ HTTP/1.1\r\nHost: 127.0.0.1:{origin.port}\r\n"
            "Content-Length: 0000000000000005\r\n\r\nhello"
        ).encode()
        reader, writer = await wire.open(proxy.http_address)
        try:
            writer.write(request)
            status, _ = await _reply(wire, reader)
            assert status == 200
        finally:
            await wire.close(writer)
    finally:
        await origin.close()
    assert len(origin.heads) == 1
    head = origin.heads[0]
    assert b"\r\nContent-Length: 5\r\n" in head, head
    assert b"00000" not in head and head.endswith(b"\r\n\r\nhello")


@pytest.mark.pure_only
async def test_a_bug_in_a_callback_closes_that_connection_and_frees_its_slot(
    start_proxy: StartProxy, origin: HttpOrigin, wire: Wire, monkeypatch: pytest.MonkeyPatch
) -> None:
    from egressbox.proxy import forward

    def broken(self: object, upstream: object, data: bytes) -> None:
        raise RuntimeError("injected fault")

    proxy = await start_proxy(_policy(max_connections=1))
    with monkeypatch.context() as patch:
        patch.setattr(forward.Forwarder, "upstream_data", broken)
        reader, writer = await wire.open(proxy.http_address)
        try:
            writer.write(get(origin.port))
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), IO_TIMEOUT) == b""  # closed, not hung
        finally:
            await wire.close(writer)
    assert proxy.state.internal_errors == 1
    reader, writer = await wire.open(proxy.http_address)  # the one slot came back
    try:
        writer.write(get(origin.port))
        assert await _reply(wire, reader) == (200, b"hello from v4")
    finally:
        await wire.close(writer)
