"""Plain HTTP forwarding (absolute-form `http://` and `ws://` requests) on the HTTP listener.

Each request on a client connection is decided afresh (a kept-alive client
may ask for another host next), gets its own upstream connection to the
checked addresses (never pooled across client requests, so one client's
request can never be answered on another's connection), and the upstream
response is framed by the sans-IO `ResponseFramer`, so the proxy knows
exactly where it ends. Denials and 4xx replies carry `Connection: close`
and end the connection, so an unread request body is never parsed as a
request. The decision is made before anything is sent upstream, so an
`Expect: 100-continue` client never sees a 100 for a refused destination.

An upgrade request (a WebSocket: `GET ws://...` with `Upgrade: websocket`)
that the upstream answers with 101 turns the connection into a raw byte
relay to that same upstream until either side is done; it is never parsed
as HTTP again, and its one audit record is the decision made for the GET.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NamedTuple

from egressbox.decide import Decision
from egressbox.dial import DialError
from egressbox.protocols import http1
from egressbox.replies import dial_http_status, http_status

if TYPE_CHECKING:
    from egressbox.connections import HttpConnection

# Read size for both directions: the relay's figure (one asyncio read).
READ_SIZE = 256 * 1024
# After a refusal, drop what the client still sends for this long, then close.
LINGER_SECONDS = 2.0


class _DoneError(Exception):
    """The client connection ends here (a refusal was sent, or a side failed)."""


class _Sent(NamedTuple):
    """How a response went out: keep the client connection, its status, and
    after a 101 the upstream's bytes that followed it (None: no upgrade)."""

    keep_alive: bool
    status: int
    upgraded: bytes | None = None


class Client:
    """The client side as streams, with bytes already read kept in front."""

    def __init__(self, transport: asyncio.Transport, first: bytes) -> None:
        # Move the paused protocol-based transport over to streams.
        loop = asyncio.get_running_loop()
        self.reader = asyncio.StreamReader(limit=READ_SIZE)
        protocol = asyncio.StreamReaderProtocol(self.reader)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        self.writer = asyncio.StreamWriter(transport, protocol, self.reader, loop)
        self.pending = first
        transport.resume_reading()

    async def read(self) -> bytes:
        if self.pending:
            data, self.pending = self.pending, b""
            return data
        return await self.reader.read(READ_SIZE)

    def unread(self, data: bytes) -> None:
        self.pending = data + self.pending

    async def refuse(self, reply: bytes) -> None:
        """Send a final reply, half-close, and drop what the client still sends."""
        writer = self.writer
        # OSError, not only ConnectionError: write_eof() on a connection the
        # client has already reset raises ENOTCONN.
        with contextlib.suppress(OSError, RuntimeError):
            writer.write(reply)
            if writer.can_write_eof():
                writer.write_eof()
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._discard(), LINGER_SECONDS)

    async def _discard(self) -> None:
        while await self.reader.read(READ_SIZE):
            pass


async def forward(conn: HttpConnection, head: http1.RequestHead, trailing: bytes) -> None:
    """Serve plain HTTP requests on one client connection until it ends."""
    assert conn.transport is not None
    client = Client(conn.transport, trailing)
    try:
        request: http1.RequestHead | None = head
        while request is not None:
            await _one_request(conn, request, client)
            request = await _next_head(conn, client)
    except (_DoneError, ConnectionError):
        pass
    finally:
        conn.state.connections.discard(conn)
        client.writer.close()


async def _next_head(conn: HttpConnection, client: Client) -> http1.RequestHead | None:
    """Read the next request head on a kept-alive connection (None: client closed)."""
    limits = conn.state.limits
    parser = http1.RequestHeadParser(limits.max_head_bytes)
    timeout = limits.idle_timeout  # waiting for a new request may take a while...
    while True:
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for wraps every
            # read in a new Task, a cost paid per request.
            async with asyncio.timeout(timeout):
                data = await client.read()
        except TimeoutError:
            return None
        if not data:
            return None
        try:
            head = parser.feed(data)
        except http1.HttpError as exc:
            await client.refuse(http1.error_reply(exc.status, "bad_request", str(exc)))
            return None
        if head is not None:
            client.unread(parser.trailing)
            return head
        timeout = limits.head_timeout  # ...but once it starts, the head must be quick


async def _one_request(conn: HttpConnection, head: http1.RequestHead, client: Client) -> None:
    """Decide, then forward one request and its response."""
    decision = await conn.decide(head.host, head.port)
    if not decision.allowed:
        conn.log_refusal(decision)
        status = http_status(decision.reason)
        await client.refuse(http1.error_reply(status, decision.reason.value, decision.detail))
        raise _DoneError
    upstream = await _dial(conn, decision, client)
    up_reader, up_writer = await asyncio.open_connection(sock=upstream, limit=READ_SIZE)
    try:
        await _exchange(conn, head, client, (up_reader, up_writer), decision)
    finally:
        up_writer.transport.abort()


async def _dial(conn: HttpConnection, decision: Decision, client: Client) -> socket.socket:
    try:
        return await conn.dial_pinned(decision)
    except DialError as exc:
        conn.log_refusal(decision, f"upstream: {exc}")
        status = dial_http_status(exc.reason.value)
        await client.refuse(http1.error_reply(status, exc.reason.value, str(exc)))
        raise _DoneError from None


async def _exchange(
    conn: HttpConnection,
    head: http1.RequestHead,
    client: Client,
    upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    decision: Decision,
) -> None:
    up_reader, up_writer = upstream
    up_writer.write(http1.forward_head(head))
    body = http1.RequestBodyReader(head.body)
    loop = asyncio.get_running_loop()
    pump: asyncio.Future[None]
    if body.done:  # no body (most GETs): no Task to start
        pump = loop.create_future()
        pump.set_result(None)
    else:
        pump = loop.create_task(_pump_body(client, body, up_writer))
    try:
        sent = await _relay_response(conn, head, up_reader, client, (pump, body))
    finally:
        if not pump.done():
            pump.cancel()
        with contextlib.suppress(BaseException):
            await pump
    conn.state.diagnostic(
        f"http {decision.host}:{decision.port} {decision.verdict.value} "
        f"{decision.reason.value} status={sent.status}"
    )
    if sent.upgraded is not None:
        # No body was read (an upgrade request has none): whatever the client
        # sent after the head is already the new protocol's, still in `client`.
        await _splice(client, upstream, sent.upgraded, conn.state.limits.idle_timeout)
        raise _DoneError
    if not (sent.keep_alive and body.done and head.keep_alive):
        raise _DoneError
    client.unread(body.trailing)


async def _pump_body(
    client: Client, body: http1.RequestBodyReader, up_writer: asyncio.StreamWriter
) -> None:
    """Client request body -> upstream, re-framed; stops exactly at the body's end."""
    while not body.done:
        data = await client.read()
        if not data:
            body.feed_eof()
            return
        out = body.feed(data)
        if out:
            up_writer.write(out)
            await up_writer.drain()


async def _relay_response(
    conn: HttpConnection,
    head: http1.RequestHead,
    up_reader: asyncio.StreamReader,
    client: Client,
    request_body: tuple[asyncio.Future[None], http1.RequestBodyReader],
) -> _Sent:
    """Upstream response -> client: how it went out (see `_Sent`).

    The client connection ends after a 4xx, and after a response that came
    before the whole request body was read (DESIGN §3); such a head is sent
    with `Connection: close`, so the client never sends its next request into
    a connection that is going away. A 101 to an upgrade request is written
    and returned at once, with the bytes the upstream sent after it.
    """
    pump, body = request_body
    framer = http1.ResponseFramer(head, conn.state.limits.max_head_bytes)
    status = 0
    closing = False
    idle = conn.state.limits.idle_timeout
    while True:
        if pump.done() and pump.exception() is not None:
            # The client's body was malformed or cut short: nothing more to do.
            raise _DoneError
        try:
            async with asyncio.timeout(idle):
                data = await up_reader.read(READ_SIZE)
        except TimeoutError:
            raise _DoneError from None
        try:
            events = framer.feed(data) if data else framer.feed_eof()
        except http1.HttpError as exc:
            if status == 0:
                await client.refuse(http1.error_reply(502, "bad_upstream_response", str(exc)))
            raise _DoneError from None
        writer = client.writer
        for event in events:
            data = event.data
            if isinstance(event, http1.ResponseHead):
                status = event.status
                closing = event.keep_alive and (status >= 400 or not body.done)
                if closing:
                    data = _closing_head(data)
            writer.write(data)
            if isinstance(event, http1.Upgraded):
                await writer.drain()
                return _Sent(False, 101, framer.trailing)
            if isinstance(event, http1.EndOfMessage):
                await writer.drain()
                return _Sent(event.keep_alive and not closing, status)
        await writer.drain()
        if not data:
            raise _DoneError


def _closing_head(head: bytes) -> bytes:
    """A response head from the framer, made to say `Connection: close`.

    The framer drops every upstream Connection field (hop-by-hop), so the only
    one in the head is its own `Connection: keep-alive` for an HTTP/1.0 client.
    """
    head = head.replace(b"\r\nConnection: keep-alive\r\n", b"\r\n")
    return head[:-2] + b"Connection: close\r\n\r\n"


async def _splice(
    client: Client,
    upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    to_client: bytes,
    idle_timeout: float,
) -> None:
    """Relay raw bytes both ways after a 101 until both sides are done.

    Each direction passes its EOF on (half-close) once everything before it
    went out; the relay ends when both have, when a side fails, or after
    idle_timeout with no byte either way (as relay.py's tunnels). Bounded:
    each direction holds one read plus the writer's high-water mark. The
    callers close both connections afterwards; unless both sides finished,
    the client's is aborted here, dropping what it still buffers.
    """
    up_reader, up_writer = upstream
    loop = asyncio.get_running_loop()
    last = loop.time()

    def seen() -> None:
        nonlocal last
        last = loop.time()

    up_read = functools.partial(up_reader.read, READ_SIZE)
    flows = {
        loop.create_task(_copy(client.read, up_writer, b"", seen)),
        loop.create_task(_copy(up_read, client.writer, to_client, seen)),
    }
    finished = False
    try:
        pending = flows
        while pending:
            wait = max(last + idle_timeout - loop.time(), 0.0)
            done, pending = await asyncio.wait(
                pending, timeout=wait, return_when=asyncio.FIRST_EXCEPTION
            )
            if any(not task.cancelled() and task.exception() for task in done):
                return  # a reset or error on one side ends both
            if pending and loop.time() >= last + idle_timeout:
                return  # idle both ways
        finished = True
    finally:
        for task in flows:
            task.cancel()
        await asyncio.gather(*flows, return_exceptions=True)
        if not finished:
            # Drop what is still buffered for a client that may never read it
            # (the upstream connection is aborted by the caller anyway).
            client.writer.transport.abort()


async def _copy(
    read: Callable[[], Awaitable[bytes]],
    writer: asyncio.StreamWriter,
    first: bytes,
    seen: Callable[[], None],
) -> None:
    """One direction: `first`, then every read, then the EOF once all went out."""
    data = first
    while True:
        if data:
            seen()
            writer.write(data)
            await writer.drain()
        data = await read()
        if not data:
            break
    # Flush completely before the EOF: the connection is aborted once both
    # directions are done, which would drop anything still buffered.
    writer.transport.set_write_buffer_limits(high=0)
    await writer.drain()
    if writer.can_write_eof():
        with contextlib.suppress(OSError):  # the peer is gone: the other flow sees it
            writer.write_eof()
