"""Per-connection glue for the HTTP and SOCKS5 listeners.

Each class feeds bytes to its sans-IO parser until a request is complete,
then decides (audited before any reply; see `Connection.begin`), dials the
checked addresses and either answers with a refusal or hands both
transports to the relay. Refusals close with a short linger so the reply is
not lost to a reset when the client has sent bytes the proxy will never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
from collections.abc import Callable, Sequence
from typing import Final, cast

from egressbox.audit.record import AuditProtocol, AuditRecord
from egressbox.core.decide import Decision
from egressbox.core.errors import AuditError, Reason, Verdict
from egressbox.core.hosts import INVALID_HOST_TEXT
from egressbox.core.ip import IPNetwork
from egressbox.core.local import LOOPBACK_ADDRESSES, LOOPBACK_NAME
from egressbox.core.synthetic import is_synthetic
from egressbox.net.deadlines import Deadline, wheel
from egressbox.net.dial import DialError
from egressbox.net.original import Destinations, destination_of
from egressbox.protocols import http1, socks5
from egressbox.protocols.proxy_header import (
    ProxyHeader,
    ProxyHeaderError,
    ProxyHeaderReader,
    is_trusted,
    unmapped,
)
from egressbox.proxy.gate import ProxyState, stderr_log
from egressbox.proxy.replies import (
    LINGER_BYTES,
    LINGER_SECONDS,
    dial_http_status,
    dial_socks_code,
    http_status,
    send_final,
    socks_code,
)
from egressbox.proxy.tunnel import Connection

# Enum members bound once (docs/development.md, "The compiled core's speed rules").
_CONNECT: Final = AuditProtocol.CONNECT
_DENY: Final = Verdict.DENY
_HTTP: Final = AuditProtocol.HTTP
_SOCKS5: Final = AuditProtocol.SOCKS5
_TCP: Final = AuditProtocol.TCP


class _Lingering(Connection):
    """A connection that can answer, then close without losing its answer."""

    def __init__(self, state: ProxyState) -> None:
        super().__init__(state)
        self.discarding = -1  # bytes dropped while lingering; -1 when not lingering

    def reply_and_close(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.cancel_timer()
        self.discarding = 0
        if not send_final(transport, data):  # the client is already gone: nothing to say
            transport.abort()
            return
        transport.resume_reading()
        self.timer = wheel(self.state.event_loop()).call_later(LINGER_SECONDS, self.close)

    def linger_received(self, data: bytes) -> bool:
        """True when `data` was dropped because the connection is lingering."""
        if self.discarding < 0:
            return False
        self.discarding += len(data)
        if self.discarding > LINGER_BYTES:
            self.close()
        return True

    def eof_received(self) -> bool:
        if self.discarding >= 0:
            self.close()
        return False


class HttpConnection(_Lingering):
    """The HTTP listener: CONNECT tunnels and absolute-form plain HTTP forwarding."""

    protocol_name = _CONNECT

    def __init__(self, state: ProxyState) -> None:
        super().__init__(state)
        self.parser = http1.RequestHeadParser(state.limits.max_head_bytes)

    def data_received(self, data: bytes) -> None:
        try:
            self._received(data)
        except Exception as exc:  # a bug must not leave the connection (and its slot) open
            self._internal_error(exc)

    def _received(self, data: bytes) -> None:
        if self.linger_received(data):
            return
        try:
            head = self.parser.feed(data)
        except http1.BadTargetPortError as port_error:
            # Its own name: compiled code types a name by its first `except`.
            self.start(functools.partial(self.bad_port, port_error.connect))
            return
        except http1.HttpError as exc:
            self.state.diagnostic(f"http: refused a malformed request ({exc.status}: {exc})")
            self.reply_and_close(http1.error_reply(exc.status, "bad_request", str(exc)))
            return
        if head is None:
            return
        if head.kind is http1.RequestKind.CONNECT:
            self.begin(head.host, head.port, self.parser.trailing)
        else:
            from egressbox.proxy.forward import start_forwarding

            self.protocol_name = _HTTP
            start_forwarding(self, head, self.parser.trailing)

    async def bad_port(self, connect: bool) -> None:
        """A target port outside 1-65535 is a decision (bad_port), audited like any other."""
        self.protocol_name = _CONNECT if connect else _HTTP
        self.refuse(self.bad_port_decision())

    def take_back(
        self, transport: asyncio.Transport, head: http1.RequestHead, to_upstream: bytes
    ) -> None:
        """A CONNECT after plain requests the forwarder served: this protocol takes the
        transport again and decides it (audited) like a first request."""
        self.transport = transport
        self.protocol_name = _CONNECT
        transport.set_protocol(self)
        self.begin(head.host, head.port, to_upstream)

    def refuse(self, decision: Decision) -> None:
        self.log_refusal(decision)
        status = http_status(decision.reason)
        self.reply_and_close(http1.error_reply(status, decision.reason.value, decision.detail))

    def dial_failed(self, decision: Decision, exc: DialError) -> None:
        self.log_refusal(decision, f"upstream: {exc}")
        status = dial_http_status(exc.reason.value)
        self.reply_and_close(http1.error_reply(status, exc.reason.value, str(exc)))

    def established(self, upstream: asyncio.Transport) -> bytes:
        return http1.connect_established()


class SocksConnection(_Lingering):
    """The SOCKS5 listener (RFC 1928, optional RFC 1929 credentials)."""

    protocol_name = _SOCKS5

    def __init__(self, state: ProxyState) -> None:
        super().__init__(state)
        self.machine = socks5.Socks5Server(state.socks_credentials)

    def data_received(self, data: bytes) -> None:
        try:
            self._received(data)
        except Exception as exc:  # a bug must not leave the connection (and its slot) open
            self._internal_error(exc)

    def _received(self, data: bytes) -> None:
        if self.linger_received(data):
            return
        events = self.machine.feed(data)
        out = self.machine.outgoing()
        for event in events:
            if isinstance(event, socks5.Rejected):
                self.rejected(event, out)
                return
            if isinstance(event, socks5.ConnectRequest):
                if out and self.transport is not None:
                    self.transport.write(out)
                self.begin(event.host, event.port, self.machine.trailing)
                return
        if out and self.transport is not None:
            self.transport.write(out)

    def rejected(self, event: socks5.Rejected, out: bytes) -> None:
        if event.reason is not None:
            # A malformed target is still a decision about a destination.
            self.audit_bad_target(event.reason)
        self.state.diagnostic(f"socks5: refused ({event.message})")
        self.reply_and_close(out)

    def audit_bad_target(self, reason: Reason) -> None:
        record = AuditRecord.create(self.protocol_name, INVALID_HOST_TEXT, 0, _DENY, reason)
        # On failure emit() has already stopped admission and said why.
        with contextlib.suppress(AuditError):
            self.state.emit(record)

    def refuse(self, decision: Decision) -> None:
        self.log_refusal(decision)
        self.reply_and_close(
            self.machine.reply_failure(socks5.ReplyCode(socks_code(decision.reason)))
        )

    def dial_failed(self, decision: Decision, exc: DialError) -> None:
        self.log_refusal(decision, f"upstream: {exc}")
        code = socks5.ReplyCode(dial_socks_code(exc.reason.value))
        self.reply_and_close(self.machine.reply_failure(code))

    def established(self, upstream: asyncio.Transport) -> bytes:
        host, port = upstream.get_extra_info("sockname")[:2]
        return self.machine.reply_success(host, port)


class CapturedConnection(Connection):
    """A connection the child made without the proxy, redirected to the capture listener in
    its namespace (`run` with capture), or connected there by the connect supervisor when it
    has no namespace (its destination then from `destinations`). Its original destination is
    the request: a synthetic address maps back to the name the child looked up (decided as
    `name:port`), any other address is an IP-literal request. Nothing is answered: an allowed
    connection simply works (dialled to the checked addresses, its TLS name checked); a
    refused one is reset."""

    protocol_name = _TCP

    def __init__(self, state: ProxyState, destinations: Destinations | None = None) -> None:
        super().__init__(state)
        self.destinations = destinations
        self.early = b""  # bytes the child sent before the decision began
        self.begun = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # Some loops start reading only after connection_made returns, undoing a pause
        # made in it: decide on the next turn of the loop, keeping what arrived meanwhile.
        self.state.event_loop().call_soon(self._decide)

    def _decide(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        try:
            host, port = self._destination()
        except (OSError, ValueError) as exc:
            self.state.diagnostic(f"tcp: no original destination ({exc}): closed")
            self.abort()
            return
        self.begun = True
        self.begin(host, port, self.early)

    def _destination(self) -> tuple[str, int]:
        assert self.transport is not None
        sock = self.transport.get_extra_info("socket")
        address, port = destination_of(sock, self.destinations)
        ip = ipaddress.ip_address(address)
        names = self.state.synthetic
        name = names.name_for(ip) if names is not None else None
        if name is None and is_synthetic(ip):
            # An address we never gave out (guessed, or from an earlier run): no name to
            # decide, and the address itself is special: the gate refuses it.
            return address, port
        if name is None and self._as_localhost(ip, port):
            return LOOPBACK_NAME, port
        return name or address, port

    def _as_localhost(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> bool:
        """Whether a connection to 127.0.0.1 or ::1 is decided as `localhost:port`.

        The child's /etc/hosts (confine/grants.py CAPTURE_HOSTS) maps localhost to these, so
        `curl http://localhost:PORT` arrives here as the address, never as the name. When no
        allow or deny entry names the address on that port but `localhost:PORT` is admitted,
        the connection is the one that entry means: it is decided (and audited) by that
        name, whose addresses are then checked like any other (allow_cidrs)."""
        policy = self.state.policy
        if policy is None or ip not in LOOPBACK_ADDRESSES:
            return False
        named = policy.allow.match_ip(ip, port) or policy.deny.match_ip(ip, port)
        if named is not None:
            return False
        return policy.allow.match_name(LOOPBACK_NAME, port) is not None

    def data_received(self, data: bytes) -> None:
        if self.begun:  # reading is paused from begin() on: nothing can come after it
            self._internal_error(RuntimeError("bytes after the decision began"))
            return
        self.early += data
        if len(self.early) > self.state.limits.max_head_bytes:
            assert self.transport is not None
            self.transport.pause_reading()  # the decision comes on the next turn

    def refuse(self, decision: Decision) -> None:
        self.log_refusal(decision)
        self.abort()  # a reset: the nearest a TCP client gets to "refused"

    def dial_failed(self, decision: Decision, exc: DialError) -> None:
        self.log_refusal(decision, f"upstream: {exc}")
        self.abort()

    def established(self, upstream: asyncio.Transport) -> bytes:
        return b""  # the child's connect already succeeded; the bytes flow as they come


# -- the PROXY protocol in front of the HTTP and SOCKS5 listeners (serve --proxy-protocol) --

# Causes of a refusal before the header is read, beside ProxyHeaderError's (stable:
# counted in ProxyHeaderGate.refusals and documented in README "PROXY protocol").
UNTRUSTED_SOURCE = "untrusted_source"
HEADER_TIMEOUT = "header_timeout"
CLOSED_BEFORE_HEADER = "closed_before_header"


class ProxyHeaderGate:
    """Who may open a connection (the trusted balancers) and what was refused, by cause.

    A refusal is no destination decision (no destination was asked for), so it is not
    audited: it is counted here, and the first of each cause is said on stderr."""

    def __init__(self, trusted: Sequence[IPNetwork]) -> None:
        self.trusted = tuple(trusted)
        self.refusals: dict[str, int] = {}

    def trusts(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return is_trusted(ip, self.trusted)

    def refused(self, cause: str, peer: str, message: str) -> None:
        count = self.refusals.get(cause, 0) + 1
        self.refusals[cause] = count
        if count == 1:
            stderr_log(
                f"proxy protocol: refused a connection from {peer}: {message} ({cause}; "
                "later refusals for this cause are counted, not said)"
            )


class ProxyHeaderConnection(asyncio.Protocol):
    """A connection until its PROXY protocol header is read: then the listener's own
    protocol takes the transport, with the client the header names (for
    max_connections_per_client and diagnostics) and the bytes after the header.

    Held in state.connections meanwhile (the drain and max_connections count it); the
    header must come within [limits] head_timeout, and the request head then gets the
    listener's own head_timeout."""

    def __init__(
        self,
        state: ProxyState,
        gate: ProxyHeaderGate,
        listener: Callable[[ProxyState], Connection],
    ) -> None:
        self.state = state
        self.gate = gate
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.timer: Deadline | None = None
        self.reader = ProxyHeaderReader()
        self.peer = "-"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        ip = _peer_ip(peer)
        self.peer = str(ip) if ip is not None else "-"
        if ip is None or not self.gate.trusts(ip):
            self._refuse(UNTRUSTED_SOURCE, "not a trusted sender (--proxy-protocol-from)")
            return
        state = self.state
        state.connections.add(self)
        timeout = state.limits.head_timeout
        self.timer = wheel(state.event_loop()).call_later(timeout, self._timed_out)

    def data_received(self, data: bytes) -> None:
        try:
            header = self.reader.feed(data)
        except ProxyHeaderError as exc:
            self._refuse(exc.cause, str(exc))
            return
        except Exception as exc:  # a bug must not leave the connection (and its slot) open
            self.state.internal_error("proxy protocol", exc)
            self.abort()
            return
        if header is not None:
            self._hand_over(header)

    def eof_received(self) -> bool:
        self._refuse(CLOSED_BEFORE_HEADER, "the sender closed before a whole header")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.state.connections.discard(self)

    def target(self) -> None:
        return None  # nothing is connected yet

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _timed_out(self) -> None:
        self.timer = None
        self._refuse(HEADER_TIMEOUT, "no whole header within [limits] head_timeout")

    def _refuse(self, cause: str, message: str) -> None:
        self._cancel_timer()
        self.gate.refused(cause, self.peer, message)
        self.abort()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _hand_over(self, header: ProxyHeader) -> None:
        transport = self.transport
        assert transport is not None
        self._cancel_timer()
        self.state.connections.discard(self)
        self.transport = None
        conn = self.listener(self.state)
        source = header.source
        # LOCAL (or UNKNOWN): the balancer's own connection, so it is the client.
        conn.client = self.peer if header.local or source is None else str(unmapped(source[0]))
        transport.set_protocol(conn)
        conn.connection_made(transport)
        rest = self.reader.trailing
        if rest and not transport.is_closing():
            conn.data_received(rest)


def _peer_ip(peer: object) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if not isinstance(peer, tuple) or not peer:
        return None
    try:
        return unmapped(ipaddress.ip_address(str(peer[0]).partition("%")[0]))
    except ValueError:
        return None
