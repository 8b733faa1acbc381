"""Tests for egressbox.net.relay with real loopback TCP sockets, on asyncio and uvloop.

Every scenario runs in a fresh loop of each kind and checks that the process
has as many open descriptors afterwards as before. Three relay modes:
`protocol` (never splices), `splice` (splices from the start) and `hybrid`
(moves to splice after a low threshold, mid-stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast

import pytest

from egressbox.net.relay import (
    MAX_READ,
    SPLICE_AVAILABLE,
    WRITE_HIGH_WATER,
    CloseReason,
    PipePool,
    RelayStats,
    Tunnel,
    default_pipe_pool,
    new_tunnel,
    open_tunnel,
    open_tunnel_with_upstream,
    relay,
    take_socket,
)
from loops import LOOPS, Runner, Scenario

pytestmark = pytest.mark.timeout(60)

# Bytes before splice: None never, 0 from the start, 64 KiB mid-stream.
THRESHOLDS: dict[str, int | None] = {"protocol": None, "splice": 0, "hybrid": 64 * 1024}
MODES = list(THRESHOLDS)
# Every scenario must finish well inside this on a loaded machine.
SCENARIO_TIMEOUT = 30.0
# Long enough never to fire in scenarios that do not test it.
IDLE = 60.0
# Large enough to need many reads, flow control and (hybrid) a switch.
PAYLOAD = 6 * 1024 * 1024
# A pipe holds at most this: F_SETPIPE_SZ may be refused, never exceeded.
PIPE_BOUND = 1 << 20


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _warm_up() -> None:
    # uvloop opens /dev/null once, on its first transport: not ours to count.
    a, b = tcp_pair()
    _, writer = await asyncio.open_connection(sock=a)
    writer.close()
    await writer.wait_closed()
    b.close()


async def _checked(scenario: Scenario) -> None:
    await _warm_up()
    before = fd_count()
    async with asyncio.timeout(SCENARIO_TIMEOUT):
        await scenario()
    for _ in range(3):  # transports close their sockets on the next loop turn
        await asyncio.sleep(0)
    assert fd_count() == before


@pytest.fixture(params=list(LOOPS))
def run(request: pytest.FixtureRequest) -> Runner:
    factory = LOOPS[request.param]

    def runner(scenario: Scenario) -> None:
        with asyncio.Runner(loop_factory=factory) as r:
            r.run(_checked(scenario))

    return runner


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected non-blocking TCP sockets over 127.0.0.1."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Harness:
    tunnel: Tunnel
    pool: PipePool
    client_r: asyncio.StreamReader
    client_w: asyncio.StreamWriter
    upstream_r: asyncio.StreamReader
    upstream_w: asyncio.StreamWriter

    async def stats(self) -> RelayStats:
        return await asyncio.wait_for(asyncio.shield(self.tunnel.done), SCENARIO_TIMEOUT)


@contextlib.asynccontextmanager
async def harness(
    mode: str,
    *,
    idle_timeout: float = IDLE,
    initial_to_upstream: bytes = b"",
    initial_to_client: bytes = b"",
    early_client: bytes = b"",
    early_upstream: bytes = b"",
    pool: PipePool | None = None,
) -> AsyncIterator[Harness]:
    """client app <-> relay <-> upstream app; early_* are sent before the relay starts."""
    pipes = pool or PipePool()
    client_app, client_relay = tcp_pair()
    upstream_relay, upstream_app = tcp_pair()
    client_app.sendall(early_client)
    upstream_app.sendall(early_upstream)
    tunnel = await open_tunnel(
        client_relay,
        upstream_relay,
        idle_timeout=idle_timeout,
        initial_to_upstream=initial_to_upstream,
        initial_to_client=initial_to_client,
        splice_threshold=THRESHOLDS[mode],
        pipes=pipes,
    )
    cr, cw = await asyncio.open_connection(sock=client_app)
    ur, uw = await asyncio.open_connection(sock=upstream_app)
    try:
        yield Harness(tunnel, pipes, cr, cw, ur, uw)
    finally:
        tunnel.abort()
        await tunnel.done
        for writer in (cw, uw):
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if pool is None:
            pipes.close()
            assert pipes.open_pipes == 0


async def send(writer: asyncio.StreamWriter, data: bytes, *, eof: bool = True) -> None:
    writer.write(data)
    await writer.drain()
    if eof:
        writer.write_eof()


async def read_to_end(reader: asyncio.StreamReader) -> bytes:
    """Everything until EOF; a reset also ends the stream."""
    try:
        return await reader.read()
    except ConnectionError:
        return b""


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER 0: the kernel sends RST instead of FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def expect_spliced(mode: str, stats: RelayStats) -> None:
    assert stats.spliced is (mode != "protocol" and SPLICE_AVAILABLE)


# --- Bytes, half-close, initial bytes --------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_bytes_both_ways_exact(run: Runner, mode: str) -> None:
    up, down = os.urandom(PAYLOAD), os.urandom(PAYLOAD + 12345)

    async def scenario() -> None:
        async with harness(mode) as h:
            _, _, got_up, got_down = await asyncio.gather(
                send(h.client_w, up),
                send(h.upstream_w, down),
                read_to_end(h.upstream_r),
                read_to_end(h.client_r),
            )
            stats = await h.stats()
        assert digest(got_up) == digest(up)
        assert digest(got_down) == digest(down)
        assert (stats.bytes_up, stats.bytes_down) == (len(up), len(down))
        assert stats.closed_by is CloseReason.EOF
        expect_spliced(mode, stats)

    run(scenario)


@pytest.mark.parametrize("mode", MODES)
def test_client_half_close_still_receives_the_rest(run: Runner, mode: str) -> None:
    request, response = b"GET / HTTP/1.0\r\n\r\n", os.urandom(3 * 1024 * 1024)

    async def scenario() -> None:
        async with harness(mode) as h:
            await send(h.client_w, request)  # client shuts its write side
            assert await read_to_end(h.upstream_r) == request  # upstream sees EOF
            await send(h.upstream_w, response)
            got = await read_to_end(h.client_r)
            stats = await h.stats()
        assert digest(got) == digest(response)
        assert stats.closed_by is CloseReason.EOF

    run(scenario)


@pytest.mark.parametrize("mode", MODES)
def test_upstream_half_close_client_keeps_sending(run: Runner, mode: str) -> None:
    banner, upload = b"220 ready\r\n", os.urandom(3 * 1024 * 1024)

    async def scenario() -> None:
        async with harness(mode) as h:
            await send(h.upstream_w, banner)
            assert await read_to_end(h.client_r) == banner
            await send(h.client_w, upload)
            got = await read_to_end(h.upstream_r)
            stats = await h.stats()
        assert digest(got) == digest(upload)
        assert stats.closed_by is CloseReason.EOF

    run(scenario)


@pytest.mark.parametrize("mode", MODES)
def test_initial_bytes_go_first_and_in_order(run: Runner, mode: str) -> None:
    # The reply is larger than the high-water mark, so it is still queued
    # when upstream bytes arrive; they must wait behind it.
    reply = b"HTTP/1.1 200 Connection established\r\n\r\n" + os.urandom(WRITE_HIGH_WATER * 2)
    rest_of_request = b"bytes the server read past the request head"

    async def scenario() -> None:
        async with harness(
            mode,
            initial_to_upstream=rest_of_request,
            initial_to_client=reply,
            early_client=b"client spoke early",
            early_upstream=b"server banner",
        ) as h:
            await send(h.client_w, b" and more")
            await send(h.upstream_w, b" and more")
            got_up, got_down = await asyncio.gather(
                read_to_end(h.upstream_r), read_to_end(h.client_r)
            )
            stats = await h.stats()
        assert got_up == rest_of_request + b"client spoke early and more"
        assert digest(got_down) == digest(reply + b"server banner and more")
        assert stats.bytes_up == len(got_up)
        assert stats.bytes_down == len(got_down)

    run(scenario)


# --- Idle timeout ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_idle_timeout_closes_both(run: Runner, mode: str) -> None:
    async def scenario() -> None:
        async with harness(mode, idle_timeout=0.3) as h:
            stats = await h.stats()
            assert await read_to_end(h.client_r) == b""
            assert await read_to_end(h.upstream_r) == b""
        assert stats.closed_by is CloseReason.IDLE_TIMEOUT

    run(scenario)


@pytest.mark.parametrize("mode", MODES)
def test_traffic_defers_idle_timeout(run: Runner, mode: str) -> None:
    async def scenario() -> None:
        async with harness(mode, idle_timeout=0.5) as h:
            h.client_w.write(os.urandom(256 * 1024))  # enough for hybrid to switch
            await h.upstream_r.readexactly(256 * 1024)
            for _ in range(10):  # 1 s of traffic, twice the idle timeout
                await asyncio.sleep(0.1)
                h.client_w.write(b"x")
                await h.upstream_r.readexactly(1)
                assert not h.tunnel.done.done()
            stats = await h.stats()
        assert stats.closed_by is CloseReason.IDLE_TIMEOUT
        assert stats.bytes_up == 256 * 1024 + 10
        expect_spliced(mode, stats)

    run(scenario)


# --- Resets, cancellation, abort ----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("side", ["client", "upstream"])
def test_peer_reset(run: Runner, mode: str, side: str) -> None:
    async def scenario() -> None:
        async with harness(mode) as h:
            h.client_w.write(os.urandom(256 * 1024))  # moves hybrid to splice first
            await h.upstream_r.readexactly(256 * 1024)
            gone, other = (
                (h.client_w, h.upstream_r) if side == "client" else (h.upstream_w, h.client_r)
            )
            reset(gone)
            stats = await h.stats()
            assert await read_to_end(other) == b""
        expected = CloseReason.CLIENT_RESET if side == "client" else CloseReason.UPSTREAM_RESET
        assert stats.closed_by is expected

    run(scenario)


@pytest.mark.parametrize("mode", MODES)
def test_reset_while_sending_to_that_side(run: Runner, mode: str) -> None:
    async def scenario() -> None:
        async with harness(mode) as h:
            writer = asyncio.create_task(send(h.upstream_w, os.urandom(PAYLOAD)))
            await h.client_r.readexactly(256 * 1024)
            reset(h.client_w)
            stats = await h.stats()
            with contextlib.suppress(ConnectionError):
                await writer
        assert stats.closed_by is CloseReason.CLIENT_RESET

    run(scenario)


@pytest.mark.parametrize("mode", MODES)
def test_cancel_closes_both_and_reraises(run: Runner, mode: str) -> None:
    async def scenario() -> None:
        pool = PipePool()
        client_app, client_relay = tcp_pair()
        upstream_relay, upstream_app = tcp_pair()
        task = asyncio.create_task(
            relay(
                client_relay,
                upstream_relay,
                idle_timeout=IDLE,
                splice_threshold=THRESHOLDS[mode],
                pipes=pool,
            )
        )
        cr, cw = await asyncio.open_connection(sock=client_app)
        ur, uw = await asyncio.open_connection(sock=upstream_app)
        sender = asyncio.create_task(send(uw, os.urandom(PAYLOAD)))
        await cr.readexactly(512 * 1024)  # mid-transfer, with bytes buffered
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await read_to_end(ur) == b""
        with contextlib.suppress(ConnectionError):
            await sender
        for writer in (cw, uw):
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        pool.close()
        assert pool.open_pipes == 0

    run(scenario)


@pytest.mark.parametrize("mode", MODES)
def test_abort_ends_with_aborted(run: Runner, mode: str) -> None:
    async def scenario() -> None:
        async with harness(mode) as h:
            await send(h.client_w, b"hello", eof=False)
            assert await h.upstream_r.readexactly(5) == b"hello"
            h.tunnel.abort()
            stats = await h.stats()
            assert await read_to_end(h.client_r) == b""
        assert stats.closed_by is CloseReason.ABORTED
        assert stats.bytes_up == 5

    run(scenario)


# --- Flow control, splice pipes ----------------------------------------------------------


@pytest.mark.parametrize("mode", [*MODES, "copy"])
def test_slow_reader_keeps_relay_buffers_bounded(run: Runner, mode: str) -> None:
    data = os.urandom(4 * PAYLOAD)
    # Protocol: one read past the high-water mark; splice: one pipe; copy
    # (splice mode with the pool exhausted): one read.
    bounds = {"protocol": WRITE_HIGH_WATER + MAX_READ, "copy": MAX_READ}
    bound = bounds.get(mode, PIPE_BOUND)

    async def scenario() -> None:
        pool = PipePool(max_pipes=1)
        pool.join()
        held = pool.acquire() if mode == "copy" else None
        async with harness("splice" if mode == "copy" else mode, pool=pool) as h:
            writer = asyncio.create_task(send(h.upstream_w, data))
            peak = 0
            cpu, wall = time.process_time(), time.monotonic()
            for _ in range(25):  # 0.5 s in which the client reads nothing
                await asyncio.sleep(0.02)
                peak = max(peak, h.tunnel.buffered)
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
            got = await read_to_end(h.client_r)
            await writer
        if held is not None:
            pool.release(held)
        pool.leave()
        assert pool.open_pipes == 0
        assert 0 < peak <= bound
        # A stalled relay sleeps: far less CPU than wall time (catches busy loops).
        assert cpu < wall / 2
        assert digest(got) == digest(data)

    run(scenario)


def test_chatty_tunnel_stays_on_the_protocol_path(run: Runner) -> None:
    message = os.urandom(1024)
    count = 4 * (THRESHOLDS["hybrid"] or 0) // len(message)  # 4x the threshold in total

    async def scenario() -> None:
        async with harness("hybrid") as h:
            for _ in range(count):  # one small read at a time: never bulk
                h.client_w.write(message)
                assert await h.upstream_r.readexactly(len(message)) == message
            assert not h.tunnel.spliced
            await send(h.client_w, b"")
            await send(h.upstream_w, os.urandom(PAYLOAD))  # bulk: now it moves
            await read_to_end(h.client_r)
            assert await read_to_end(h.upstream_r) == b""
            stats = await h.stats()
        expect_spliced("hybrid", stats)
        assert stats.bytes_up == count * len(message)

    run(scenario)


@pytest.mark.skipif(not SPLICE_AVAILABLE, reason="os.splice needs Linux")
def test_hybrid_stays_on_protocol_while_no_pipe_is_free(run: Runner) -> None:
    data = os.urandom(PAYLOAD)

    async def scenario() -> None:
        pool = PipePool(max_pipes=1)
        pool.join()
        held = pool.acquire()
        assert held is not None
        async with harness("hybrid", pool=pool) as h:
            await send(h.client_w, data)
            got = await read_to_end(h.upstream_r)
            await send(h.upstream_w, b"")
            await read_to_end(h.client_r)
            stats = await h.stats()
        pool.release(held)
        pool.leave()
        assert digest(got) == digest(data)
        assert not stats.spliced and stats.bytes_up == len(data)

    run(scenario)


@pytest.mark.skipif(not SPLICE_AVAILABLE, reason="os.splice needs Linux")
def test_pipes_are_lent_only_while_busy(run: Runner) -> None:
    async def scenario() -> None:
        async with harness("splice") as h:
            h.client_w.write(os.urandom(PAYLOAD))
            await h.upstream_r.readexactly(PAYLOAD)
            for _ in range(5):
                await asyncio.sleep(0)
            assert h.pool.open_pipes - h.pool.idle_pipes == 0  # quiet: none lent
            assert h.tunnel.spliced

    run(scenario)


@pytest.mark.skipif(not SPLICE_AVAILABLE, reason="os.splice needs Linux")
def test_a_short_read_ends_a_wake_up_without_a_failing_splice(
    run: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Readiness is level-triggered: after a read that did not fill the pipe, a
    # splice that only fails with EAGAIN is a system call for nothing.
    message = os.urandom(4096)
    failed: list[int] = []
    real = os.splice

    def counting(src: int, dst: int, count: int, *args: int, **kwargs: int) -> int:
        try:
            return real(src, dst, count, *args, **kwargs)
        except BlockingIOError:
            failed.append(src)
            raise

    monkeypatch.setattr(os, "splice", counting)

    async def scenario() -> None:
        async with harness("splice") as h:
            for _ in range(20):
                h.client_w.write(message)
                assert await h.upstream_r.readexactly(len(message)) == message
                h.upstream_w.write(message)
                assert await h.client_r.readexactly(len(message)) == message
            failed_at_start = 2  # each flow's first read, before any byte came
            assert len(failed) <= failed_at_start
            assert h.pool.open_pipes - h.pool.idle_pipes == 0  # and no pipe kept lent

    run(scenario)


@pytest.mark.skipif(not SPLICE_AVAILABLE, reason="os.splice needs Linux")
def test_tunnels_share_a_one_pipe_pool(run: Runner) -> None:
    payloads = [os.urandom(PAYLOAD // 2) for _ in range(4)]

    async def scenario() -> None:
        pool = PipePool(max_pipes=1)
        async with harness("splice", pool=pool) as a, harness("splice", pool=pool) as b:
            writers = [w for h in (a, b) for w in (h.client_w, h.upstream_w)]
            readers = [r for h in (a, b) for r in (h.upstream_r, h.client_r)]
            sending = asyncio.gather(*(send(w, p) for w, p in zip(writers, payloads, strict=True)))
            received = await asyncio.gather(*(read_to_end(r) for r in readers))
            await sending
            assert pool.open_pipes <= 1
            stats = [await a.stats(), await b.stats()]
        assert [digest(r) for r in received] == [digest(p) for p in payloads]
        assert all(s.closed_by is CloseReason.EOF for s in stats)
        pool.close()
        assert pool.open_pipes == 0

    run(scenario)


@pytest.mark.skipif(not SPLICE_AVAILABLE, reason="os.splice needs Linux")
def test_exhausted_pool_falls_back_to_copying(run: Runner) -> None:
    up, down = os.urandom(PAYLOAD), os.urandom(PAYLOAD)

    async def scenario() -> None:
        pool = PipePool(max_pipes=1)
        pool.join()
        held = pool.acquire()  # the only pipe: every flow must copy
        assert held is not None and pool.acquire() is None
        async with harness("splice", pool=pool) as h:
            sending = asyncio.gather(send(h.client_w, up), send(h.upstream_w, down))
            got_up, got_down = await asyncio.gather(
                read_to_end(h.upstream_r), read_to_end(h.client_r)
            )
            await sending
            stats = await h.stats()
        assert digest(got_up) == digest(up) and digest(got_down) == digest(down)
        assert (stats.bytes_up, stats.bytes_down) == (len(up), len(down))
        assert stats.closed_by is CloseReason.EOF
        pool.release(held)
        pool.leave()
        assert pool.open_pipes == 0

    run(scenario)


def test_pool_lends_at_most_max_pipes_and_closes_idle_ones() -> None:
    before = fd_count()
    pool = PipePool(max_pipes=2)
    pool.join()
    first, second = pool.acquire(), pool.acquire()
    assert first is not None and second is not None
    assert pool.acquire() is None and not pool.can_lend()
    pool.release(first)
    assert pool.can_lend() and pool.acquire() is first  # reused, not a new pipe
    pool.release(first)
    pool.release(second)
    assert (pool.open_pipes, pool.idle_pipes) == (2, 2)
    pool.leave()  # the last splicing tunnel is gone: idle pipes are closed
    assert pool.open_pipes == 0
    assert fd_count() == before
    with pytest.raises(ValueError):
        PipePool(max_pipes=0)


# --- Taking over a server's connection -------------------------------------------------


class HeadThenTunnel(asyncio.Protocol):
    """A toy server: reads one line, then relays the connection to `upstream`."""

    def __init__(self, upstream: socket.socket, tunnels: asyncio.Queue[Tunnel]) -> None:
        self.upstream = upstream
        self.tunnels = tunnels
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if b"\n" not in self.buffer or self.transport is None:
            return
        _, rest = self.buffer.split(b"\n", 1)
        client = take_socket(self.transport)
        self.transport = None
        asyncio.get_running_loop().create_task(self._start(client, rest))

    async def _start(self, client: socket.socket, rest: bytes) -> None:
        tunnel = await open_tunnel(
            client,
            self.upstream,
            idle_timeout=IDLE,
            initial_to_upstream=rest,
            initial_to_client=b"OK\n",
        )
        await self.tunnels.put(tunnel)


def test_take_socket_hands_a_server_connection_to_the_relay(run: Runner) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        upstream_relay, upstream_app = tcp_pair()
        tunnels: asyncio.Queue[Tunnel] = asyncio.Queue()
        server = await loop.create_server(
            lambda: HeadThenTunnel(upstream_relay, tunnels), "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]
        cr, cw = await asyncio.open_connection("127.0.0.1", port)
        ur, uw = await asyncio.open_connection(sock=upstream_app)
        cw.write(b"CONNECT example:443\nfirst bytes")
        tunnel = await tunnels.get()
        assert await cr.readexactly(3) == b"OK\n"
        assert await ur.readexactly(11) == b"first bytes"
        await send(uw, b"from upstream")
        await send(cw, b" then more")
        assert await read_to_end(cr) == b"from upstream"
        assert await read_to_end(ur) == b" then more"
        stats = await tunnel.done
        assert stats.closed_by is CloseReason.EOF
        for writer in (cw, uw):
            writer.close()
            await writer.wait_closed()
        server.close()
        await server.wait_closed()
        assert default_pipe_pool().open_pipes == 0

    run(scenario)


def test_take_socket_refuses_a_transport_with_unsent_bytes(run: Runner) -> None:
    async def scenario() -> None:
        a, b = tcp_pair()
        _, writer = await asyncio.open_connection(sock=a)
        writer.write(os.urandom(32 * 1024 * 1024))  # b never reads: most stays queued
        with pytest.raises(ValueError, match="unsent"):
            take_socket(writer.transport)  # type: ignore[arg-type]
        assert not writer.transport.is_closing()
        writer.transport.abort()
        b.close()

    run(scenario)


# --- Arguments ------------------------------------------------------------------------------


def test_bad_idle_timeout_is_refused_and_sockets_closed(run: Runner) -> None:
    async def scenario() -> None:
        a, b = tcp_pair()
        c, d = tcp_pair()
        with pytest.raises(ValueError, match="idle_timeout"):
            await open_tunnel(b, c, idle_timeout=0)
        assert b.fileno() == -1 and c.fileno() == -1
        a.close()
        d.close()

    run(scenario)


# --- An upstream transport made with the tunnel's own protocol -----------------------------


class HeadThenDial(asyncio.Protocol):
    """A toy server: reads one line, dials the upstream with the tunnel's protocol, relays."""

    def __init__(
        self, upstream_port: int, tunnels: asyncio.Queue[Tunnel], threshold: int | None
    ) -> None:
        self.upstream_port = upstream_port
        self.tunnels = tunnels
        self.threshold = threshold
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if b"\n" not in self.buffer or self.transport is None:
            return
        _, rest = self.buffer.split(b"\n", 1)
        self.transport.pause_reading()
        asyncio.get_running_loop().create_task(self._start(self.transport, rest))

    async def _start(self, client: asyncio.Transport, rest: bytes) -> None:
        loop = asyncio.get_running_loop()
        tunnel = new_tunnel(idle_timeout=IDLE, splice_threshold=self.threshold)
        upstream, _ = await loop.create_connection(
            lambda: tunnel.upstream_protocol, "127.0.0.1", self.upstream_port
        )
        await asyncio.sleep(0.05)  # the upstream's greeting arrives before the tunnel starts
        open_tunnel_with_upstream(
            tunnel,
            client,
            upstream,
            initial_to_upstream=rest,
            initial_to_client=b"OK\n",
        )
        await self.tunnels.put(tunnel)


@pytest.mark.parametrize("mode", ["protocol", "hybrid"])
def test_open_tunnel_with_upstream_relays_and_keeps_early_upstream_bytes(
    run: Runner, mode: str
) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        upstream_apps: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
        upstream_apps = asyncio.Queue()

        async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"hello;")  # server speaks first, as SSH or SMTP do
            await upstream_apps.put((reader, writer))

        origin = await asyncio.start_server(greet, "127.0.0.1", 0)
        upstream_port = origin.sockets[0].getsockname()[1]
        tunnels: asyncio.Queue[Tunnel] = asyncio.Queue()
        server = await loop.create_server(
            lambda: HeadThenDial(upstream_port, tunnels, THRESHOLDS[mode]), "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]
        cr, cw = await asyncio.open_connection("127.0.0.1", port)
        cw.write(b"CONNECT example:443\nfirst bytes")
        tunnel = await tunnels.get()
        ended: list[tuple[RelayStats, bool]] = []
        tunnel.when_done(lambda stats: ended.append((stats, tunnel.done.done())))
        with pytest.raises(RuntimeError, match="done callback already"):
            tunnel.when_done(lambda stats: None)  # a second would silently replace the first
        ur, uw = await upstream_apps.get()
        assert await cr.readexactly(9) == b"OK\nhello;"
        assert await ur.readexactly(11) == b"first bytes"
        payload = os.urandom(PAYLOAD)
        await asyncio.gather(send(uw, payload), send(cw, b" then more"))
        assert digest(await read_to_end(cr)) == digest(payload)
        assert await read_to_end(ur) == b" then more"
        stats = await tunnel.done
        assert stats.closed_by is CloseReason.EOF
        assert stats.bytes_down == 3 + 6 + PAYLOAD
        assert stats.bytes_up == 11 + 10
        expect_spliced(mode, stats)
        # Called once, in the step the tunnel completed (its Future already resolved).
        assert ended == [(stats, True)]
        late: list[RelayStats] = []
        tunnel.when_done(late.append)  # after the end: at once
        assert late == [stats]
        for writer in (cw, uw):
            writer.close()
            await writer.wait_closed()
        for listener in (server, origin):
            listener.close()
            await listener.wait_closed()
        assert default_pipe_pool().open_pipes == 0

    run(scenario)


def test_open_tunnel_with_upstream_refuses_a_closing_client(run: Runner) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        a, b = tcp_pair()
        c, d = tcp_pair()
        client, _ = await loop.connect_accepted_socket(asyncio.Protocol, a)
        tunnel = new_tunnel(idle_timeout=IDLE)
        upstream, _ = await loop.connect_accepted_socket(lambda: tunnel.upstream_protocol, c)
        client.close()
        with pytest.raises(ValueError, match="closing"):
            open_tunnel_with_upstream(tunnel, client, upstream)
        assert upstream.is_closing()  # the tunnel owned it: aborted
        await asyncio.sleep(0)
        b.close()
        d.close()
        with pytest.raises(ValueError, match="idle_timeout"):
            new_tunnel(idle_timeout=0)

    run(scenario)
