"""The egress proxy: listeners, per-connection glue, limits, drain and reload.

No parsing and no matching happens here: the sans-IO parsers in
`protocols/` turn bytes into requests, `egress.check` decides, `dial`
connects to the checked addresses only, `relay` pumps bytes. This module
wires them together, enforces the limits and writes one audit record per
decision before any reply goes out.

Connections start on a small asyncio Protocol (no Task while a client is
slow to send its head). Once a tunnel request is complete, the decision is
made right there when it needs no DNS query (else in one Task), the dial
reports by callback, and the tunnel then runs on the relay's protocol pair
with no Task at all. Plain HTTP forwarding runs in one Task per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ipaddress
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, cast

from egressbox.audit import (
    AuditProtocol,
    AuditRecord,
    AuditSink,
    JsonlFileSink,
    StreamSink,
    decision_line,
)
from egressbox.decide import Decision, SelfEndpoints, bad_target, deny, parse_target
from egressbox.dial import DialError, Dialing, start_connect
from egressbox.egress import Pending, check_now, recheck
from egressbox.errors import AuditError, HostError, Reason
from egressbox.hosts import IPAddress, format_authority
from egressbox.limits import Limits
from egressbox.netinfo import local_addresses
from egressbox.policy import Policy
from egressbox.relay import (
    RelayStats,
    Tunnel,
    new_tunnel,
    open_tunnel_with_upstream,
)

# Imported at run time: compiled dataclasses resolve their field types.
from egressbox.resolve import Resolution, Resolver
from egressbox.sni import FirstBytes, checks_names

Log = Callable[[str], None]
RecordCallback = Callable[[AuditRecord], None]
Credentials = Callable[[str, str], bool]

# After an audit failure, how often the file sink is asked whether it can be
# written again (space freed): then admission resumes.
AUDIT_RETRY_SECONDS = 1.0

# Listen backlog: large enough for a burst of short tunnels from a parallel
# build (Linux caps it at net.core.somaxconn, 4096 by default).
LISTEN_BACKLOG = 1024


class OpenTarget(NamedTuple):
    """What an open connection is connected (or being connected) to, as decided:
    for EgressProxy.close_denied to judge again."""

    protocol: AuditProtocol
    host: str
    port: int
    addresses: tuple[IPAddress, ...]  # the checked addresses it was admitted with


class Held(Protocol):
    """An open connection that close_denied() can judge again and close."""

    def target(self) -> OpenTarget | None: ...

    def abort(self) -> None: ...


def stderr_log(line: str) -> None:
    # stderr only: stdout carries nothing but the ready line (and records on request).
    sys.stderr.write(f"egressbox: {line}\n")
    sys.stderr.flush()


@dataclass
class ProxyState:
    """What every connection shares; swapped atomically by set_policy()."""

    policy: Policy | None
    resolver: Resolver
    limits: Limits
    audit: AuditSink | None
    on_record: RecordCallback | None
    log: Log | None
    socks_credentials: Credentials | None
    self_endpoints: SelfEndpoints = field(default_factory=SelfEndpoints)
    audit_error: str | None = None
    # When a failed audit log may next be asked whether it recovered (monotonic).
    audit_retry_at: float = 0.0
    connections: set[Connection] = field(default_factory=set)
    # Open tunnels, each with its done callback, which knows its target.
    tunnels: dict[Tunnel, _TunnelEnd] = field(default_factory=dict)
    # Plain HTTP forwarding connections (forward.Forwarder), for close_denied.
    forwarders: set[Held] = field(default_factory=set)
    accepting: bool = True
    # Connections the descriptor limit leaves room for (see fd_capacity).
    fd_capacity: int = 1 << 62
    # The loop the listeners run on, once started: on Python 3.11 every
    # asyncio.get_running_loop() costs a getpid() system call.
    loop: asyncio.AbstractEventLoop | None = None
    # Open connections and tunnels per client address (for max_connections_per_client).
    per_client: dict[str, int] = field(default_factory=dict)
    # Bugs caught in a connection's callbacks (each closed that connection).
    internal_errors: int = 0
    # The diagnostic line of an allowed connection too (else refusals only).
    log_allowed: bool = True

    def event_loop(self) -> asyncio.AbstractEventLoop:
        return self.loop or asyncio.get_running_loop()

    def over_limit(self) -> bool:
        """True when one more connection would exceed max_connections or the fd budget
        (asked before adding it): an excess client is refused with 503 and audited,
        instead of the process running into EMFILE."""
        capacity = min(self.limits.max_connections, self.fd_capacity)
        return len(self.connections) + len(self.tunnels) >= capacity

    def client_opened(self, client: str) -> bool:
        """Count a new connection from `client`; True when it is over the per-client cap."""
        count = self.per_client.get(client, 0) + 1
        self.per_client[client] = count
        cap = self.limits.max_connections_per_client
        return 0 < cap < count

    def client_closed(self, client: str) -> None:
        count = self.per_client.get(client, 0) - 1
        if count > 0:
            self.per_client[client] = count
        else:
            self.per_client.pop(client, None)

    def internal_error(self, what: str, exc: BaseException) -> None:
        """A bug caught in a connection's callback: counted, and said once on stderr (the
        caller closes that connection, so its slot comes back)."""
        self.internal_errors += 1
        stderr_log(f"internal error on a {what} connection (closed it): {exc!r}")

    def emit(self, record: AuditRecord) -> None:
        """Write one audit record; on failure stop admitting anything (and say why)."""
        try:
            if self.audit is not None:
                self.audit.write(record)
        except AuditError as exc:
            self._audit_failed(exc)
            raise
        if self.on_record is not None:
            self.on_record(record)

    def emit_decision(self, protocol: AuditProtocol, decision: Decision) -> None:
        """emit() for a decision's record, without building an AuditRecord when nobody
        needs the object: a file or stream sink and no on_record callback get the line
        formatted directly (the same bytes; measured ~2 us less per decision)."""
        audit = self.audit
        if self.on_record is None and (type(audit) is JsonlFileSink or type(audit) is StreamSink):
            line = decision_line(
                protocol,
                decision.host,
                decision.port,
                decision.verdict,
                decision.reason,
                now_ns=time.time_ns(),
            )
            if line is not None:
                try:
                    audit.write_json(line)
                except AuditError as exc:
                    self._audit_failed(exc)
                    raise
                return
        record = AuditRecord.create(
            protocol, decision.host, decision.port, decision.verdict, decision.reason
        )
        self.emit(record)

    def audit_recovered(self) -> bool:
        """After an audit failure: True once the log can be written again (admission
        resumes). A file sink is asked (can_write) at most every AUDIT_RETRY_SECONDS;
        any other sink never recovers."""
        audit = self.audit
        if not isinstance(audit, JsonlFileSink):
            return False
        now = time.monotonic()
        if now < self.audit_retry_at:
            return False
        self.audit_retry_at = now + AUDIT_RETRY_SECONDS
        if not audit.can_write():
            return False
        self.audit_error = None
        stderr_log("audit log can be written again; admitting new connections")
        return True

    def _audit_failed(self, exc: AuditError) -> None:
        if self.audit_error is None:
            self.audit_error = str(exc)
            stderr_log(f"audit log cannot be written ({exc}); refusing new connections")

    def diagnostic(self, line: str) -> None:
        if self.log is not None:
            self.log(line)


class Connection(asyncio.Protocol):
    """Common state of a client connection before it becomes a tunnel.

    A tunnel request goes `begin()` -> decision (synchronously when no DNS
    query is needed, else in one Task) -> `proceed()` -> `start_connect` with
    the relay's upstream protocol -> `_dialed()` hands both transports to the
    relay. Subclasses say how to refuse and what to answer on success.
    """

    protocol_name = AuditProtocol.CONNECT

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        self.dialing: Dialing | None = None
        self.dialed: Decision | None = None  # what `dialing` (or `first`) was admitted by
        self.first: FirstBytes | None = None  # the TLS name check between reply and relay
        self.over_limit = False
        self.client = ""  # the peer's address, counted in state.per_client until left()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport: cast, don't check.
        self.transport = cast(asyncio.Transport, transport)
        state = self.state
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if peer else "-"
        over_client = state.client_opened(self.client)
        self.over_limit = state.over_limit() or over_client
        state.connections.add(self)
        # Slowloris: the whole head or handshake must arrive in time.
        self.timer = state.event_loop().call_later(state.limits.head_timeout, self.head_timed_out)

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
        loop = state.event_loop()
        tunnel = new_tunnel(idle_timeout=state.limits.idle_timeout, loop=loop)
        self.dialed = decision
        self.dialing = start_connect(
            decision.addresses,
            decision.port,
            tunnel.upstream_protocol,
            functools.partial(self._dialed, tunnel, decision, to_upstream),
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
        return gate_now(self.state, self.protocol_name, host, port, over_limit=self.over_limit)

    def _audited(self, decision: Decision, host: str, port: int | str) -> Decision:
        return gate_audited(self.state, self.protocol_name, decision, host, port)

    def bad_port_decision(self) -> Decision:
        """A target port outside 1-65535 is a decision (bad_port), audited like any other."""
        message = "bad port: use a decimal number from 1 to 65535"
        decision = bad_target(HostError(Reason.BAD_PORT, message))
        try:
            self.record(decision)
        except AuditError:
            decision = bad_target(HostError(Reason.AUDIT_UNAVAILABLE, "audit log unavailable"))
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
        tail = f" ({extra})" if extra else ""
        self.state.diagnostic(
            f"{self.protocol_name} {target} {decision.verdict.value} {decision.reason.value}{tail}"
        )


# Descriptors kept free of connections: listeners, the audit log, DNS
# sockets, the relay's pipe pool (64 pipes = 128 fds) and some slack.
FD_RESERVE = 256


def fd_capacity(nofile: int) -> int:
    """How many connections fit in `nofile` descriptors: two each (client and
    upstream), after FD_RESERVE. At least 1, so a tiny limit still serves."""
    return max(1, (nofile - FD_RESERVE) // 2)


def _soft_nofile() -> int:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _watch_tunnel(
    state: ProxyState, tunnel: Tunnel, protocol: AuditProtocol, decision: Decision, client: str
) -> None:
    """Track the tunnel; untrack it and log its one diagnostic line when it ends."""
    end = _TunnelEnd(state, tunnel, protocol, decision, client)
    state.tunnels[tunnel] = end
    tunnel.done.add_done_callback(end)


class _TunnelEnd:
    """The tunnel's done callback. The fields, not the Decision (nor prebuilt
    text), wait with an idle tunnel; the line is built only if someone reads it.
    They also tell close_denied() what the tunnel is connected to."""

    __slots__ = (
        "addresses",
        "client",
        "host",
        "port",
        "protocol",
        "reason",
        "state",
        "tunnel",
        "verdict",
    )

    def __init__(
        self,
        state: ProxyState,
        tunnel: Tunnel,
        protocol: AuditProtocol,
        decision: Decision,
        client: str,
    ) -> None:
        self.state = state
        self.client = client
        self.tunnel = tunnel
        self.protocol = protocol
        self.host = decision.host
        self.port = decision.port
        self.verdict = decision.verdict
        self.reason = decision.reason
        # The decision's own tuple (no copy): the addresses the dial chose from.
        self.addresses = decision.addresses

    def target(self) -> OpenTarget:
        return OpenTarget(self.protocol, self.host, self.port, self.addresses)

    def __call__(self, done: asyncio.Future[RelayStats]) -> None:
        state = self.state
        state.tunnels.pop(self.tunnel, None)
        state.client_closed(self.client)
        if state.log is None or not state.log_allowed:
            return
        stats = done.result()
        state.diagnostic(
            f"{self.protocol} {format_authority(self.host, self.port)} {self.verdict.value}"
            f" {self.reason.value} up={stats.bytes_up} down={stats.bytes_down} "
            f"{stats.duration:.3f}s closed_by={stats.closed_by.value}"
        )


# -- the gate: every request of every listener is decided and audited here -------------


def gate_now(
    state: ProxyState,
    protocol: AuditProtocol,
    host: str,
    port: int | str,
    *,
    over_limit: bool = False,
    record_port: int | None = None,
) -> Decision | Pending:
    """The audited decision for `host:port` if it needs no DNS query, else a Pending to
    finish and pass to gate_audited(). The proxy's own state (an audit log that cannot be
    written, too many connections) refuses like any other decision. `record_port` replaces
    the port in the audit record (a DNS question has none: 0)."""
    if state.audit_error is not None and not state.audit_recovered():
        return _refusal(host, port, Reason.AUDIT_UNAVAILABLE, state.audit_error)
    if over_limit:
        decision = _refusal(host, port, Reason.TOO_MANY_CONNECTIONS, "too many connections")
    else:
        decided = check_now(
            state.policy, state.resolver, host, port, self_endpoints=state.self_endpoints
        )
        if isinstance(decided, Pending):
            return decided
        decision = decided
    return gate_audited(state, protocol, decision, host, port, record_port=record_port)


def gate_audited(
    state: ProxyState,
    protocol: AuditProtocol,
    decision: Decision,
    host: str,
    port: int | str,
    *,
    record_port: int | None = None,
) -> Decision:
    """Write the decision's record before anything answers; when it cannot be written,
    nothing is admitted (audit_unavailable)."""
    recorded = decision if record_port is None else dataclasses.replace(decision, port=record_port)
    try:
        state.emit_decision(protocol, recorded)
    except AuditError:
        return _refusal(host, port, Reason.AUDIT_UNAVAILABLE, state.audit_error or "")
    return decision


def _refusal(host: str, port: int | str, reason: Reason, detail: str) -> Decision:
    try:
        target = parse_target(host, port)
    except HostError as exc:
        return bad_target(exc, port)
    return deny(reason, target, detail)


# -- the proxy ---------------------------------------------------------------------


@dataclass(frozen=True)
class Listener:
    kind: str  # "http" | "socks5"
    address: tuple[str, int]

    @property
    def authority(self) -> str:
        return format_authority(self.address[0], self.address[1])


class EgressProxy:
    """An egress proxy with HTTP (CONNECT and plain forwarding) and SOCKS5 listeners.

        async with EgressProxy(policy, keep_records=True) as proxy:
            ... proxy.http_url, proxy.socks_url, proxy.records ...

    Ports default to 0 (the OS picks a free one); `listen` defaults to
    127.0.0.1, never a wildcard (that would be an open proxy). Pre-bound
    listening sockets (from the confinement launcher) can be served instead.
    """

    def __init__(
        self,
        policy: Policy | None,
        *,
        listen: str = "127.0.0.1",
        http_port: int | None = 0,
        socks_port: int | None = 0,
        resolver: Resolver | None = None,
        audit: AuditSink | None = None,
        on_record: RecordCallback | None = None,
        keep_records: bool = False,
        log: Log | None = None,
        socks_credentials: Credentials | None = None,
        http_sockets: Sequence[socket.socket] = (),
        socks_sockets: Sequence[socket.socket] = (),
        limits: Limits | None = None,
        log_allowed: bool = True,
    ) -> None:
        """`log` gets one line per connection; with `log_allowed` False only refusals (the
        audit records have everything)."""
        self.records: list[AuditRecord] = []
        if keep_records:
            on_record = _chain(self.records.append, on_record)
        self._listen = listen
        self._ports = {"http": http_port, "socks5": socks_port}
        self._given = {"http": list(http_sockets), "socks5": list(socks_sockets)}
        self._own_resolver = resolver is None
        self.state = ProxyState(
            policy=policy,
            resolver=resolver or default_resolver(policy),
            limits=limits or (policy.limits if policy is not None else Limits()),
            audit=audit,
            on_record=on_record,
            log=log,
            socks_credentials=socks_credentials,
            log_allowed=log_allowed,
        )
        self._servers: list[asyncio.Server] = []
        self.listeners: list[Listener] = []

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        from egressbox.connections import HttpConnection, SocksConnection

        factories = {"http": HttpConnection, "socks5": SocksConnection}
        try:
            for kind, factory in factories.items():
                for sock in self._sockets(kind):
                    await self._serve(kind, sock, factory)
        except GeneratorExit:
            self.abort()  # the coroutine is being finalized: nothing may be awaited
            raise
        except BaseException:
            await self.close(0)
            raise
        self.state.self_endpoints = self._self_endpoints()
        self.state.loop = asyncio.get_running_loop()
        self.state.fd_capacity = fd_capacity(_soft_nofile())

    def _sockets(self, kind: str) -> list[socket.socket]:
        given = self._given[kind]
        if given:
            return given
        port = self._ports[kind]
        if port is None:
            return []
        try:
            return [bind_listener(self._listen, port)]
        except OSError as exc:
            # Say which address: "Address already in use" alone does not.
            where = format_authority(self._listen, port)
            raise OSError(exc.errno, f"{kind} listener on {where}: {exc.strerror}") from None

    async def _serve(self, kind: str, sock: socket.socket, factory: type[Connection]) -> None:
        state = self.state
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: factory(state), sock=sock, backlog=LISTEN_BACKLOG)
        self._servers.append(server)
        name = sock.getsockname()
        self.listeners.append(Listener(kind, (_unmapped_text(name[0]), name[1])))

    def _self_endpoints(self) -> SelfEndpoints:
        pairs: set[tuple[IPAddress, int]] = set()
        wildcard: set[int] = set()
        for listener in self.listeners:
            ip = ipaddress.ip_address(listener.address[0])
            if ip.is_unspecified:
                wildcard.add(listener.address[1])
            pairs.add((ip, listener.address[1]))
        local = frozenset(local_addresses()) if wildcard else frozenset()
        return SelfEndpoints(frozenset(pairs), frozenset(wildcard), local)

    async def close(self, drain_timeout: float | None = None) -> None:
        """Stop accepting, let open connections finish for drain_timeout, abort the rest."""
        state = self.state
        state.accepting = False
        for server in self._servers:
            server.close()
        timeout = state.limits.drain_timeout if drain_timeout is None else drain_timeout
        deadline = time.monotonic() + timeout
        while (state.connections or state.tunnels) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.abort()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        await asyncio.sleep(0)  # let aborted transports run connection_lost
        self._servers.clear()

    def abort(self) -> None:
        """Stop accepting and abort every connection at once, awaiting nothing.

        For a caller that cannot await (a run torn down while its event loop
        closes: then each step is best effort); close() is the orderly way.
        """
        state = self.state
        state.accepting = False
        # A closed loop refuses to schedule the transports' callbacks: go on.
        for server in self._servers:
            with contextlib.suppress(RuntimeError):
                server.close()
        for conn in list(state.connections):
            with contextlib.suppress(RuntimeError):
                conn.abort()
        for tunnel in list(state.tunnels):
            with contextlib.suppress(RuntimeError):
                tunnel.abort()

    async def __aenter__(self) -> EgressProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- views and controls --------------------------------------------------------

    def set_policy(self, policy: Policy, *, close_denied: bool = False) -> int:
        """Swap the policy atomically: connections decided from now on use it.

        Its [limits] apply to new connections; its [dns] settings replace the
        resolver unless the caller supplied one. With `close_denied`, open
        connections it would not admit are closed too (see close_denied());
        returns how many were closed.
        """
        state = self.state
        old = state.policy
        if self._own_resolver and (old is None or old.dns != policy.dns):
            state.resolver = default_resolver(policy)
        state.limits = policy.limits
        state.policy = policy
        return self.close_denied() if close_denied else 0

    def close_denied(self) -> int:
        """Abort every open tunnel, forwarding connection and dial in flight that the
        current policy would not admit now; return how many.

        Each is judged with egress.recheck on the target and addresses it was
        admitted with: the rules of a new decision, without DNS and without an
        audit record (its own decision was audited). A decision still waiting
        for its DNS answer finishes under the policy it started with; a later
        close_denied() sees what it opened.
        """
        state = self.state
        closed = 0
        held: list[Held] = [*state.connections, *state.forwarders]
        for tunnel, end in list(state.tunnels.items()):
            if not self._admits(end.target()):
                tunnel.abort()
                closed += 1
        for item in held:
            target = item.target()
            if target is not None and not self._admits(target):
                item.abort()
                closed += 1
        return closed

    def _admits(self, target: OpenTarget) -> bool:
        state = self.state
        decision = recheck(
            state.policy,
            target.host,
            target.port,
            target.addresses,
            self_endpoints=state.self_endpoints,
        )
        if not decision.allowed and state.log is not None:
            state.diagnostic(
                f"{target.protocol} {format_authority(target.host, target.port)} closed:"
                f" the policy now denies it ({decision.reason.value})"
            )
        return decision.allowed

    @property
    def policy(self) -> Policy | None:
        return self.state.policy

    def _first(self, kind: str) -> Listener | None:
        return next((item for item in self.listeners if item.kind == kind), None)

    @property
    def http_address(self) -> tuple[str, int] | None:
        found = self._first("http")
        return found.address if found else None

    @property
    def socks_address(self) -> tuple[str, int] | None:
        found = self._first("socks5")
        return found.address if found else None

    @property
    def http_url(self) -> str | None:
        found = self._first("http")
        return f"http://{found.authority}" if found else None

    @property
    def socks_url(self) -> str | None:
        found = self._first("socks5")
        return f"socks5h://{found.authority}" if found else None

    def ready_line(self) -> dict[str, str]:
        line = {"event": "ready"}
        for kind in ("http", "socks5"):
            found = self._first(kind)
            if found is not None:
                line[kind] = found.authority
        return line


def _chain(first: RecordCallback, second: RecordCallback | None) -> RecordCallback:
    def both(record: AuditRecord) -> None:
        first(record)
        if second is not None:
            second(record)

    return both


def default_resolver(policy: Policy | None) -> Resolver:
    """The resolver a policy's [dns] table describes, built on first use."""
    return LazyResolver(policy)


class LazyResolver:
    """Builds the DnsResolver on the first query: importing dnspython costs
    ~30 ms, which `egressbox run -- CMD` would otherwise pay on every start."""

    def __init__(self, policy: Policy | None) -> None:
        self._policy = policy
        self._resolver: Resolver | None = None

    async def resolve(self, host: str) -> Resolution:
        if self._resolver is None:
            self._resolver = _dns_resolver(self._policy)
        return await self._resolver.resolve(host)

    def resolve_now(self, host: str) -> Resolution | None:
        """A cached (or hosts-file) answer without a query; None before the first query."""
        if self._resolver is None:
            return None
        lookup = getattr(self._resolver, "resolve_now", None)
        return None if lookup is None else cast("Resolution | None", lookup(host))


def _dns_resolver(policy: Policy | None) -> Resolver:
    from egressbox.resolve import DnsResolver

    if policy is None:
        return DnsResolver()
    dns = policy.dns
    servers = [(str(ip), port) for ip, port in dns.nameservers] or None
    return DnsResolver(servers, timeout=dns.timeout, cache_size=dns.cache_size, max_ttl=dns.max_ttl)


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: the OS picks a free one)."""
    ip = ipaddress.ip_address(host)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # "::" serves both families only when asked; keep a v6 listener v6.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if ip.is_unspecified else 1)
        sock.bind((str(ip), port))
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _unmapped_text(host: str) -> str:
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)
