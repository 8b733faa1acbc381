"""Two-way byte pump between a client socket and an upstream socket; knows no policy.

`open_tunnel(client, upstream, idle_timeout=...)` takes two connected sockets
(a server built on asyncio transports gets its client's with `take_socket`;
the upstream comes from `dial`) and returns a running `Tunnel` without a Task;
`relay()` is the same awaited to the end. Both sockets are closed exactly once
on every exit: EOF both ways (half-close is passed on with shutdown(SHUT_WR)),
idle timeout (one lazily re-armed timer), a reset or error on either side,
`Tunnel.abort()` or cancellation.

Design (DESIGN §8), as measured by benchmarks/relay.py here (2 cores, source,
relay and sink as three processes, 1 GiB x 3 runs, ranges over five runs):

    relay             relay CPU s/GB  relay CPU us per 1 KiB round trip  KiB per idle tunnel
    Protocol pair     0.28-0.33       20-49                              3.9
    Protocol, uvloop  0.25-0.33       19-31                              3.5 (5.4 in a Task)
    splice            0.17-0.25       30-39                              2.3
    splice, uvloop    0.14-0.26       24-37                              2.7
    hybrid            0.17-0.24       = Protocol pair (never switches)   3.9
    hybrid, uvloop    0.17-0.25       = Protocol, uvloop                 3.5

Throughput (MB/s) does not separate them here: the same relay moves 1.3 to
2.9 GB/s from run to run against 3.3-5.5 GB/s direct, because three processes
share two cores, so relay CPU decides. A tunnel therefore starts on a pair of
Protocols (cheapest per small message on uvloop, whose transports are C: one
recv and one send, where splice needs splice in, splice out and a failing
splice plus Python callbacks) and moves to os.splice once it has moved
SPLICE_THRESHOLD bytes in large reads (a third less CPU per GB). Pure splice
would save ~1 KiB per idle tunnel (4 MiB at 4096 connections), not worth the
dearer small messages. A switch costs 31-51 us of CPU (break-even 300-600 KiB).
Splice borrows pipes (F_SETPIPE_SZ 1 MiB) from a bounded PipePool only while
a direction has bytes to move; with none free it copies one chunk at a time.
Where splice is unavailable (not Linux), tunnels stay on the Protocol path.

One bulk tunnel in splice mode (benchmarks/proxy.py's one-tunnel test, 1 GiB
in 4 MiB writes; system calls counted with `perf stat -e syscalls:*` and
`perf record` of the splice tracepoints on the proxy process): 2.5 splices
per MiB, nearly every read a full 1 MiB pipe; 0.3 loop wake-ups and 0.4-0.7
epoll_ctl per MiB (a flow blocked on its destination swaps its reader for a
writer and back); 0.2 splices per MiB fail with EAGAIN, nearly all on the
destination (the sink reads slower than the relay sends). The proxy's 0.2-0.3
CPU s/GiB (0.41 on a quiet machine) is ~90% kernel: splice into the upstream
socket runs TCP transmit and the loopback receive of the sink's socket (62%
of `perf record` samples; BBR's pacing timer, tcp_pace_kick, 14%), splice from
the client 16%; Python is 0.02 s/GiB. A flow stops after a read that did not
fill the pipe instead of making a splice that can only fail (16 -> 2 failing
reads per GiB in bulk, no measurable change in its MB/s or CPU; splice mode's
1 KiB round trip 60-65 -> 41-52 us of relay CPU, 7,100-7,500 -> 7,800-10,000
round trips/s, benchmarks/relay.py's ping-pong, interleaved). Measured
and not kept: SO_SNDBUF 8 MiB on the upstream (failing splices 0.24 -> 0.06-0.13
per MiB, but 0.5-1.0 wake-ups per MiB instead of 0.3-0.4 and no less CPU),
SO_RCVLOWAT 256 KiB (stalls: bytes short of the mark are never reported),
longer splices (the kernel caps one splice at the pipe's free slots, 1 MiB),
SPLICE_F_MORE (no measurable change; splice already marks all but a call's
last chunk MSG_MORE).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, cast

from egressbox.net.deadlines import Deadline, wheel

__all__ = [
    "BULK_READ",
    "SPLICE_AVAILABLE",
    "SPLICE_THRESHOLD",
    "CloseReason",
    "PipePool",
    "RelayStats",
    "Tunnel",
    "default_pipe_pool",
    "new_tunnel",
    "open_tunnel",
    "open_tunnel_with_upstream",
    "relay",
    "take_socket",
]

# --- Tuning constants (where each value came from) ---------------------------

# Bytes moved in bulk reads (below) before a tunnel leaves the Protocol pair
# for splice. benchmarks/relay.py: a switch costs 31-51 us of CPU and splice
# saves ~0.1 ms per MiB, so it pays for itself after 300-600 KiB; at 1 MiB a
# tunnel that ends right after switching loses at most ~15%.
SPLICE_THRESHOLD: Final = 1 << 20
# Only reads at least this large count towards SPLICE_THRESHOLD: splice costs
# more than the Protocol path per small message (benchmarks/relay.py: 26-35 vs
# 19-21 us of relay CPU per 1 KiB round trip), so chatty tunnels stay put.
# Twice the largest TLS record (16 KiB, RFC 8446 §5.1), and below one loopback
# segment (65,483 bytes), so a fast bulk flow always qualifies.
BULK_READ: Final = 32 * 1024
# Pipe capacity asked of F_SETPIPE_SZ: 1 MiB is Linux's default
# fs.pipe-max-size, the most an unprivileged process may ask for.
PIPE_SIZE = 1 << 20
# Pipes one pool may hold open (each is two fds). 64 x 1 MiB = 64 MiB, which is
# Linux's default fs.pipe-user-pages-soft (16384 pages): the most an
# unprivileged user gets at full size. 128 fds next to 2 x MAX_CONNECTIONS.
MAX_PIPES = 64
# Fill/drain rounds per readiness callback in splice mode. 1, 4 and 16
# measured alike (0.17-0.22 CPU s/GB, benchmarks/relay.py); 4 caps one
# callback at 4 MiB (~2 ms) before other tunnels get a turn. Readiness is
# level-triggered, so unfinished work is picked up on the next loop turn, and a
# round that read less than a pipe ends the callback (see _Splicer.pump).
SPLICE_ROUNDS: Final = 4
# Transport write buffer flow control: pause reading the other side above
# HIGH, resume below LOW. 64 KiB, 256 KiB and 1 MiB measured alike (0.25-0.37
# CPU s/GB on both loops, benchmarks/relay.py), so asyncio's defaults stay:
# the smallest bound on what a slow reader makes the relay hold.
WRITE_HIGH_WATER: Final = 64 * 1024
WRITE_LOW_WATER: Final = WRITE_HIGH_WATER // 4
# The largest single read either loop makes (asyncio's max_size; uvloop reads
# 256,000 bytes): the Protocol path holds at most WRITE_HIGH_WATER + MAX_READ
# bytes per direction, the copy fallback MAX_READ.
MAX_READ: Final = 256 * 1024

# A new pipe's capacity on Linux (pipe(7): 16 pages).
_LINUX_DEFAULT_PIPE_SIZE = 65536
_SPLICE_FLAGS: Final = getattr(os, "SPLICE_F_NONBLOCK", 0) | getattr(os, "SPLICE_F_MOVE", 0)
_F_SETPIPE_SZ: int | None = getattr(fcntl, "F_SETPIPE_SZ", None)
_F_GETPIPE_SZ: int | None = getattr(fcntl, "F_GETPIPE_SZ", None)
SPLICE_AVAILABLE: Final = (
    sys.platform == "linux" and hasattr(os, "splice") and _F_SETPIPE_SZ is not None
)

# How long a cancelled relay() waits for its sockets to close before it
# re-raises: aborting takes one loop turn, so this only bounds a bug.
_ABORT_GRACE = 1.0


class CloseReason(StrEnum):
    """Why a tunnel ended (stable snake_case, for logs)."""

    EOF = "eof"  # both sides finished sending
    IDLE_TIMEOUT = "idle_timeout"  # no byte either way for idle_timeout
    CLIENT_RESET = "client_reset"  # ECONNRESET / EPIPE / ECONNABORTED on the client
    UPSTREAM_RESET = "upstream_reset"
    CLIENT_ERROR = "client_error"  # any other OSError on the client
    UPSTREAM_ERROR = "upstream_error"
    ABORTED = "aborted"  # Tunnel.abort() or cancellation (server drain)


# Enum members bound once (docs/development.md, "The compiled core's speed rules").
_CLOSE_REASON_ABORTED: Final = CloseReason.ABORTED
_CLOSE_REASON_CLIENT_ERROR: Final = CloseReason.CLIENT_ERROR
_CLOSE_REASON_CLIENT_RESET: Final = CloseReason.CLIENT_RESET
_CLOSE_REASON_EOF: Final = CloseReason.EOF
_CLOSE_REASON_IDLE_TIMEOUT: Final = CloseReason.IDLE_TIMEOUT
_CLOSE_REASON_UPSTREAM_ERROR: Final = CloseReason.UPSTREAM_ERROR
_CLOSE_REASON_UPSTREAM_RESET: Final = CloseReason.UPSTREAM_RESET


@dataclass(frozen=True, slots=True, init=False)
class RelayStats:
    """What a finished tunnel moved; bytes include the initial bytes."""

    bytes_up: int  # towards upstream
    bytes_down: int  # towards the client
    duration: float  # seconds, loop clock
    closed_by: CloseReason
    spliced: bool  # whether the tunnel moved to splice

    def __init__(
        self,
        bytes_up: int,
        bytes_down: int,
        duration: float,
        closed_by: CloseReason,
        spliced: bool,
    ) -> None:
        # The generated __init__ of a frozen dataclass is interpreted (one object.__setattr__
        # call per field: ~6,500 instructions a tunnel); compiled, these are direct stores.
        object.__setattr__(self, "bytes_up", bytes_up)
        object.__setattr__(self, "bytes_down", bytes_down)
        object.__setattr__(self, "duration", duration)
        object.__setattr__(self, "closed_by", closed_by)
        object.__setattr__(self, "spliced", spliced)


def _reason(client: bool, exc: BaseException) -> CloseReason:
    if isinstance(exc, ConnectionError):
        return _CLOSE_REASON_CLIENT_RESET if client else _CLOSE_REASON_UPSTREAM_RESET
    return _CLOSE_REASON_CLIENT_ERROR if client else _CLOSE_REASON_UPSTREAM_ERROR


# --- Pipes --------------------------------------------------------------------


class _Pipe:
    __slots__ = ("r", "size", "w")

    def __init__(self, size: int) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.size = _LINUX_DEFAULT_PIPE_SIZE
        try:
            if _F_SETPIPE_SZ is not None:
                self.size = fcntl.fcntl(self.w, _F_SETPIPE_SZ, size)
        except OSError:  # EPERM past fs.pipe-user-pages-soft: keep the size it has
            with contextlib.suppress(OSError):
                self.size = fcntl.fcntl(self.w, _F_GETPIPE_SZ) if _F_GETPIPE_SZ else self.size

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class PipePool:
    """A bounded pool of pipes, lent to tunnels only while they are moving bytes.

    Idle pipes are kept only while some tunnel is in splice mode; when the last
    one ends they are closed, so a quiet proxy holds no pipe. A flow that finds
    the pool exhausted copies through user space (recv/send, one chunk at a
    time) instead of waiting. Not thread-safe: one pool per event loop thread.
    """

    def __init__(self, max_pipes: int = MAX_PIPES, pipe_size: int = PIPE_SIZE) -> None:
        if max_pipes < 1:
            raise ValueError("max_pipes must be >= 1")
        self._max = max_pipes
        self._size = pipe_size
        self._idle: list[_Pipe] = []
        self._open = 0
        self._users = 0
        self._closed = False

    @property
    def open_pipes(self) -> int:
        """Pipes open now, idle or lent."""
        return self._open

    @property
    def idle_pipes(self) -> int:
        """Pipes open and not lent."""
        return len(self._idle)

    def can_lend(self) -> bool:
        return not self._closed and (bool(self._idle) or self._open < self._max)

    def acquire(self) -> _Pipe | None:
        if self._idle:
            return self._idle.pop()
        if self._closed or self._open >= self._max:
            return None
        pipe = _Pipe(self._size)
        self._open += 1
        return pipe

    def release(self, pipe: _Pipe) -> None:
        """Give back an empty pipe."""
        if self._closed or self._users == 0:
            self.discard(pipe)
            return
        self._idle.append(pipe)

    def discard(self, pipe: _Pipe) -> None:
        """Close a pipe (one that may still hold bytes)."""
        pipe.close()
        self._open -= 1

    def join(self) -> None:
        self._users += 1

    def leave(self) -> None:
        self._users -= 1
        if self._users == 0:
            self._close_idle()

    def close(self) -> None:
        """Close the idle pipes now; pipes still lent are closed when given back."""
        self._closed = True
        self._close_idle()

    def _close_idle(self) -> None:
        while self._idle:
            self.discard(self._idle.pop())


_default_pool: PipePool | None = None


def default_pipe_pool() -> PipePool:
    """The process-wide pool used when open_tunnel() gets none."""
    global _default_pool  # noqa: PLW0603 (one lazily created pool per process)
    if _default_pool is None:
        _default_pool = PipePool()
    return _default_pool


# --- Protocol phase -----------------------------------------------------------


class _Side(asyncio.Protocol):
    """One socket of a tunnel: forwards what it reads to its peer's transport.

    Its tunnel holds it, and it holds its tunnel and its transport (whose protocol it is):
    cycles, which `release()` breaks when the tunnel is complete, so that a finished
    tunnel is freed by reference counts and never left to the cycle collector (whose
    passes cost ~8,000 instructions a short tunnel, under callgrind). So the peer is not
    an attribute (a third cycle): `Tunnel._peer` finds it.
    """

    __slots__ = (
        "blocked",
        "client",
        "detached",
        "eof",
        "lost",
        "stash",
        "transport",
        "tunnel",
    )

    def __init__(self, tunnel: Tunnel, client: bool) -> None:
        self.tunnel: Tunnel | None = tunnel  # None once released
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.stash: list[bytes] | None = None  # bytes read before the tunnel started
        self.eof = False  # this side sent EOF
        self.lost = False  # this side's transport is gone
        self.blocked = False  # this side's write buffer is over the high-water mark
        self.detached = False  # handed over to splice

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(WRITE_HIGH_WATER, WRITE_LOW_WATER)
        self.transport.pause_reading()  # asyncio honours this; uvloop starts reading anyway

    def adopt(self, transport: asyncio.Transport) -> None:
        """connection_made for a transport handed over paused (the client's): it stays
        paused until the tunnel starts, with no pause_reading call to say so again."""
        self.transport = transport
        transport.set_write_buffer_limits(WRITE_HIGH_WATER, WRITE_LOW_WATER)

    def data_received(self, data: bytes) -> None:
        tunnel = self.tunnel
        if tunnel is not None:
            tunnel._forward(self, data)

    def eof_received(self) -> bool:
        tunnel = self.tunnel
        if tunnel is not None:
            tunnel._side_eof(self)
        return True  # the tunnel decides when to close

    def pause_writing(self) -> None:
        self.blocked = True
        tunnel = self.tunnel
        if tunnel is not None:
            tunnel._peer(self).pause()

    def resume_writing(self) -> None:
        self.blocked = False
        tunnel = self.tunnel
        if tunnel is not None and tunnel._running:
            tunnel._peer(self).resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        tunnel = self.tunnel
        if tunnel is not None and not self.detached:
            tunnel._side_lost(self, exc)

    def pause(self) -> None:
        if self.transport is not None and not (self.eof or self.lost or self.detached):
            self.transport.pause_reading()

    def resume(self) -> None:
        tunnel = self.tunnel
        if tunnel is None or tunnel._peer(self).blocked or self.transport is None:
            return
        if not (self.eof or self.lost or self.detached):
            self.transport.resume_reading()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.lost:
            self.transport.write(data)

    def write_eof(self) -> None:
        if self.transport is None or self.lost:
            return
        try:
            self.transport.write_eof()
        except (OSError, RuntimeError) as exc:  # peer already reset
            tunnel = self.tunnel
            if tunnel is not None:
                tunnel._finish(_reason(self.client, exc), force=True)

    def buffered(self) -> int:
        if self.transport is None or self.lost:
            return 0
        return self.transport.get_write_buffer_size()

    def release(self) -> None:
        """The tunnel is complete: drop the references that close cycles (its transport
        is gone, or detached and closing)."""
        self.tunnel = None
        self.transport = None


# --- Splice phase ---------------------------------------------------------------


class _Flow:
    """One direction in splice mode: src socket -> pipe -> dst socket."""

    __slots__ = (
        "done",
        "dst",
        "eof",
        "full",
        "head",
        "pipe",
        "queued",
        "reading",
        "src",
        "up",
        "writing",
    )

    def __init__(self, src: socket.socket, dst: socket.socket, up: bool, head: bytes) -> None:
        self.src = src
        self.dst = dst
        self.up = up  # client -> upstream
        self.head = head  # bytes to send before the pipe's (initial or copied bytes)
        self.pipe: _Pipe | None = None
        self.queued = 0  # bytes in the pipe
        self.eof = False  # src sent EOF
        self.full = False  # the last read took all it could: src may hold more
        self.done = False  # EOF passed on to dst
        self.reading = False  # reader registered on src
        self.writing = False  # writer registered on dst


class _SideError(Exception):
    def __init__(self, client: bool, exc: OSError) -> None:
        super().__init__(str(exc))
        self.reason = _reason(client, exc)


class _Splicer:
    """Moves bytes with os.splice through borrowed pipes, driven by add_reader/add_writer."""

    __slots__ = ("client", "closed", "flows", "loop", "pool", "tunnel", "upstream")

    def __init__(
        self, tunnel: Tunnel, client: socket.socket, upstream: socket.socket, pool: PipePool
    ) -> None:
        self.tunnel = tunnel
        self.loop = tunnel._loop
        self.pool = pool
        self.client = client
        self.upstream = upstream
        self.closed = False
        self.flows: tuple[_Flow, _Flow] = (
            _Flow(client, upstream, True, b""),
            _Flow(upstream, client, False, b""),
        )
        pool.join()

    def start(self, heads: tuple[bytes, bytes], done: tuple[bool, bool]) -> None:
        for flow, head, finished in zip(self.flows, heads, done, strict=True):
            flow.head = head
            if finished:
                flow.eof = True
        for flow in self.flows:
            self.pump(flow)

    def buffered(self) -> int:
        return sum(f.queued + len(f.head) for f in self.flows)

    def pump(self, flow: _Flow) -> None:
        if self.closed or flow.done:
            return
        try:
            if not self._drain(flow):
                return
            for _ in range(SPLICE_ROUNDS):
                if not self._fill(flow) or not self._drain(flow):
                    return
                if not flow.full:
                    # A short read emptied src: stop without the splice that would only
                    # fail with EAGAIN; the pipe goes back (it is empty) and readiness,
                    # level-triggered, calls again if more came in meanwhile.
                    self._give_back(flow)
                    break
            self._watch(flow, read=True, write=False)  # more next turn (level-triggered)
        except _SideError as err:
            self.tunnel._finish(err.reason, force=True)

    def _drain(self, flow: _Flow) -> bool:
        """Empty the head and the pipe into dst; False when blocked or finished."""
        if (flow.head and not self._send_head(flow)) or not self._splice_out(flow):
            self._watch(flow, read=False, write=True)
            return False
        if flow.eof:
            self._end(flow)
            return False
        return True

    def _send_head(self, flow: _Flow) -> bool:
        try:
            sent = flow.dst.send(flow.head)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise _SideError(not flow.up, exc) from exc
        flow.head = flow.head[sent:]
        return not flow.head

    def _splice_out(self, flow: _Flow) -> bool:
        while flow.queued:
            assert flow.pipe is not None
            try:
                moved = os.splice(flow.pipe.r, flow.dst.fileno(), flow.queued, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                return False
            except OSError as exc:
                raise _SideError(not flow.up, exc) from exc
            if moved <= 0:  # cannot happen with bytes in the pipe; never spin on it
                raise _SideError(not flow.up, OSError("splice moved nothing"))
            flow.queued -= moved
            self.tunnel._count(flow.up, moved)
        return True

    def _fill(self, flow: _Flow) -> bool:
        """Read src into the pipe (or, with no pipe free, into head); False when src is dry."""
        pipe = flow.pipe or self._borrow(flow)
        if pipe is None:
            return self._copy_in(flow)
        try:
            got = os.splice(flow.src.fileno(), pipe.w, pipe.size, flags=_SPLICE_FLAGS)
        except BlockingIOError:
            self._give_back(flow)  # pipes only while busy
            self._watch(flow, read=True, write=False)
            return False
        except OSError as exc:
            raise _SideError(flow.up, exc) from exc
        if got == 0:
            flow.eof = True
        flow.queued = got
        # An empty pipe takes at most its size in one splice (the kernel caps the
        # length at its free slots), so less means src was emptied, or that small
        # segments used up the slots first: then readiness calls again at once.
        flow.full = got >= pipe.size
        return True

    def _copy_in(self, flow: _Flow) -> bool:
        try:
            data = flow.src.recv(MAX_READ)
        except BlockingIOError:
            self._watch(flow, read=True, write=False)
            return False
        except OSError as exc:
            raise _SideError(flow.up, exc) from exc
        flow.eof = not data
        flow.full = len(data) >= MAX_READ
        flow.head = data
        self.tunnel._count(flow.up, len(data))
        return True

    def _borrow(self, flow: _Flow) -> _Pipe | None:
        flow.pipe = self.pool.acquire()
        return flow.pipe

    def _give_back(self, flow: _Flow) -> None:
        if flow.pipe is not None:
            pipe, flow.pipe = flow.pipe, None
            self.pool.release(pipe)

    def _end(self, flow: _Flow) -> None:
        """src sent EOF and everything before it went out: pass the EOF on."""
        flow.done = True
        self._give_back(flow)
        self._watch(flow, read=False, write=False)
        with contextlib.suppress(OSError):  # dst already gone: the other flow will see it
            flow.dst.shutdown(socket.SHUT_WR)
        if all(f.done for f in self.flows):
            self.tunnel._finish(_CLOSE_REASON_EOF)

    def _watch(self, flow: _Flow, *, read: bool, write: bool) -> None:
        if read != flow.reading:
            if read:
                self.loop.add_reader(flow.src.fileno(), self.pump, flow)
            else:
                self.loop.remove_reader(flow.src.fileno())
            flow.reading = read
        if write != flow.writing:
            if write:
                self.loop.add_writer(flow.dst.fileno(), self.pump, flow)
            else:
                self.loop.remove_writer(flow.dst.fileno())
            flow.writing = write

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for flow in self.flows:
            self._watch(flow, read=False, write=False)
            if flow.pipe is not None:
                pipe, flow.pipe = flow.pipe, None
                (self.pool.discard if flow.queued else self.pool.release)(pipe)
        self.client.close()
        self.upstream.close()
        self.pool.leave()


# --- The tunnel -------------------------------------------------------------------


class Tunnel:
    """A running relay between a client and an upstream socket (see open_tunnel)."""

    __slots__ = (
        "_bulk",
        "_done",
        "_early",
        "_idle",
        "_last",
        "_loop",
        "_next_splice",
        "_on_end",
        "_opened",
        "_pool",
        "_reason",
        "_running",
        "_sides",
        "_splicer",
        "_started",
        "_stats",
        "_timer",
        "bytes_down",
        "bytes_up",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        idle_timeout: float,
        splice_threshold: int | None,
        pool: PipePool,
    ) -> None:
        self._loop = loop
        self._idle = idle_timeout
        self._pool = pool
        self._bulk = 0  # bytes moved in reads of at least BULK_READ
        # _bulk at which to try splice; sys.maxsize = never.
        self._next_splice = sys.maxsize
        if splice_threshold is not None and SPLICE_AVAILABLE:
            self._next_splice = splice_threshold
        self.bytes_up = 0
        self.bytes_down = 0
        self._started = self._last = loop.time()
        self._timer: Deadline | None = None
        self._reason: CloseReason | None = None
        self._running = False  # initial bytes sent, forwarding
        self._opened = False  # both transports exist (or never will)
        # The stats once complete; `done` (a Future) is made only when asked for, and the
        # proxy's own bookkeeping is one direct callback (when_done): a Future's callback
        # is a scheduled handle (~3,000 instructions a tunnel, under callgrind).
        self._stats: RelayStats | None = None
        self._done: asyncio.Future[RelayStats] | None = None
        self._on_end: Callable[[RelayStats], None] | None = None
        self._sides = (_Side(self, True), _Side(self, False))
        self._splicer: _Splicer | None = None
        self._early: Callable[[], None] | None = None

    # Public view ----------------------------------------------------------------

    @property
    def done(self) -> asyncio.Future[RelayStats]:
        """Resolves with the stats once both sockets are closed (never raises)."""
        if self._done is None:
            self._done = self._loop.create_future()
            if self._stats is not None:
                self._done.set_result(self._stats)
        return self._done

    def when_done(self, callback: Callable[[RelayStats], None]) -> None:
        """Call `callback(stats)` once, when both sockets are closed: in the same step,
        not at a later turn of the loop as a Future's callback (at once if it is done).
        One callback a tunnel (its owner's); anyone else awaits `done`."""
        if self._stats is not None:
            callback(self._stats)
        elif self._on_end is not None:
            raise RuntimeError("the tunnel has a done callback already: await tunnel.done")
        else:
            self._on_end = callback

    @property
    def spliced(self) -> bool:
        return self._splicer is not None

    @property
    def buffered(self) -> int:
        """Bytes the relay holds right now (transport write buffers or pipes)."""
        if self._splicer is not None:
            return self._splicer.buffered()
        return sum(side.buffered() for side in self._sides)

    def abort(self) -> None:
        """Close both sides now, dropping anything unsent (server drain)."""
        self._finish(_CLOSE_REASON_ABORTED, force=True)

    def on_upstream_first(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` once if the upstream sends, ends or fails before the tunnel
        starts (a tunnel held back for its client's first bytes: the server spoke first),
        at once if it already has. The bytes are held as always; None forgets it."""
        self._early = callback
        u = self._sides[1]
        if callback is not None and not self._running and (u.stash or u.eof or u.lost):
            self._upstream_first()

    def _peer(self, side: _Side) -> _Side:
        c, u = self._sides
        return u if side is c else c

    def _upstream_first(self) -> None:
        callback, self._early = self._early, None
        if callback is not None:
            callback()

    @property
    def upstream_protocol(self) -> asyncio.Protocol:
        """The protocol to make the upstream transport with (see new_tunnel)."""
        return self._sides[1]

    # Start ----------------------------------------------------------------------

    async def _open_protocols(self, client: socket.socket, upstream: socket.socket) -> None:
        c = self._sides[0]
        try:
            await self._loop.connect_accepted_socket(lambda: c, client)
        except BaseException:
            client.close()
            upstream.close()
            raise
        await self._open_upstream(upstream)

    async def _open_upstream(self, upstream: socket.socket) -> None:
        u = self._sides[1]
        try:
            await self._loop.connect_accepted_socket(lambda: u, upstream)
        except BaseException:
            upstream.close()
            u.lost = True  # it never had a transport
            self._opened = True
            self._finish(_CLOSE_REASON_ABORTED, force=True)
            self._maybe_complete()
            raise
        self._opened = True

    def _begin(self, to_upstream: bytes, to_client: bytes) -> None:
        c, u = self._sides
        if to_client:  # a transport call saved when there is nothing (~700 instructions)
            c.write(to_client)
        if to_upstream:
            u.write(to_upstream)
        self._running = True
        for side in self._sides:
            peer = u if side is c else c
            for chunk in side.stash or ():
                peer.write(chunk)
                self._count(side.client, len(chunk))
            side.stash = None
            if side.eof:
                peer.write_eof()
        if self._reason is not None or c.lost or u.lost:
            self._finish(self._reason or _CLOSE_REASON_ABORTED, force=True)
            self._maybe_complete()
            return
        if c.eof and u.eof:
            self._finish(_CLOSE_REASON_EOF)
            return
        for side in self._sides:
            side.resume()
        self._arm()

    def _begin_splice(
        self, client: socket.socket, upstream: socket.socket, heads: tuple[bytes, bytes]
    ) -> None:
        self._running = True
        self._splicer = _Splicer(self, client, upstream, self._pool)
        try:
            self._splicer.start(heads, (False, False))
        except BaseException:
            self._finish(_CLOSE_REASON_ABORTED, force=True)
            raise
        if self._stats is None:
            self._arm()

    # Protocol phase -------------------------------------------------------------

    def _forward(self, side: _Side, data: bytes) -> None:
        if not self._running:  # uvloop reads before the tunnel has started
            side.stash = [*(side.stash or ()), data]
            side.pause()
            if not side.client:
                self._upstream_first()
            return
        if self._reason is not None:
            return  # closing: nothing more goes out
        self._peer(side).write(data)
        size = len(data)
        self._count(side.client, size)
        if size >= BULK_READ or size >= self._next_splice:
            self._bulk += size
            if self._bulk >= self._next_splice:
                self._try_splice()

    def _side_eof(self, side: _Side) -> None:
        side.eof = True
        if not self._running and not side.client:
            self._upstream_first()
        if not self._running or self._reason is not None:
            return
        peer = self._peer(side)
        if peer.eof:
            # Both directions are done: closing (after the flush) sends the FIN that a
            # write_eof would have, one shutdown(2) fewer per tunnel.
            self._finish(_CLOSE_REASON_EOF)
            return
        peer.write_eof()

    def _side_lost(self, side: _Side, exc: Exception | None) -> None:
        if exc is not None:
            self._finish(_reason(side.client, exc), force=True)
        elif self._reason is None and self._running:  # closed under us: end the other side too
            self._finish(_CLOSE_REASON_EOF, force=True)
        self._maybe_complete()
        if not self._running and not side.client:
            self._upstream_first()

    def _maybe_complete(self) -> None:
        if self._opened and all(s.lost for s in self._sides):
            self._complete()

    def _try_splice(self) -> None:
        c, u = self._sides
        if self._reason is not None or c.buffered() or u.buffered():
            return  # only with empty write buffers: nothing may be left behind
        if not self._pool.can_lend():  # retry later; the Protocol path needs no pipe
            self._next_splice = self._bulk + SPLICE_THRESHOLD
            return
        socks = self._detach()
        if socks is None:
            self._next_splice = sys.maxsize
            return
        self._splicer = _Splicer(self, socks[0], socks[1], self._pool)
        self._splicer.start((b"", b""), (c.eof, u.eof))

    def _detach(self) -> tuple[socket.socket, socket.socket] | None:
        """Duplicate both sockets and drop their transports (abort sends nothing)."""
        dups: list[socket.socket] = []
        try:
            for side in self._sides:
                assert side.transport is not None
                raw = side.transport.get_extra_info("socket")
                dups.append(socket.socket(fileno=os.dup(raw.fileno())))
            self._loop.add_reader(dups[0].fileno(), _noop)  # some loops cannot watch fds
            self._loop.remove_reader(dups[0].fileno())
        except (OSError, NotImplementedError, RuntimeError):
            for dup in dups:
                dup.close()
            return None
        for side, dup in zip(self._sides, dups, strict=True):
            dup.setblocking(False)
            side.detached = True
            assert side.transport is not None
            side.transport.abort()
        return dups[0], dups[1]

    # Both phases ----------------------------------------------------------------

    def _count(self, up: bool, n: int) -> None:
        if up:
            self.bytes_up += n
        else:
            self.bytes_down += n
        self._last = self._loop.time()

    def _arm(self) -> None:
        self._timer = wheel(self._loop).call_at(self._last + self._idle, self._on_timer)

    def _on_timer(self) -> None:
        # Re-armed lazily: bytes only stamp _last, the timer checks it when due.
        if self._loop.time() < self._last + self._idle:
            self._arm()
        else:
            self._timer = None
            self._finish(_CLOSE_REASON_IDLE_TIMEOUT, force=True)

    def _finish(self, reason: CloseReason, *, force: bool = False) -> None:
        """Close both sides: gracefully (flush) for EOF, at once when forced."""
        if self._stats is not None:
            return
        if self._reason is None or force:
            self._reason = reason
        if self._splicer is not None:
            self._splicer.close()
            self._complete()
            return
        for side in self._sides:
            if side.transport is not None and not side.lost:
                side.transport.abort() if force else side.transport.close()

    def _complete(self) -> None:
        if self._stats is not None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        stats = RelayStats(
            bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
            duration=self._loop.time() - self._started,
            closed_by=self._reason or _CLOSE_REASON_ABORTED,
            spliced=self._splicer is not None,
        )
        self._stats = stats
        for side in self._sides:
            side.release()
        if self._done is not None and not self._done.done():
            self._done.set_result(stats)
        callback, self._on_end = self._on_end, None
        if callback is not None:
            try:
                callback(stats)
            except Exception as exc:  # as the loop treats a failing callback: report, go on
                self._loop.call_exception_handler(
                    {"message": "exception in a tunnel's done callback", "exception": exc}
                )


def _noop() -> None:
    pass


# --- Entry points -------------------------------------------------------------------


def take_socket(transport: asyncio.Transport) -> socket.socket:
    """Take the connected socket out from under an asyncio transport.

    For servers built on `create_server`/`start_server`: the fd is duplicated
    and the transport aborted (which sends nothing: the duplicate keeps the
    connection open). The transport's protocol then sees connection_lost(None).
    Bytes the server already read past the request head must be passed to
    `open_tunnel(initial_to_upstream=...)`, and the reply (say "200 Connection
    established") as `initial_to_client`: the transport must hold no unsent
    bytes, or ValueError is raised and nothing is changed.
    """
    raw = transport.get_extra_info("socket")
    if raw is None:
        raise ValueError("transport has no socket")
    if transport.get_write_buffer_size():
        raise ValueError("transport holds unsent bytes; pass them as initial_to_client")
    taken = socket.socket(fileno=os.dup(raw.fileno()))
    transport.abort()
    taken.setblocking(False)
    return taken


async def open_tunnel(
    client: socket.socket,
    upstream: socket.socket,
    *,
    idle_timeout: float,
    initial_to_upstream: bytes = b"",
    initial_to_client: bytes = b"",
    splice_threshold: int | None = SPLICE_THRESHOLD,
    pipes: PipePool | None = None,
) -> Tunnel:
    """Start relaying between two connected sockets; return the running Tunnel.

    The tunnel owns both sockets from here on, also when this raises, and
    closes each exactly once. No Task is created: keep the Tunnel (or its
    `done` future) and call `abort()` to drain. `initial_to_client` reaches the
    client before any upstream byte and `initial_to_upstream` the upstream
    before any client byte. `splice_threshold`: bytes moved in bulk reads
    (BULK_READ or larger, or at least the threshold itself) before moving to
    splice; 0 = from the start, None = never; ignored where splice is
    unavailable.
    """
    if not idle_timeout > 0:
        client.close()
        upstream.close()
        raise ValueError("idle_timeout must be > 0")
    tunnel = _new_tunnel(
        idle_timeout, splice_threshold, pipes, initial_to_upstream, initial_to_client
    )
    if tunnel._next_splice == 0:
        for sock in (client, upstream):
            sock.setblocking(False)
            with contextlib.suppress(OSError):  # as asyncio's transports do
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tunnel._begin_splice(client, upstream, (initial_to_upstream, initial_to_client))
    else:
        await tunnel._open_protocols(client, upstream)
        tunnel._begin(initial_to_upstream, initial_to_client)
    return tunnel


def _new_tunnel(
    idle_timeout: float,
    splice_threshold: int | None,
    pipes: PipePool | None,
    to_upstream: bytes,
    to_client: bytes,
) -> Tunnel:
    """A Tunnel on the running loop, with the initial bytes already counted."""
    pool = pipes if pipes is not None else default_pipe_pool()
    tunnel = Tunnel(asyncio.get_running_loop(), idle_timeout, splice_threshold, pool)
    tunnel._count(True, len(to_upstream))
    tunnel._count(False, len(to_client))
    return tunnel


def new_tunnel(
    *,
    idle_timeout: float,
    splice_threshold: int | None = SPLICE_THRESHOLD,
    pipes: PipePool | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
) -> Tunnel:
    """A tunnel not started yet, for an upstream the caller connects itself.

    Make the upstream transport with `tunnel.upstream_protocol` as its protocol
    (`loop.create_connection(lambda: tunnel.upstream_protocol, ...)`, or
    `dial.start_connect`), then start the tunnel with open_tunnel_with_upstream().
    Bytes the upstream sends before that are held and delivered in order. A
    tunnel whose upstream never connects is simply dropped: it holds nothing.
    `loop` (default: the running loop) saves a lookup for a caller that has it.
    """
    if not idle_timeout > 0:
        raise ValueError("idle_timeout must be > 0")
    pool = pipes if pipes is not None else default_pipe_pool()
    return Tunnel(loop or asyncio.get_running_loop(), idle_timeout, splice_threshold, pool)


def open_tunnel_with_upstream(
    tunnel: Tunnel,
    client: asyncio.Transport,
    upstream: asyncio.Transport,
    *,
    initial_to_upstream: bytes = b"",
    initial_to_client: bytes = b"",
    client_eof: bool = False,
) -> Tunnel:
    """Start a new_tunnel() between the client's transport and its connected upstream.

    Synchronous: no Task, no dup, no new event-loop registration. The client
    transport is handed over (it must be open,
    hold no unsent bytes and be paused; its protocol is replaced). Both
    transports belong to the tunnel from here on, also when this raises
    ValueError (the client is closing or busy, or `upstream` was not made with
    the tunnel's upstream protocol), in which case the upstream is aborted and
    the client left to the caller. `client_eof`: the client already sent EOF
    (after `initial_to_upstream`), which is passed on.
    """
    c, u = tunnel._sides
    if (
        client.is_closing()
        or client.get_write_buffer_size()
        or tunnel._opened
        or upstream.get_protocol() is not u
        or u.transport is not upstream  # connection_made never ran: it was closed first
    ):
        upstream.abort()
        raise ValueError("the client transport is closing or busy, or the tunnel is not new")
    # Counted from the start of the relay, not from when the dial began.
    tunnel._started = tunnel._last = tunnel._loop.time()
    tunnel.bytes_up = len(initial_to_upstream)
    tunnel.bytes_down = len(initial_to_client)
    tunnel._early = None
    client.set_protocol(c)
    c.adopt(client)
    c.eof = client_eof
    tunnel._opened = True
    tunnel._begin(initial_to_upstream, initial_to_client)
    return tunnel


async def relay(
    client: socket.socket,
    upstream: socket.socket,
    *,
    idle_timeout: float,
    initial_to_upstream: bytes = b"",
    initial_to_client: bytes = b"",
    splice_threshold: int | None = SPLICE_THRESHOLD,
    pipes: PipePool | None = None,
) -> RelayStats:
    """Relay until both sides are done, a side fails, or idle_timeout passes.

    Same arguments as open_tunnel(). Cancelling the awaiting task aborts the
    tunnel, waits (one loop turn) for both sockets to close, and re-raises.
    """
    tunnel = await open_tunnel(
        client,
        upstream,
        idle_timeout=idle_timeout,
        initial_to_upstream=initial_to_upstream,
        initial_to_client=initial_to_client,
        splice_threshold=splice_threshold,
        pipes=pipes,
    )
    try:
        return await asyncio.shield(tunnel.done)
    except asyncio.CancelledError:
        tunnel.abort()
        await asyncio.wait([tunnel.done], timeout=_ABORT_GRACE)
        raise
