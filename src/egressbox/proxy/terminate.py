"""TLS termination for the hosts a secret is bound to (or that have request rules).

Only such a connection is terminated; every other tunnel stays untouched bytes with the TLS
name check (tunnel.py, tls_check.py). For a terminated one (CONNECT, SOCKS5 or captured):

1. the gate has decided the target (audited) and the connection is dialled to the CHECKED
   addresses only (net/dial.py, as a tunnel is); the listener's success reply goes out;
2. the proxy speaks TLS to the child with a certificate for the target signed by the run's CA
   (proxy/ca.py), ALPN `http/1.1`, and refuses a ClientHello naming another host
   (`sni_mismatch`);
3. each request is read with the one HTTP grammar (protocols/http1.py, origin-form), judged by
   the gate (`secret_misdirected`, `method_denied`, `path_denied`, `budget_exceeded`: a 403
   with `X-Egressbox-Reason`, audited, then the connection closes), its placeholders replaced
   by the values bound to this host (proxy/broker.py), and sent over TLS to the origin with
   full verification (the system's CAs plus `[tls] origin_ca`, the decided name as
   `server_hostname`);
4. the response is framed by the same module's ResponseFramer and relayed.

TLS runs on memory BIOs over the transports' bytes (ssl.SSLObject), so the bytes a captured
client sent before the decision simply go first, and both ends share one code path.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import TYPE_CHECKING, Final, Protocol

from egressbox.core.decide import Decision
from egressbox.core.errors import AuditError, HostError, Reason, Verdict
from egressbox.core.hosts import normalize_host
from egressbox.net.dial import DialError, start_connect
from egressbox.protocols import http1
from egressbox.proxy.gate import (
    OpenTarget,
    ProxyState,
    RequestFacts,
    gate_audited,
    gate_refused,
    gate_request,
)
from egressbox.proxy.replies import http_status

if TYPE_CHECKING:
    from egressbox.audit.record import AuditProtocol
    from egressbox.proxy.broker import Broker

# Bytes read from a transport's buffer (or a TLS record's plaintext) at a time.
RECV_BYTES: Final = 64 * 1024
# The reply code (X-Egressbox-Reason) when the origin's TLS cannot be verified: a failed
# connection, not a policy decision, like the dial failures' codes (replies.py).
ORIGIN_TLS_FAILED: Final = "origin_tls_failed"
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"


class Connection(Protocol):
    """What a session uses of the listener's connection (tunnel.Connection; named here as a
    protocol, since tunnel.py starts sessions)."""

    state: ProxyState
    transport: asyncio.Transport | None
    task: asyncio.Task[None] | None
    protocol_name: AuditProtocol

    def established(self, upstream: asyncio.Transport) -> bytes: ...

    def dial_failed(self, decision: Decision, exc: DialError) -> None: ...

    def log_refusal(self, decision: Decision, extra: str = "") -> None: ...

    def left(self) -> None: ...

    def abort(self) -> None: ...


class _ClosedError(Exception):
    """The peer closed, or the session is over."""


class TlsEnd:
    """One TLS end (server towards the child, client towards the origin) over a transport's
    bytes, with memory BIOs."""

    def __init__(
        self,
        transport: asyncio.Transport,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        context: ssl.SSLContext,
        *,
        server_hostname: str | None = None,
    ) -> None:
        self.transport = transport
        self.reader = reader
        self.writer = writer
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        server = server_hostname is None
        self.tls = context.wrap_bio(
            self.incoming, self.outgoing, server_side=server, server_hostname=server_hostname
        )

    def _flush(self) -> None:
        data = self.outgoing.read()
        if data and not self.transport.is_closing():
            self.transport.write(data)

    async def _fill(self) -> None:
        data = await self.reader.read(RECV_BYTES)
        if data:
            self.incoming.write(data)
        else:
            self.incoming.write_eof()

    async def handshake(self) -> None:
        while True:
            try:
                self.tls.do_handshake()
            except ssl.SSLWantReadError:
                self._flush()
                await self._fill()
                continue
            finally:
                self._flush()
            return

    async def read(self) -> bytes:
        """Plaintext bytes; b"" once the peer has closed (cleanly or not)."""
        while True:
            try:
                return self.tls.read(RECV_BYTES)
            except ssl.SSLWantReadError:
                self._flush()
                if self.incoming.eof:
                    return b""
                await self._fill()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    async def write(self, data: bytes) -> None:
        if not data:
            return
        self.tls.write(data)
        self._flush()
        await self.writer.drain()

    def close(self) -> None:
        if not self.transport.is_closing():
            with contextlib.suppress(ssl.SSLError):
                self.tls.unwrap()
            self._flush()
            self.transport.close()

    def abort(self) -> None:
        self.transport.abort()


def request_facts(head: http1.RequestHead) -> RequestFacts:
    """What the gate reads of a request (its size: the head's bytes and a declared length)."""
    size = len(head.method) + len(head.target) + sum(len(n) + len(v) + 4 for n, v in head.headers)
    if head.body.kind is http1.FramingKind.LENGTH:
        size += head.body.length
    return RequestFacts(head.method, head.origin_target or head.target, head.headers, size)


def start_terminating(conn: Connection, decision: Decision, to_upstream: bytes) -> None:
    """Dial the checked addresses, answer the listener's success reply, then serve the
    connection's requests terminated (in one Task, cancelled by the connection's abort)."""
    session = Session(conn, decision, to_upstream)
    conn.state.forwarders.add(session)
    loop = conn.state.event_loop()
    conn.task = loop.create_task(session.run())


class Session:
    """One terminated connection, from the dial to its close."""

    def __init__(self, conn: Connection, decision: Decision, early: bytes) -> None:
        self.conn = conn
        self.state: ProxyState = conn.state
        self.decision = decision
        self.early = early
        broker = self.state.broker
        assert broker is not None
        self.broker: Broker = broker  # type: ignore[assignment]
        self.client: TlsEnd | None = None
        self.origin: TlsEnd | None = None
        self.origin_ready = False
        self.closed = False

    # Held, for close_denied() and the drain.
    def target(self) -> OpenTarget | None:
        d = self.decision
        return OpenTarget(self.conn.protocol_name, d.host, d.port, d.addresses)

    def abort(self) -> None:
        self.conn.abort()
        self._end(abort=True)

    async def run(self) -> None:
        try:
            await self._run()
        except (_ClosedError, ConnectionError, TimeoutError, ssl.SSLError):
            self._end(abort=True)
        except asyncio.CancelledError:
            self._end(abort=True)
            raise
        except Exception as exc:  # a bug must not kill the server
            self.state.internal_error(str(self.conn.protocol_name), exc)
            self._end(abort=True)
        else:
            self._end(abort=False)

    def _end(self, *, abort: bool) -> None:
        if self.closed:
            return
        self.closed = True
        for end in (self.client, self.origin):
            if end is not None:
                end.abort() if abort else end.close()
        self.state.forwarders.discard(self)
        self.conn.left()

    async def _run(self) -> None:
        loop = self.state.event_loop()
        up_reader = asyncio.StreamReader(limit=RECV_BYTES, loop=loop)
        up_proto = asyncio.StreamReaderProtocol(up_reader, loop=loop)
        up = await self._dial(loop, up_proto)
        if up is None:
            return
        conn, transport = self.conn, self.conn.transport
        if transport is None or transport.is_closing():
            up.abort()
            return
        reply = conn.established(up)
        up_writer = asyncio.StreamWriter(up, up_proto, up_reader, loop)
        self.origin = TlsEnd(
            up,
            up_reader,
            up_writer,
            self.broker.origin_context(),
            server_hostname=self.decision.host,
        )
        reader = asyncio.StreamReader(limit=RECV_BYTES, loop=loop)
        proto = asyncio.StreamReaderProtocol(reader, loop=loop)
        writer = asyncio.StreamWriter(transport, proto, reader, loop)
        transport.set_protocol(proto)
        proto.connection_made(transport)
        conn.transport = None  # the session holds it now
        if reply:
            transport.write(reply)
        if self.early:
            reader.feed_data(self.early)
        transport.resume_reading()
        self.client = TlsEnd(
            transport, reader, writer, self.broker.ca.server_context(self.decision.host)
        )
        limits = self.state.limits
        async with asyncio.timeout(limits.head_timeout):
            await self.client.handshake()
        if not self._sni_matches():
            return
        await self._serve()

    async def _dial(
        self, loop: asyncio.AbstractEventLoop, protocol: asyncio.Protocol
    ) -> asyncio.Transport | None:
        done: asyncio.Future[tuple[asyncio.Transport | None, DialError | None]] = (
            loop.create_future()
        )

        def report(transport: asyncio.Transport | None, error: DialError | None) -> None:
            if not done.done():
                done.set_result((transport, error))

        decision = self.decision
        dialing = start_connect(
            decision.addresses,
            decision.port,
            protocol,
            report,
            timeout=self.state.limits.connect_timeout,
            loop=loop,
        )
        try:
            transport, error = await done
        except asyncio.CancelledError:
            dialing.cancel()
            raise
        if transport is None:
            assert error is not None
            self.conn.dial_failed(decision, error)
            self.closed = True
            self.state.forwarders.discard(self)
            return None
        return transport

    def _sni_matches(self) -> bool:
        """A ClientHello naming another host than the target: `sni_mismatch` (audited)."""
        assert self.client is not None
        name = getattr(self.client.tls, "egressbox_sni", None)
        policy = self.state.policy
        if name is None or (policy is not None and policy.tls_name_check.value == "off"):
            return True
        try:
            same = normalize_host(name).text == self.decision.host
        except HostError:
            same = False
        if same:
            return True
        d = self.decision
        refusal = Decision(
            Verdict.DENY,
            Reason.SNI_MISMATCH,
            d.host,
            d.port,
            (),
            d.rule,
            "the TLS ClientHello names another host",
        )
        gate_audited(self.state, self.conn.protocol_name, refusal, d.host, d.port)
        self.conn.log_refusal(refusal)
        return False

    # -- requests -------------------------------------------------------------------------

    async def _serve(self) -> None:
        assert self.client is not None
        pending = b""
        origin = http1.Authority(self.decision.host, self.decision.port)
        while True:
            parser = http1.RequestHeadParser(self.state.limits.max_head_bytes, origin=origin)
            head = await self._read_head(parser, pending)
            if head is None:
                return
            pending = parser.trailing
            keep = await self._exchange(head, pending)
            if keep is None:
                return
            pending = keep

    async def _read_head(
        self, parser: http1.RequestHeadParser, pending: bytes
    ) -> http1.RequestHead | None:
        assert self.client is not None
        data = pending
        async with asyncio.timeout(self.state.limits.idle_timeout):
            while True:
                try:
                    head = parser.feed(data)
                except http1.HttpError as exc:
                    await self._reply(http1.error_reply(exc.status, "bad_request", str(exc)))
                    return None
                if head is not None:
                    return head
                data = await self.client.read()
                if not data:
                    return None

    async def _reply(self, data: bytes) -> None:
        assert self.client is not None
        await self.client.write(data)

    async def _refuse(self, refusal: Decision) -> None:
        self.conn.log_refusal(refusal)
        status = http_status(refusal.reason)
        await self._reply(http1.error_reply(status, refusal.reason.value, refusal.detail))

    async def _exchange(self, head: http1.RequestHead, pending: bytes) -> bytes | None:
        """One request and its response; the bytes after it when the connection goes on."""
        assert self.client is not None and self.origin is not None
        protocol = self.conn.protocol_name
        try:
            refusal = gate_request(self.state, protocol, self.decision, request_facts(head))
        except AuditError:
            return None
        if refusal is not None:
            await self._refuse(refusal)
            return None
        if not await self._origin_up():
            return None
        d = self.decision
        target, fields = self.broker.rewrite(
            d.host, d.port, head.origin_target or "/", head.headers
        )
        sent = _with(head, target, fields)
        data = http1.forward_head(
            sent, keep_alive=True, host=d.host, default_port=http1.HTTPS_DEFAULT_PORT
        )
        if head.expect_continue:
            await self._reply(_CONTINUE)
        await self.origin.write(data)
        rest = await self._send_body(head, pending)
        if rest is None:
            return None
        return rest if await self._relay_response(head) else None

    async def _origin_up(self) -> bool:
        """The TLS handshake with the origin, verified (once per connection)."""
        assert self.origin is not None
        if self.origin_ready:
            return True
        try:
            async with asyncio.timeout(self.state.limits.connect_timeout):
                await self.origin.handshake()
        except (ssl.SSLError, TimeoutError, ConnectionError) as exc:
            why = getattr(exc, "verify_message", None) or type(exc).__name__
            d = self.decision
            self.state.diagnostic(
                f"{self.conn.protocol_name} {d.host}:{d.port}: the origin's TLS failed ({why})"
            )
            message = f"the origin's TLS could not be verified: {why}"
            await self._reply(http1.error_reply(502, ORIGIN_TLS_FAILED, message))
            return False
        self.origin_ready = True
        return True

    async def _send_body(self, head: http1.RequestHead, pending: bytes) -> bytes | None:
        """The request body up; what the client sent after it, or None when refused."""
        assert self.client is not None and self.origin is not None
        body = http1.RequestBodyReader(head.body)
        chunked = head.body.kind is http1.FramingKind.CHUNKED
        data = pending
        while True:
            try:
                out = body.feed(data)
            except http1.HttpError as exc:
                await self._reply(http1.error_reply(exc.status, "bad_request", str(exc)))
                return None
            if chunked and out:
                d = self.decision
                over = self.broker.more_bytes(d.host, d.port, len(out))
                if over is not None:
                    self.origin.abort()  # the origin never gets a complete request
                    await self._refuse(gate_refused(self.state, self.conn.protocol_name, d, over))
                    return None
            await self.origin.write(out)
            if body.done:
                return body.trailing
            data = await self.client.read()
            if not data:
                raise _ClosedError

    async def _relay_response(self, head: http1.RequestHead) -> bool:
        """The response down; True when the connection may carry another request."""
        assert self.client is not None and self.origin is not None
        framer = http1.ResponseFramer(head, self.state.limits.max_head_bytes)
        started = False
        while True:
            data = await self.origin.read()
            try:
                events = framer.feed(data) if data else framer.feed_eof()
            except http1.HttpError as exc:
                if not started:
                    await self._reply(http1.error_reply(502, "bad_upstream_response", str(exc)))
                return False
            for event in events:
                if isinstance(event, http1.ResponseHead):
                    started = True
                if isinstance(event, http1.Upgraded):
                    await self.client.write(event.data)
                    await self._pipe(framer.trailing)
                    return False
                await self.client.write(event.data)
                if isinstance(event, http1.EndOfMessage):
                    return event.keep_alive and head.keep_alive and framer.reusable
            if not data:
                return False

    async def _pipe(self, first: bytes) -> None:
        """After a 101: plaintext both ways until either side is done."""
        assert self.client is not None and self.origin is not None
        client, origin = self.client, self.origin
        await client.write(first)

        async def copy(src: TlsEnd, dst: TlsEnd) -> None:
            while data := await src.read():
                await dst.write(data)

        tasks = [
            asyncio.ensure_future(copy(client, origin)),
            asyncio.ensure_future(copy(origin, client)),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()


def _with(head: http1.RequestHead, target: str, fields: list[tuple[str, str]]) -> http1.RequestHead:
    """`head` with its target and fields as rewritten (placeholders replaced)."""
    return http1.RequestHead(
        method=head.method,
        version=head.version,
        kind=head.kind,
        authority=head.authority,
        body=head.body,
        expect_continue=head.expect_continue,
        keep_alive=head.keep_alive,
        target=target,
        origin_target=target,
        headers=tuple(fields),
        connection_tokens=head.connection_tokens,
        upgrade=head.upgrade,
    )
