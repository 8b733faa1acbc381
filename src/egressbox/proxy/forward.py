"""Plain HTTP forwarding (absolute-form `http://` and `ws://` requests) on the HTTP listener.

Each request on a client connection is decided afresh (a kept-alive client
may ask for another host next) and audited before anything is sent upstream,
so an `Expect: 100-continue` client never sees a 100 for a refused
destination. The upstream response is framed by the sans-IO `ResponseFramer`,
so the proxy knows exactly where it ends. Denials and 4xx replies carry
`Connection: close` and end the connection, so an unread request body is
never parsed as a request.

Upstream connections are never shared between client connections. One
client connection keeps its upstream connection for its next request only
when that request's own decision admits the same host, port and address
(the address the connection is connected to is one the new decision
checked), and the previous response ended cleanly with nothing after it
(`ResponseFramer.reusable`). This is per-connection persistence, not a pool
(HAProxy's `http-reuse never` does the same): it saves a TCP connect and
accept per request, which is most of a small request's cost. A request sent
on a kept connection that the upstream had closed meanwhile (its keep-alive
timeout raced our write) is retried once on a fresh connection when nothing
of the response had arrived and the request had no body.

Everything runs on asyncio Protocol callbacks: the client transport is
taken over from the listener's protocol, the upstream connection has a small
protocol of its own, and flow control pauses the reading side whenever the
writing side's buffer is full. A Task runs only while a decision waits for
DNS or a connection is dialled.

The upstream sees the name that was decided and nothing else: the request
goes out with `Host` written from the decision's normalized host (and the
port unless 80), not the client's spelling of it. The parser admits a Host
that names the target under the IDNA mapping (upper case, a trailing dot, a
soft hyphen, U+00AA for `a`) and refuses one naming another host (400);
an origin routing by Host would otherwise serve a name never decided.

An upgrade request (a WebSocket: `GET ws://...` with `Upgrade: websocket`)
that the upstream answers with 101 turns the connection into a raw byte
relay to that same upstream until either side is done; it is never parsed
as HTTP again, and its one audit record is the decision made for the GET.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Final, cast

from egressbox.core.decide import Decision
from egressbox.core.errors import AuditError
from egressbox.core.hosts import format_authority
from egressbox.core.ip import IPAddress
from egressbox.net.deadlines import Deadline, wheel
from egressbox.net.dial import DialError, Dialing, start_connect
from egressbox.protocols import http1
from egressbox.proxy.gate import OpenTarget, gate_request
from egressbox.proxy.replies import (
    LINGER_BYTES,
    LINGER_SECONDS,
    dial_http_status,
    http_status,
    send_final,
)
from egressbox.proxy.upstream import UpstreamDial, dial_through

# Members of enums from other modules bound once: compiled, each read would go
# through the enum class's attribute lookup (~130 instructions, under callgrind).
_FRAMING_KIND_NONE: Final = http1.FramingKind.NONE
_REQUEST_KIND_CONNECT: Final = http1.RequestKind.CONNECT

if TYPE_CHECKING:
    from egressbox.proxy.tunnel import Connection

# Client bytes held while a request is decided, dialled or answered (the next
# pipelined requests, or a body arriving before the upstream connection is
# up): reading stops above this, so a client cannot fill the proxy's memory.
MAX_PENDING_BYTES: Final = 256 * 1024
# Methods that may be sent again when a kept upstream connection turns out
# to be closed before any byte of the response came back (RFC 9110 §9.2.2).
RETRYABLE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


class _Phase(enum.Enum):
    HEAD = "head"  # reading the next request head
    DECIDING = "deciding"  # the decision or the dial is in flight
    EXCHANGE = "exchange"  # request body up, response down
    UPGRADED = "upgraded"  # after a 101: raw bytes both ways
    CLOSING = "closing"  # a refusal went out; dropping what the client sends
    CLOSED = "closed"


# Members bound once: compiled, each `_Phase.X` would go through the enum
# class's attribute lookup (~130 instructions a read, under callgrind).
_PHASE_CLOSED: Final = _Phase.CLOSED
_PHASE_CLOSING: Final = _Phase.CLOSING
_PHASE_DECIDING: Final = _Phase.DECIDING
_PHASE_EXCHANGE: Final = _Phase.EXCHANGE
_PHASE_HEAD: Final = _Phase.HEAD
_PHASE_UPGRADED: Final = _Phase.UPGRADED


class _Upstream(asyncio.Protocol):
    """One upstream connection: every event goes to its forwarder."""

    def __init__(self, owner: Forwarder, host: str, port: int) -> None:
        self.owner = owner
        self.host = host
        self.port = port
        self.address: IPAddress | None = None  # the checked address it is connected to
        self.transport: asyncio.Transport | None = None
        self.received = False  # a response byte came on this connection for the request
        self.eof = False
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    # Every callback is guarded: an exception here would close only this upstream
    # transport and leave the client connection waiting on it forever.

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.owner.upstream_data(self, data)
        except Exception as exc:
            self.owner.internal_error(exc)

    def eof_received(self) -> bool:
        self.eof = True
        try:
            return self.owner.upstream_eof(self)
        except Exception as exc:
            self.owner.internal_error(exc)
            return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        try:
            self.owner.upstream_lost(self)
        except Exception as error:
            self.owner.internal_error(error)

    def pause_writing(self) -> None:
        self.owner.upstream_blocked(self, True)

    def resume_writing(self) -> None:
        self.owner.upstream_blocked(self, False)

    def admits(self, decision: Decision) -> bool:
        """May this connection carry a request that `decision` allowed?"""
        return (
            not self.lost
            and not self.eof
            and self.address is not None
            and self.transport is not None
            and not self.transport.is_closing()
            and self.host == decision.host
            and self.port == decision.port
            and self.address in decision.addresses
        )

    def write(self, data: bytes) -> None:
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def start_forwarding(conn: Connection, head: http1.RequestHead, trailing: bytes) -> None:
    """Take over the connection's transport and serve its plain HTTP requests."""
    transport = conn.transport
    assert transport is not None
    conn.cancel_timer()
    transport.pause_reading()  # the forwarder resumes it when it wants bytes
    forwarder = Forwarder(conn, transport)
    conn.state.forwarders.add(forwarder)
    transport.set_protocol(forwarder)
    forwarder.begin(head, trailing)


class Forwarder(asyncio.Protocol):
    """The client side of one forwarding connection, from its first request to its close."""

    def __init__(self, conn: Connection, transport: asyncio.Transport) -> None:
        self.conn = conn
        self.state = conn.state
        self.limits = conn.state.limits
        self.client = transport
        # Client bytes not yet given to a parser or body reader: what came while
        # a decision was in flight, and everything after the request body.
        self.pending = b""
        self.head_started = False  # part of the next head has arrived
        self.loop = conn.state.event_loop()  # get_running_loop() is a getpid() on 3.11
        self.phase = _PHASE_HEAD
        self.parser: http1.RequestHeadParser | None = None
        self.request: http1.RequestHead | None = None
        self.decision: Decision | None = None
        self.body: http1.RequestBodyReader | None = None
        self.framer: http1.ResponseFramer | None = None
        self.upstream: _Upstream | None = None
        self.reused = False  # the request went out on a kept connection
        self.status = 0
        self.closing = False  # the response head told the client `Connection: close`
        self.client_eof = False
        self.reading = False  # the client transport is being read (it starts paused)
        self.up_blocked = False  # the upstream's write buffer is full
        self.client_blocked = False  # the client's write buffer is full
        self.dropped = 0  # bytes dropped while lingering
        self.deadline = 0.0
        self.timer: Deadline | None = None
        self.timer_at = 0.0  # when `timer` fires
        self.task: asyncio.Task[None] | None = None
        # UpstreamDial when chaining (an interpreted class: not a compiled Dialing).
        self.dialing: Dialing | UpstreamDial | None = None

    # -- the client transport's protocol -------------------------------------------

    def internal_error(self, exc: Exception) -> None:
        """A bug in a callback: close this connection (its slot comes back), say it once."""
        self.state.internal_error("http", exc)
        self.phase = _PHASE_CLOSED
        self._cancel_timer()
        self._end()

    def data_received(self, data: bytes) -> None:
        try:
            self._client_data(data)
        except Exception as exc:
            self.internal_error(exc)

    def _client_data(self, data: bytes) -> None:
        phase = self.phase
        if phase is _PHASE_HEAD:
            self._head_bytes(data)
        elif phase is _PHASE_EXCHANGE:
            self._touch(self.limits.idle_timeout)
            assert self.body is not None
            if self.body.done:
                self._stash(data)
            else:
                self._body_bytes(data)
        elif phase is _PHASE_UPGRADED:
            self._touch(self.limits.idle_timeout)
            assert self.upstream is not None
            self.upstream.write(data)
        elif phase is _PHASE_CLOSING:
            self.dropped += len(data)
            if self.dropped > LINGER_BYTES:
                self._close_client()
        elif phase is _PHASE_DECIDING:
            # Paused, but a transport may hand over one read already made.
            self._stash(data)

    def eof_received(self) -> bool:
        try:
            return self._client_eof()
        except Exception as exc:
            self.internal_error(exc)
            return False

    def _client_eof(self) -> bool:
        self.client_eof = True
        phase = self.phase
        if phase is _PHASE_EXCHANGE and self.body is not None and not self.body.done:
            self._end()  # the request body was cut short: nothing sensible to send
            return False
        if phase is _PHASE_UPGRADED:
            assert self.upstream is not None
            self._upstream_write_eof(self.upstream)
            if self.upstream.eof:
                self._close_client()
                return False
            return True
        # Answer the request in flight, then close (the client may half-close
        # after sending it); anything else ends here.
        return phase is _PHASE_EXCHANGE or phase is _PHASE_DECIDING

    def connection_lost(self, exc: Exception | None) -> None:
        self.phase = _PHASE_CLOSED
        self._cancel_timer()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.task = None
        if self.dialing is not None:
            self.dialing.cancel()
            self.dialing = None
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None
        self.state.forwarders.discard(self)
        self.conn.left()

    def target(self) -> OpenTarget | None:
        """What this connection is connected or being connected to (close_denied)."""
        protocol = self.conn.protocol_name
        upstream, decision = self.upstream, self.decision
        if upstream is not None and upstream.address is not None:
            # A kept connection outlives its request's decision: judge its one address.
            return OpenTarget(protocol, upstream.host, upstream.port, (upstream.address,))
        if self.dialing is not None and decision is not None:
            return OpenTarget(protocol, decision.host, decision.port, decision.addresses)
        return None

    def abort(self) -> None:
        """Abort both connections (close_denied: the policy no longer admits the target)."""
        self._end()

    def pause_writing(self) -> None:
        self.client_blocked = True
        self._sync_upstream_reading()

    def resume_writing(self) -> None:
        self.client_blocked = False
        self._sync_upstream_reading()

    def _sync_upstream_reading(self) -> None:
        """Read the upstream only while the client takes what we write (a kept or new
        upstream connection starts in the client's current state, too)."""
        upstream = self.upstream
        if upstream is None or upstream.transport is None or upstream.transport.is_closing():
            return
        with contextlib.suppress(RuntimeError):
            if self.client_blocked:
                upstream.transport.pause_reading()
            else:
                upstream.transport.resume_reading()

    # -- requests ------------------------------------------------------------------

    def begin(self, head: http1.RequestHead, trailing: bytes) -> None:
        self._request(head, trailing)

    def _head_bytes(self, data: bytes) -> None:
        if self.parser is None:
            self.parser = http1.RequestHeadParser(self.limits.max_head_bytes)
        try:
            head = self.parser.feed(data)
        except http1.BadTargetPortError:
            # A later request's target is decided as the first one's is: audited.
            self.phase = _PHASE_DECIDING
            self._decided(self.conn.bad_port_decision())
            return
        except http1.HttpError as exc:
            self._refuse(http1.error_reply(exc.status, "bad_request", str(exc)))
            return
        if head is None:
            if not self.head_started:  # a new head starts: all of it must come in time
                self.head_started = True
                self._deadline_within(self.limits.head_timeout)
            return
        self.head_started = False
        trailing = self.parser.trailing
        self.parser = None
        self._request(head, trailing)

    def _request(self, head: http1.RequestHead, pending: bytes) -> None:
        """Decide `head`, then send it upstream; `pending` is what the client sent after it."""
        if head.kind is _REQUEST_KIND_CONNECT:
            self._tunnel_instead(head, pending)
            return
        self.phase = _PHASE_DECIDING
        self.request = head
        self.pending = pending
        self._touch(self.limits.idle_timeout)  # the decision and the dial time out on their own
        # Most decisions need no DNS query (an IP literal, a cached name, a
        # name the rules refuse): those are made and audited right here.
        decided = self.conn.decide_now(head.host, head.port)
        if isinstance(decided, Decision):
            self._decided(decided)
        else:
            self._spawn(self._decide_later(head))

    def _tunnel_instead(self, head: http1.RequestHead, pending: bytes) -> None:
        """A CONNECT after a plain request (its response is complete: heads are read only
        then): the connection goes back to the listener's own tunnel path, which decides
        (audited) and answers it like a first request."""
        self._cancel_timer()
        self._drop_upstream()
        self.phase = _PHASE_CLOSED
        self.state.forwarders.discard(self)
        self.conn.take_back(self.client, head, pending)

    def _stash(self, data: bytes) -> None:
        self.pending += data
        if len(self.pending) > MAX_PENDING_BYTES:
            self._sync_reading()

    async def _decide_later(self, head: http1.RequestHead) -> None:
        decision = await self.conn.decide(head.host, head.port)
        if self.phase is _PHASE_DECIDING:
            self._decided(decision)

    def _decided(self, decision: Decision) -> None:
        if not decision.allowed:
            self.conn.log_refusal(decision)
            status = http_status(decision.reason)
            self._refuse(http1.error_reply(status, decision.reason.value, decision.detail))
            return
        if self.state.broker is not None and self._request_refused(decision):
            return
        self.decision = decision
        kept = self.upstream
        if kept is not None and kept.admits(decision):
            self._exchange(kept, reused=True)
            return
        self._drop_upstream()
        self._sync_reading()
        self._connect(decision)

    def _request_refused(self, decision: Decision) -> bool:
        """A secret's placeholder sent where it is not bound, or a request rule or budget
        that refuses this request (the gate audits it): answered 403, True. Never put in
        over plain HTTP: a bound host gets its placeholder as it is."""
        from egressbox.proxy.terminate import request_facts

        assert self.request is not None
        try:
            refusal = gate_request(
                self.state, self.conn.protocol_name, decision, request_facts(self.request)
            )
        except AuditError:
            refusal = None
        if refusal is None:
            return False
        self.conn.log_refusal(refusal)
        status = http_status(refusal.reason)
        self._refuse(http1.error_reply(status, refusal.reason.value, refusal.detail))
        return True

    def _connect(self, decision: Decision) -> None:
        """Dial one of the decision's addresses; the exchange starts from the report."""
        upstream = _Upstream(self, decision.host, decision.port)

        def dialed(transport: asyncio.Transport | None, error: DialError | None) -> None:
            try:
                if transport is not None and self.dialing is not None:
                    # The checked address the dial connected to (not the peer's address
                    # parsed again; through an upstream proxy the peer is that proxy:
                    # then the address it was asked for, or the name's first).
                    upstream.address = self.dialing.address
                self._dialed(upstream, decision, error)
            except Exception as exc:  # a bug must not kill the server (nor hang the client)
                self.state.diagnostic(f"http: internal error while forwarding: {exc!r}")
                upstream.close()
                self._end()

        if self.state.upstream is not None:  # chaining: CONNECT, then origin-form inside
            self.dialing = dial_through(
                self.state.upstream,
                self.state.resolver,
                decision,
                upstream,
                dialed,
                timeout=self.limits.connect_timeout,
                loop=self.loop,
            )
            return
        self.dialing = start_connect(
            decision.addresses,
            decision.port,
            upstream,
            dialed,
            timeout=self.limits.connect_timeout,
            loop=self.loop,
        )

    def _dialed(self, upstream: _Upstream, decision: Decision, error: DialError | None) -> None:
        self.dialing = None
        if self.phase is not _PHASE_DECIDING:  # the client left meanwhile
            upstream.close()
            return
        if error is not None:
            self.conn.log_refusal(decision, f"upstream: {error}")
            status = dial_http_status(error.reason.value)
            self._refuse(http1.error_reply(status, error.reason.value, str(error)))
            return
        if upstream.received:
            # An HTTP server speaks only when asked: bytes before the request
            # could pass for its response.
            upstream.close()
            message = "the upstream sent bytes before the request"
            self._refuse(http1.error_reply(502, "bad_upstream_response", message))
            return
        self._exchange(upstream, reused=False)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        """Run `coro` in a Task that connection_lost cancels."""
        task = self.loop.create_task(self._guard(coro))
        self.task = task
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if self.task is task:
            self.task = None

    async def _guard(self, coro: Coroutine[object, object, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not kill the server
            self.state.diagnostic(f"http: internal error while forwarding: {exc!r}")
            self._end()

    def _exchange(self, upstream: _Upstream, *, reused: bool) -> None:
        """Send the request head and what there is of its body; the response follows."""
        head = self.request
        assert head is not None
        self.upstream = upstream
        self.reused = reused
        if self.client_blocked:
            self._sync_upstream_reading()
        upstream.received = False
        self.status = 0
        self.closing = False
        self.framer = http1.ResponseFramer(head, self.limits.max_head_bytes)
        self.body = http1.RequestBodyReader(head.body)
        self.phase = _PHASE_EXCHANGE
        keep = head.keep_alive and not self.client_eof
        decision = self.decision
        assert decision is not None
        # Host is the decided, normalized name, whatever spelling of it the client sent.
        upstream.write(http1.forward_head(head, keep_alive=keep, host=decision.host))
        pending, self.pending = self.pending, b""
        self._touch(self.limits.idle_timeout)
        if pending:
            self._body_bytes(pending)
        if self.phase is not _PHASE_EXCHANGE:
            return
        if self.client_eof and not self.body.done:
            # The client closed while the connection was being made, before the
            # end of its body: the request can never be whole.
            self._end()
            return
        self._sync_reading()

    def _body_bytes(self, data: bytes) -> None:
        body = self.body
        assert body is not None and self.upstream is not None
        try:
            out = body.feed(data)
        except http1.HttpError:
            self._end()  # a malformed body: the upstream got part of it, so only closing is left
            return
        self.upstream.write(out)
        if body.done:
            # What follows the body waits in `pending` for the response to end.
            self.pending += body.trailing
            self._sync_reading()

    # -- the upstream connection -----------------------------------------------------

    def upstream_data(self, upstream: _Upstream, data: bytes) -> None:
        if upstream is not self.upstream:
            return
        if self.phase is _PHASE_UPGRADED:
            self._touch(self.limits.idle_timeout)
            self._client_write(data)
            return
        if self.phase is not _PHASE_EXCHANGE:
            # A kept connection must stay silent between requests: a stray
            # byte would be taken for the start of the next response.
            self._drop_upstream()
            return
        self._touch(self.limits.idle_timeout)
        framer = self.framer
        assert framer is not None
        try:
            events = framer.feed(data)
        except http1.HttpError as exc:
            self._bad_response(exc)
            return
        self._response_events(events)

    def upstream_eof(self, upstream: _Upstream) -> bool:
        if upstream is not self.upstream:
            return False
        if self.phase is _PHASE_UPGRADED:
            if self.client.can_write_eof() and not self.client.is_closing():
                with contextlib.suppress(OSError):
                    self.client.write_eof()
            if self.client_eof:
                self._close_client()
                return False
            return True  # keep sending the client's bytes up
        self._upstream_ended(upstream)
        return False

    def upstream_lost(self, upstream: _Upstream) -> None:
        if upstream is not self.upstream:
            return
        if self.phase is _PHASE_UPGRADED:
            self.upstream = None
            self._close_client()
            return
        self._upstream_ended(upstream)

    def _upstream_ended(self, upstream: _Upstream) -> None:
        """The upstream closed its side: the end of a close-delimited body, or trouble."""
        if self.phase is not _PHASE_EXCHANGE:
            if upstream is self.upstream:
                self.upstream = None  # a kept connection the upstream closed: dial anew next time
            return
        if self._retry(upstream):
            return
        framer = self.framer
        assert framer is not None
        try:
            events = framer.feed_eof()
        except http1.HttpError as exc:
            self._bad_response(exc)
            return
        self._response_events(events)

    def _retry(self, upstream: _Upstream) -> bool:
        """Send the request again on a new connection, if it is safe (see the module doc)."""
        head, body = self.request, self.body
        if not (self.reused and not upstream.received and head is not None and body is not None):
            return False
        if head.method not in RETRYABLE_METHODS or head.body.kind is not _FRAMING_KIND_NONE:
            return False
        decision = self.decision
        assert decision is not None
        self.upstream = None
        upstream.close()
        self.phase = _PHASE_DECIDING
        self._sync_reading()
        self._connect(decision)
        return True

    def upstream_blocked(self, upstream: _Upstream, blocked: bool) -> None:
        if upstream is self.upstream:
            self.up_blocked = blocked
            self._sync_reading()

    # -- the response ----------------------------------------------------------------

    def _response_events(self, events: list[http1.ResponseEvent]) -> None:
        """Write the events' bytes to the client in one write (one send(2), not one
        per event), then act on the last one."""
        body = self.body
        assert body is not None
        out: list[bytes] = []
        for event in events:
            data = event.data
            if isinstance(event, http1.ResponseHead):
                self.status = event.status
                self.closing = event.keep_alive and (event.status >= 400 or not body.done)
                if self.closing:
                    data = _closing_head(data)
            out.append(data)
            if isinstance(event, http1.Upgraded):
                self._client_write(b"".join(out))
                self._upgraded()
                return
            if isinstance(event, http1.EndOfMessage):
                self._client_write(b"".join(out))
                self._response_done(event.keep_alive and not self.closing)
                return
        self._client_write(b"".join(out))

    def _response_done(self, keep_alive: bool) -> None:
        head, body, framer, decision = self.request, self.body, self.framer, self.decision
        assert head is not None and body is not None and framer is not None
        assert decision is not None
        self._log(decision)
        upstream = self.upstream
        if not (keep_alive and body.done and head.keep_alive and not self.client_eof):
            self._drop_upstream()
            self._close_client()
            return
        if upstream is not None and not framer.reusable:
            self._drop_upstream()
        pending, self.pending = self.pending, b""
        self.request = self.body = self.framer = self.decision = None
        self.phase = _PHASE_HEAD
        # An idle kept-alive client holds a slot: the next request must come soon.
        self._deadline_within(self.limits.keepalive_timeout)
        if pending:
            self._head_bytes(pending)
        if self.phase is _PHASE_HEAD:
            self._sync_reading()

    def _upgraded(self) -> None:
        """After a 101: relay raw bytes both ways; nothing is parsed as HTTP again."""
        framer, body, upstream = self.framer, self.body, self.upstream
        assert framer is not None and body is not None and upstream is not None
        assert self.decision is not None
        self._log(self.decision)
        self.phase = _PHASE_UPGRADED
        self._client_write(framer.trailing)
        # No body was read (an upgrade request has none): whatever the client
        # sent after the head is already the new protocol's.
        upstream.write(self.pending)
        self.pending = b""
        self.framer = None
        if self.client_eof:
            self._upstream_write_eof(upstream)
        self._sync_reading()

    def _bad_response(self, exc: http1.HttpError) -> None:
        if self.status == 0:
            self._refuse(http1.error_reply(502, "bad_upstream_response", str(exc)))
        else:
            self._end()  # part of the response went out: only closing is left

    def _log(self, decision: Decision) -> None:
        if self.state.log is not None and self.state.log_allowed:
            self.state.diagnostic(
                f"http {format_authority(decision.host, decision.port)} "
                f"{decision.verdict.value} {decision.reason.value} status={self.status}"
            )

    # -- plumbing --------------------------------------------------------------------

    def _wants_reading(self) -> bool:
        phase = self.phase
        if phase is _PHASE_HEAD or phase is _PHASE_CLOSING:
            return True
        if phase is _PHASE_EXCHANGE:
            if self.body is not None and self.body.done:
                return len(self.pending) <= MAX_PENDING_BYTES
            return not self.up_blocked
        if phase is _PHASE_DECIDING:
            return len(self.pending) <= MAX_PENDING_BYTES
        return phase is _PHASE_UPGRADED and not self.up_blocked

    def _sync_reading(self) -> None:
        wanted = self._wants_reading()
        if wanted == self.reading or self.client.is_closing():
            return
        self.reading = wanted
        if wanted:
            self.client.resume_reading()
        else:
            self.client.pause_reading()

    def _client_write(self, data: bytes) -> None:
        if data and not self.client.is_closing():
            self.client.write(data)

    def _upstream_write_eof(self, upstream: _Upstream) -> None:
        transport = upstream.transport
        if transport is not None and transport.can_write_eof() and not transport.is_closing():
            with contextlib.suppress(OSError):
                transport.write_eof()

    def _refuse(self, reply: bytes) -> None:
        """Send a final reply, half-close, and drop what the client still sends."""
        self._drop_upstream()
        if self.client.is_closing():
            return
        self.phase = _PHASE_CLOSING
        if not send_final(self.client, reply):  # the client is already gone
            self._end()
            return
        if self.client_eof:
            self._close_client()
            return
        self._sync_reading()
        self._cancel_timer()
        self.deadline = self.loop.time() + LINGER_SECONDS
        self._arm(self.deadline)

    def _drop_upstream(self) -> None:
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            upstream.close()

    def _close_client(self) -> None:
        """Close after what is buffered for the client went out."""
        self._cancel_timer()
        self._drop_upstream()
        if not self.client.is_closing():
            self.client.close()

    def _end(self) -> None:
        """Abort both connections (a side failed, or the exchange cannot go on)."""
        self._drop_upstream()
        self.client.abort()

    def _touch(self, seconds: float) -> None:
        """Set the deadline `seconds` ahead; the timer, if later, is re-armed when it fires."""
        self.deadline = self.loop.time() + seconds
        if self.timer is None:
            self._arm(self.deadline)

    def _deadline_within(self, seconds: float) -> None:
        """As _touch, but make sure the timer fires by the new deadline."""
        self._touch(seconds)
        if self.timer_at > self.deadline:
            self._cancel_timer()
            self._arm(self.deadline)

    def _arm(self, when: float) -> None:
        self.timer_at = when
        self.timer = wheel(self.loop).call_at(when, self._on_timer)

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _on_timer(self) -> None:
        self.timer = None
        if self.phase is _PHASE_CLOSED:
            return
        # DECIDING too: the decision and the dial time out on their own well before
        # this deadline, so reaching it means something hung: never wait forever.
        if self.loop.time() < self.deadline:
            self._arm(self.deadline)
            return
        if self.phase is _PHASE_HEAD and self.request is None:
            self.state.diagnostic("http: no further request within the keep-alive timeout")
        elif self.phase is _PHASE_DECIDING:
            self.state.diagnostic("http: a decision or dial outlived its deadline")
        self._close_client()


def _closing_head(head: bytes) -> bytes:
    """A response head from the framer, made to say `Connection: close`.

    The framer drops every upstream Connection field (hop-by-hop), so the only
    one in the head is its own `Connection: keep-alive` for an HTTP/1.0 client.
    """
    head = head.replace(b"\r\nConnection: keep-alive\r\n", b"\r\n")
    return head[:-2] + b"Connection: close\r\n\r\n"
