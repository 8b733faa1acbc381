"""A client connection until it becomes a tunnel: CONNECT and SOCKS5 (listeners.py), a
captured connection (capture), a CONNECT after plain requests (forward.py).

A tunnel request goes `begin()` -> the gate (synchronously when no DNS query is needed, else in
one Task) -> `proceed()` -> `start_connect` with the relay's upstream protocol -> `_dialed()`,
the TLS name check on the first client bytes, then the relay. Subclasses say how to refuse and
what to answer on success.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Final, cast

from egressbox.audit.record import (
    AuditProtocol,
)
from egressbox.core.decide import Decision, bad_target
from egressbox.core.errors import AuditError, HostError, Reason
from egressbox.core.hosts import format_authority
from egressbox.net.deadlines import Deadline, wheel
from egressbox.net.dial import DialError, Dialing, start_connect
from egressbox.net.relay import (
    Tunnel,
    new_tunnel,
    open_tunnel_with_upstream,
)
from egressbox.protocols import http1
from egressbox.proxy.check import Pending
from egressbox.proxy.gate import OpenTarget, ProxyState, _watch_tunnel, gate_audited, gate_now

# Imported at run time: compiled dataclasses resolve their field types.
from egressbox.proxy.tls_check import FirstBytes, checks_names
from egressbox.proxy.upstream import UpstreamDial, dial_through

# Enum members bound once (docs/development.md, "The compiled core's speed rules").
_AUDIT_UNAVAILABLE: Final = Reason.AUDIT_UNAVAILABLE
_BAD_PORT: Final = Reason.BAD_PORT
_CONNECT: Final = AuditProtocol.CONNECT
_TCP: Final = AuditProtocol.TCP
_TOO_MANY_CONNECTIONS: Final = Reason.TOO_MANY_CONNECTIONS


class Connection(asyncio.Protocol):
    """Common state of a client connection before it becomes a tunnel.

    A tunnel request goes `begin()` -> decision (synchronously when no DNS
    query is needed, else in one Task) -> `proceed()` -> `start_connect` with
    the relay's upstream protocol -> `_dialed()` hands both transports to the
    relay. Subclasses say how to refuse and what to answer on success.
    """

    protocol_name = _CONNECT

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.transport: asyncio.Transport | None = None
        self.timer: Deadline | None = None
        self.task: asyncio.Task[None] | None = None
        # UpstreamDial when chaining (an interpreted class: not a compiled Dialing).
        self.dialing: Dialing | UpstreamDial | None = None
        self.dialed: Decision | None = None  # what `dialing` (or `first`) was admitted by
        self.first: FirstBytes | None = None  # the TLS name check between reply and relay
        self.over_limit = False
        self.client = ""  # the peer's address, counted in state.per_client until left()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport: cast, don't check.
        self.transport = cast(asyncio.Transport, transport)
        state = self.state
        if not self.client:  # else a PROXY protocol header named the real client
            peer = transport.get_extra_info("peername")
            self.client = str(peer[0]) if peer else "-"
        over_client = state.client_opened(self.client)
        self.over_limit = state.over_limit() or over_client
        state.connections.add(self)
        # Slowloris: the whole head or handshake must arrive in time.
        self.timer = wheel(state.event_loop()).call_later(
            state.limits.head_timeout, self.head_timed_out
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.left()
        self.cancel_timer()

    def left(self) -> None:
        """The client connection is gone (from whichever protocol held it last)."""
        if self in self.state.connections:
            self.state.connections.discard(self)
            self.state.client_closed(self.client)

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def head_timed_out(self) -> None:
        self.timer = None
        self.state.diagnostic(f"{self.protocol_name}: no complete request within the head timeout")
        self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def target(self) -> OpenTarget | None:
        """The target of a dial in flight or of a tunnel waiting for its first bytes
        (after that, the tunnel answers for it)."""
        decision = self.dialed
        if (self.dialing is None and self.first is None) or decision is None:
            return None
        return OpenTarget(self.protocol_name, decision.host, decision.port, decision.addresses)

    def abort(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.dialing is not None:
            self.dialing.cancel()
            self.dialing = None
        if self.transport is not None:
            self.transport.abort()

    def start(self, work: Callable[[], object]) -> None:
        """Stop reading, then decide and answer in one Task."""
        self.cancel_timer()
        assert self.transport is not None
        self.transport.pause_reading()
        coro = work()
        assert asyncio.iscoroutine(coro)
        self.task = asyncio.get_running_loop().create_task(self._guard(coro))

    async def _guard(self, coro: object) -> None:
        try:
            await coro  # type: ignore[misc]
        except asyncio.CancelledError:
            self.abort()
        except Exception as exc:  # a bug must not kill the server
            self._internal_error(exc)

    def _internal_error(self, exc: Exception) -> None:
        self.state.internal_error(str(self.protocol_name), exc)
        self.abort()

    def failed(self, exc: Exception) -> None:
        """A bug caught in a callback of this connection's FirstBytes."""
        self._internal_error(exc)

    # -- the tunnel path: no Task unless the decision needs DNS -------------------

    def begin(self, host: str, port: int | str, to_upstream: bytes) -> None:
        """Stop reading; decide (audited) and go on to proceed(), in a Task only for DNS."""
        self.cancel_timer()
        assert self.transport is not None
        self.transport.pause_reading()
        try:
            decided = self.decide_now(host, port)
            if isinstance(decided, Pending):
                self.start(lambda: self._decide_later(decided, host, port, to_upstream))
            else:
                self.proceed(decided, to_upstream)
        except Exception as exc:  # a bug must not kill the server
            self._internal_error(exc)

    async def _decide_later(
        self, pending: Pending, host: str, port: int | str, to_upstream: bytes
    ) -> None:
        decision = self._audited(await pending.finish(), host, port)
        self.task = None
        self.proceed(decision, to_upstream)

    def proceed(self, decision: Decision, to_upstream: bytes) -> None:
        """After the audited decision: refuse, or dial and hand over to the relay."""
        if not decision.allowed:
            self.refuse(decision)
            return
        transport = self.transport
        if transport is None or transport.is_closing():
            return  # the client left while the decision was made: nothing to dial
        state = self.state
        broker = state.broker
        if (
            broker is not None
            and state.upstream is None
            and broker.terminates(decision.host, decision.port)
        ):
            # A host a secret is bound to (or with request rules): TLS terminated, each
            # request read and judged (proxy/terminate.py). Not through an upstream proxy.
            from egressbox.proxy.terminate import start_terminating

            start_terminating(self, decision, to_upstream)
            return
        loop = state.event_loop()
        tunnel = new_tunnel(idle_timeout=state.limits.idle_timeout, loop=loop)
        self.dialed = decision
        on_done = functools.partial(self._dialed, tunnel, decision, to_upstream)
        if state.upstream is not None:  # chaining: the same decision, the last hop differs
            self.dialing = dial_through(
                state.upstream,
                state.resolver,
                decision,
                tunnel.upstream_protocol,
                on_done,
                timeout=state.limits.connect_timeout,
                loop=loop,
            )
            return
        self.dialing = start_connect(
            decision.addresses,
            decision.port,
            tunnel.upstream_protocol,
            on_done,
            timeout=state.limits.connect_timeout,
            loop=loop,
        )

    def _dialed(
        self,
        tunnel: Tunnel,
        decision: Decision,
        to_upstream: bytes,
        upstream: asyncio.Transport | None,
        error: DialError | None,
    ) -> None:
        self.dialing = self.dialed = None
        try:
            if upstream is None:
                assert error is not None
                self.dial_failed(decision, error)
            else:
                self._hand_over(tunnel, decision, to_upstream, upstream)
        except Exception as exc:  # a bug must not kill the server
            if upstream is not None:
                upstream.abort()
            self._internal_error(exc)

    def _hand_over(
        self, tunnel: Tunnel, decision: Decision, to_upstream: bytes, upstream: asyncio.Transport
    ) -> None:
        transport, state = self.transport, self.state
        if transport is None or transport.is_closing():
            # The client left (say, a reset) while the dial was in flight.
            upstream.abort()
            return
        policy = state.policy
        if policy is not None and checks_names(policy):
            # The reply goes out now; the relay starts once the client's first bytes
            # pass the TLS name check (sni.py), before any of them goes upstream.
            self.dialed = decision
            self.first = FirstBytes(
                self,
                tunnel,
                decision,
                transport,
                upstream,
                policy=policy,
                timeout=state.limits.head_timeout,
                loop=state.event_loop(),
                protocol=str(self.protocol_name),
                log=state.diagnostic if state.log is not None else None,
                # A captured connection's target is the name the child looked up: a plain
                # HTTP request on it must name that host too.
                check_host=self.protocol_name is _TCP,
            )
            self.first.start(self.established(upstream), to_upstream)
            return
        self.start_relay(
            tunnel, decision, upstream, to_upstream, to_client=self.established(upstream)
        )

    def start_relay(
        self,
        tunnel: Tunnel,
        decision: Decision,
        upstream: asyncio.Transport,
        to_upstream: bytes,
        *,
        to_client: bytes = b"",
        client_eof: bool = False,
    ) -> None:
        """Hand the client's transport and the upstream to the relay."""
        self.first = self.dialed = None
        transport, state = self.transport, self.state
        if transport is None or transport.is_closing():
            upstream.abort()
            return
        try:
            open_tunnel_with_upstream(
                tunnel,
                transport,
                upstream,
                initial_to_upstream=to_upstream,
                initial_to_client=to_client,
                client_eof=client_eof,
            )
        except ValueError:  # the upstream is already aborted
            transport.abort()
            return
        # The relay has the client's transport now (our connection_lost will
        # not run): count it as a tunnel in the same step (its client's count goes
        # with it, released when the tunnel ends).
        state.connections.discard(self)
        _watch_tunnel(state, tunnel, self.protocol_name, decision, self.client)
        # Nothing of this Connection may stay reachable from the tunnel (idle
        # tunnel memory), and the tunnel must not keep it alive either.
        self.transport = None

    def take_back(
        self, transport: asyncio.Transport, head: http1.RequestHead, to_upstream: bytes
    ) -> None:
        """A CONNECT after plain requests the forwarder served (the HTTP listener's own)."""
        raise NotImplementedError

    def refuse(self, decision: Decision) -> None:
        """Answer a denied decision and close (the listener's own reply)."""
        raise NotImplementedError

    def dial_failed(self, decision: Decision, exc: DialError) -> None:
        """Answer a failed dial and close (the listener's own reply)."""
        raise NotImplementedError

    def established(self, upstream: asyncio.Transport) -> bytes:
        """The reply that opens the tunnel (the listener's own)."""
        raise NotImplementedError

    # -- shared steps ------------------------------------------------------------

    def decide_now(self, host: str, port: int | str) -> Decision | Pending:
        """The audited decision if it needs no DNS query, else a Pending to finish
        (then audit it with decide()'s rules: see _audited)."""
        return gate_now(
            self.state,
            self.protocol_name,
            host,
            port,
            over_limit=self.over_limit,
            client=self.client,
        )

    def _audited(self, decision: Decision, host: str, port: int | str) -> Decision:
        return gate_audited(self.state, self.protocol_name, decision, host, port)

    def bad_port_decision(self) -> Decision:
        """A target port outside 1-65535 is a decision (bad_port), audited like any other."""
        message = "bad port: use a decimal number from 1 to 65535"
        decision = bad_target(HostError(_BAD_PORT, message))
        try:
            self.record(decision)
        except AuditError:
            decision = bad_target(HostError(_AUDIT_UNAVAILABLE, "audit log unavailable"))
        return decision

    async def decide(self, host: str, port: int | str) -> Decision:
        """The decision for a target, audited before any reply goes out."""
        decided = self.decide_now(host, port)
        if isinstance(decided, Pending):
            return self._audited(await decided.finish(), host, port)
        return decided

    def record(self, decision: Decision) -> None:
        """Write the decision's audit record (raises AuditError when the sink fails)."""
        self.state.emit_decision(self.protocol_name, decision)

    def log_refusal(self, decision: Decision, extra: str = "") -> None:
        if self.state.log is None:
            return  # no diagnostics wanted: build no text
        target = format_authority(decision.host, decision.port) if decision.port else decision.host
        if decision.reason is _TOO_MANY_CONNECTIONS:
            # Which client is over its cap (behind a balancer: the one the PROXY header named).
            extra = f"client {self.client}" + (f"; {extra}" if extra else "")
        tail = f" ({extra})" if extra else ""
        self.state.diagnostic(
            f"{self.protocol_name} {target} {decision.verdict.value} {decision.reason.value}{tail}"
        )
