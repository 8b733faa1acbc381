"""A reload re-judges what is open, through the library (EgressProxy.set_policy), with real
clients and origins on loopback: a decision waiting for its DNS answer when the policy changes
is the new policy's, a captured connection is closed like a tunnel, re-judging asks no DNS, and
an address ban added by a reload (deny_cidrs) closes a tunnel admitted by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from egressbox.core.errors import Reason
from egressbox.core.policy import parse_policy
from egressbox.net.resolve import Resolution
from egressbox.proxy.server import EgressProxy
from fakes import FakeResolver, ip

IO_TIMEOUT = 15.0
POLL = 0.01
LOOPBACK = "127.0.0.1"


class Origin:
    """An asyncio TCP echo origin on 127.0.0.1 counting accepted and closed connections."""

    def __init__(self) -> None:
        self.accepted = 0
        self.closed = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> Origin:
        self.server = await asyncio.start_server(self._serve, LOOPBACK, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        self.closed += 1
        writer.close()

    async def wait_closed(self) -> None:
        async with asyncio.timeout(IO_TIMEOUT):
            while not self.closed:
                await asyncio.sleep(POLL)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.fixture
async def origin() -> AsyncIterator[Origin]:
    made = await Origin().start()
    yield made
    made.close()


def _policy(allow: list[str], **egress: Any) -> Any:
    table = {"allow": allow, "allow_cidrs": ["127.0.0.0/8"], **egress}
    return parse_policy({"egress": table}, env={})


class GatedResolver(FakeResolver):
    """Answers only once `gate` is set (a slow DNS server)."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        super().__init__(answers)
        self.known = answers
        self.gate = asyncio.Event()

    async def resolve(self, host: str) -> Resolution:
        self.queries.append(host)
        await self.gate.wait()
        return Resolution(tuple(ip(a) for a in self.known[host]), (host,), 60.0, "dns")


async def _connect(proxy: EgressProxy, target: str) -> tuple[asyncio.StreamReader, Any]:
    assert proxy.http_address is not None
    reader, writer = await asyncio.open_connection(*proxy.http_address)
    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


async def _head(reader: asyncio.StreamReader) -> bytes:
    async with asyncio.timeout(IO_TIMEOUT):
        return await reader.readuntil(b"\r\n\r\n")


async def _ends(reader: asyncio.StreamReader) -> bool:
    async with asyncio.timeout(IO_TIMEOUT):
        try:
            return await reader.read(1) == b""
        except ConnectionResetError:
            return True


async def test_a_reload_while_the_name_is_resolved_decides_under_the_new_policy(
    origin: Origin,
) -> None:
    resolver = GatedResolver({"slow.test": [LOOPBACK]})
    proxy = EgressProxy(_policy([f"slow.test:{origin.port}"]), resolver=resolver, keep_records=True)
    await proxy.start()
    try:
        reader, writer = await _connect(proxy, f"slow.test:{origin.port}")
        async with asyncio.timeout(IO_TIMEOUT):
            while not resolver.queries:
                await asyncio.sleep(POLL)
        # Nothing is open yet to close: the decision is in flight.
        assert proxy.set_policy(_policy([], deny=["slow.test"])) == 0
        resolver.gate.set()
        head = await _head(reader)
        assert head.startswith(b"HTTP/1.1 403") and b"deny_rule" in head
        writer.close()
    finally:
        await proxy.close(0)
    assert origin.accepted == 0
    assert [(r.host, r.reason) for r in proxy.records] == [("slow.test", Reason.DENY_RULE)]


async def test_rejudging_asks_no_dns_and_a_new_deny_cidr_closes_a_tunnel_admitted_by_name(
    origin: Origin,
) -> None:
    resolver = FakeResolver({"named.test": [LOOPBACK]})
    proxy = EgressProxy(
        _policy([f"named.test:{origin.port}"]), resolver=resolver, keep_records=True
    )
    await proxy.start()
    try:
        reader, writer = await _connect(proxy, f"named.test:{origin.port}")
        assert (await _head(reader)).startswith(b"HTTP/1.1 200")
        writer.write(b"ping")
        async with asyncio.timeout(IO_TIMEOUT):
            assert await reader.readexactly(4) == b"ping"
        queries = list(resolver.queries)
        # The same allow entry, but its address is now in deny_cidrs: judged on the address
        # the tunnel was dialled to, with no second query.
        banned = _policy([f"named.test:{origin.port}"], deny_cidrs=["127.0.0.1/32"])
        assert proxy.set_policy(banned) == 1
        assert resolver.queries == queries
        assert await _ends(reader)
        await origin.wait_closed()
        writer.close()
    finally:
        await proxy.close(0)
    seen = [(r.protocol.value, r.decision.value, r.reason.value) for r in proxy.records]
    assert seen == [("connect", "allow", "allowed"), ("connect", "deny", "policy_reloaded")]


async def test_a_captured_connection_is_closed_by_a_reload(
    origin: Origin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A captured connection (`run` with capture) is a `tcp` tunnel: a reload that denies its
    destination closes it. The kernel's redirect is stood in for by the original destination
    the capture listener reads (tests/proxy/test_capture_clients.py has the real one)."""
    import egressbox.net.original as capture

    monkeypatch.setattr(capture, "original_destination", lambda sock: (LOOPBACK, origin.port))
    listener = socket.create_server((LOOPBACK, 0))
    listener.setblocking(False)
    proxy = EgressProxy(
        _policy([f"{LOOPBACK}:{origin.port}"]),
        http_port=None,
        socks_port=None,
        capture_sockets=[listener],
        keep_records=True,
    )
    await proxy.start()
    try:
        reader, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        writer.write(b"ping")
        async with asyncio.timeout(IO_TIMEOUT):
            assert await reader.readexactly(4) == b"ping"
        assert proxy.set_policy(_policy([], deny=[f"{LOOPBACK}:{origin.port}"])) == 1
        await origin.wait_closed()
        assert await _ends(reader)
        writer.close()
    finally:
        await proxy.close(0)
    seen = [(r.protocol.value, r.decision.value, r.reason.value) for r in proxy.records]
    assert seen == [("tcp", "allow", "allowed"), ("tcp", "deny", "policy_reloaded")]


async def test_a_reload_that_admits_a_held_request_lets_it_go_unanswered(origin: Origin) -> None:
    """A request held for an approval answer, whose target a reload's new allow entry admits,
    goes on at once as an allowed name (the decider is never answered); one that a reload
    denies is refused at once with policy_reloaded."""
    asked: list[object] = []

    async def never(request: object) -> str:
        asked.append(request)
        await asyncio.Event().wait()
        return "deny"

    proxy = EgressProxy(_policy([]), on_miss=never, keep_records=True)
    await proxy.start()
    try:
        admitted_reader, admitted_writer = await _connect(proxy, f"{LOOPBACK}:{origin.port}")
        refused_reader, refused_writer = await _connect(proxy, f"127.0.0.2:{origin.port}")
        async with asyncio.timeout(IO_TIMEOUT):
            while len(asked) < 2:
                await asyncio.sleep(POLL)
        reloaded = _policy([f"{LOOPBACK}:{origin.port}"], deny=[f"127.0.0.2:{origin.port}"])
        assert proxy.set_policy(reloaded) == 1  # the refused request
        assert (await _head(admitted_reader)).startswith(b"HTTP/1.1 200")
        admitted_writer.write(b"ping")
        async with asyncio.timeout(IO_TIMEOUT):
            assert await admitted_reader.readexactly(4) == b"ping"
        head = await _head(refused_reader)
        assert head.startswith(b"HTTP/1.1 403") and b"policy_reloaded" in head
        admitted_writer.close()
        refused_writer.close()
    finally:
        await proxy.close(0)
    seen = sorted((r.host, r.decision.value, r.reason.value) for r in proxy.records)
    assert seen == [("127.0.0.1", "allow", "allowed"), ("127.0.0.2", "deny", "policy_reloaded")]
    assert origin.accepted == 1
