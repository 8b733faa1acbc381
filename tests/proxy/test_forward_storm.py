"""A storm of kept-alive plain-HTTP clients against an origin with every kind of framing.

Clients send random sequences on one connection: GETs, POSTs with a sized or a
chunked body, pipelined bursts, malformed heads, bodies cut short, resets and
early closes. The origin answers by path with a sized, chunked, close-delimited,
`Connection: close`, 1xx-first or 204 response, or with stray bytes after the
response. Whatever happens, the proxy reports no internal error, every valid
answer reaches its client intact, the proxy serves afterwards, and every
descriptor it opened is closed again. Seeded and bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random

from egressbox.proxy.server import EgressProxy
from proxy_fixtures import StreamOrigin, Wire, make_policy

SEED = 20_261_130
CLIENTS = 160
CONCURRENCY = 16
IO_TIMEOUT = 10.0
STYLES = ("sized", "chunked", "close", "connection-close", "continue", "nocontent", "stray")


def response(style: str, body: bytes) -> tuple[bytes, bool]:
    """(bytes to send, close afterwards) for a response of `style` carrying `body`."""
    sized = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    if style == "sized":
        return sized, False
    if style == "chunked":
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:3], body[3:]))
        return (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n",
            False,
        )
    if style == "close":
        return b"HTTP/1.1 200 OK\r\n\r\n" + body, True
    if style == "connection-close":
        head = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
        return head + body, True
    if style == "continue":
        return b"HTTP/1.1 100 Continue\r\n\r\n" + sized, False
    if style == "nocontent":
        return b"HTTP/1.1 204 No Content\r\n\r\n", False
    assert style == "stray"
    return sized + b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil", False


class StyledOrigin(StreamOrigin):
    """Answers each request by the style in its path: /STYLE/TOKEN -> body TOKEN."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
            await self._skip_body(reader, head.lower())
            _, style, token = head.split(b" ", 2)[1].split(b"/", 3)[:3]
            data, close = response(style.decode(), token)
            writer.write(data)
            await writer.drain()
            if close:
                return

    @staticmethod
    async def _skip_body(reader: asyncio.StreamReader, head: bytes) -> None:
        if b"\r\ntransfer-encoding: chunked" in head:
            # The proxy re-encodes chunks canonically and sends no trailers.
            await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), IO_TIMEOUT)
        elif b"\r\ncontent-length: " in head:
            length = int(head.split(b"\r\ncontent-length: ")[1].split(b"\r\n")[0])
            await asyncio.wait_for(reader.readexactly(length), IO_TIMEOUT)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


class Storm:
    def __init__(self, proxy: EgressProxy, origin: StyledOrigin, rng: random.Random) -> None:
        self.proxy = proxy
        self.origin = origin
        self.rng = rng
        self.answered = 0

    def request(self, token: str) -> tuple[bytes, str]:
        """A random valid request for a random style; the style comes back too."""
        style = self.rng.choice(STYLES)
        target = f"127.0.0.1:{self.origin.port}"
        path = f"/{style}/{token}"
        body = self.rng.randbytes(self.rng.choice((0, 0, 5, 3000)))
        head = f"http://{target}{path} HTTP/1.1\r\nHost: {target}\r\n"
        if not body:
            return f"GET {head}\r\n".encode(), style
        if self.rng.random() < 0.5:
            return f"POST {head}Content-Length: {len(body)}\r\n\r\n".encode() + body, style
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        return f"POST {head}Transfer-Encoding: chunked\r\n\r\n".encode() + chunked, style

    async def client(self, number: int) -> None:
        address = self.proxy.http_address
        assert address is not None
        reader, writer = await asyncio.open_connection(*address)
        try:
            for step in range(self.rng.randint(1, 6)):
                if not await self.step(reader, writer, f"c{number}s{step}"):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), IO_TIMEOUT)

    async def step(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str
    ) -> bool:
        """One action; False when the connection is done."""
        roll = self.rng.random()
        if roll < 0.08:
            writer.write(b"GET http://127.0.0.1:1/ HTTP/1.1\r\nHost: a\r\nBad Header: x\r\n\r\n")
            await writer.drain()
            return False
        if roll < 0.14:
            data, _ = self.request(token)
            writer.write(data[: self.rng.randint(1, len(data) - 1)])  # cut short
            await writer.drain()
            if self.rng.random() < 0.5:
                writer.transport.abort()
            return False
        burst = [self.request(f"{token}p{i}") for i in range(self.rng.choice((1, 1, 2, 3)))]
        writer.write(b"".join(data for data, _ in burst))
        await writer.drain()
        for index, (_, style) in enumerate(burst):
            if not await self.answer(reader, style, f"{token}p{index}".encode()):
                return False
        return True

    async def answer(self, reader: asyncio.StreamReader, style: str, token: bytes) -> bool:
        """Read one answer and check it; False when the proxy closes after it."""
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
        status = int(head.split(b" ", 2)[1])
        if status == 100:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT)
            status = int(head.split(b" ", 2)[1])
        lower = head.lower()
        body = b""
        if b"\r\ntransfer-encoding: chunked" in lower:
            while True:
                size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), IO_TIMEOUT))[:-2], 16)
                chunk = await asyncio.wait_for(reader.readexactly(size + 2), IO_TIMEOUT)
                if size == 0:
                    break
                body += chunk[:-2]
        elif b"\r\ncontent-length: " in lower:
            length = int(lower.split(b"\r\ncontent-length: ")[1].split(b"\r\n")[0])
            body = await asyncio.wait_for(reader.readexactly(length), IO_TIMEOUT)
        if style == "nocontent":
            assert status == 204
        else:
            assert (status, body) == (200, token), (style, status, body, token)
        self.answered += 1
        return b"\r\nconnection: close" not in lower


async def test_a_storm_of_kept_alive_clients_leaves_the_proxy_clean(wire: Wire) -> None:
    origin = await StyledOrigin().start()
    lines: list[str] = []
    policy = make_policy({"egress": {"allow": ["127.0.0.1"], "allow_cidrs": ["127.0.0.0/8"]}})
    proxy = EgressProxy(policy, log=lines.append)
    await proxy.start()
    try:
        # Warm up (uvloop and the resolver open descriptors once), then count.
        storm = Storm(proxy, origin, random.Random(SEED))
        await storm.client(-1)
        await asyncio.sleep(0.1)
        baseline = fd_count()
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(number: int) -> None:
            async with gate:
                await storm.client(number)

        async with asyncio.timeout(120):
            await asyncio.gather(*(one(n) for n in range(CLIENTS)))
        assert storm.answered > CLIENTS  # most clients got answers, several each
        # Still serving.
        reader, writer = await wire.open(proxy.http_address)
        try:
            data, style = storm.request("after")
            writer.write(data)
            await writer.drain()
            await storm.answer(reader, style, b"after")
        finally:
            await wire.close(writer)
        # Every connection ends, on both sides, and every descriptor is closed again.
        async with asyncio.timeout(IO_TIMEOUT):
            while proxy.state.connections or proxy.state.tunnels or origin.writers:
                await asyncio.sleep(0.02)
            while fd_count() > baseline:
                await asyncio.sleep(0.02)
        assert not [line for line in lines if "internal error" in line]
    finally:
        await proxy.close(0)
        await origin.close()
