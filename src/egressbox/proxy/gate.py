"""The gate: every request of every listener is decided and audited here, before any reply.

One place decides (egress.check_now, the DNS query if one is needed), writes the audit record
and turns the proxy's own state (an audit log that cannot be written, too many connections)
into refusals like any other decision. It also holds what every connection shares (ProxyState)
and tracks open tunnels for close_denied and the drain.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple, Protocol

from egressbox.audit.record import (
    AuditProtocol,
    AuditRecord,
    AuditSink,
    JsonlFileSink,
    StreamSink,
    decision_line,
)
from egressbox.core.decide import (
    Decision,
    NamePass,
    SelfEndpoints,
    bad_target,
    decide_addresses,
    decide_name,
    deny,
    parse_target,
)
from egressbox.core.errors import AuditError, HostError, Reason, Verdict
from egressbox.core.hosts import format_authority
from egressbox.core.ip import IPAddress
from egressbox.core.limits import Limits
from egressbox.core.policy import Policy
from egressbox.core.synthetic import SyntheticNames
from egressbox.net.relay import (
    RelayStats,
    Tunnel,
)

# Imported at run time: compiled dataclasses resolve their field types.
from egressbox.net.resolve import Resolver
from egressbox.protocols.upstream import Upstream
from egressbox.proxy.approval import (
    RELOAD_ADMITTED,
    RELOAD_REFUSED,
    Approvals,
    MissRequest,
    Outcome,
)
from egressbox.proxy.check import Pending, check_now, recheck

# Enum members bound once (docs/development.md, "The compiled core's speed rules").
_ALLOWED: Final = Reason.ALLOWED
_AUDIT_UNAVAILABLE: Final = Reason.AUDIT_UNAVAILABLE
_DENY: Final = Verdict.DENY
_DNS: Final = AuditProtocol.DNS
_NO_ALLOW_RULE: Final = Reason.NO_ALLOW_RULE
_POLICY_RELOADED: Final = Reason.POLICY_RELOADED
_SECRET_MISDIRECTED: Final = Reason.SECRET_MISDIRECTED
_TOO_MANY_CONNECTIONS: Final = Reason.TOO_MANY_CONNECTIONS

Log = Callable[[str], None]


RecordCallback = Callable[[AuditRecord], None]


Credentials = Callable[[str, str], bool]


# After an audit failure, how often the file sink is asked whether it can be
# written again (space freed): then admission resumes.
AUDIT_RETRY_SECONDS = 1.0


class OpenTarget(NamedTuple):
    """What an open connection is connected (or being connected) to, as decided:
    for EgressProxy.close_denied to judge again."""

    protocol: AuditProtocol
    host: str
    port: int
    addresses: tuple[IPAddress, ...]  # the checked addresses it was admitted with


class Meter(Protocol):
    """What serve's metrics (egressbox.serve.metrics) hear from the proxy: one call per audit
    record written (so the counts always add up to the log), per failed audit write and
    per ended tunnel, and the resolver's queries (resolve.DnsMeter). Plain calls with
    enum arguments: the gate builds no labels."""

    def decided(self, protocol: AuditProtocol, verdict: Verdict, reason: Reason) -> None: ...

    def audit_failed(self) -> None: ...

    def relayed(self, up: int, down: int) -> None: ...

    def dns_query(self, seconds: float, outcome: str) -> None: ...

    def dns_cache_hit(self) -> None: ...


class Brokering(Protocol):
    """What the gate asks about a request on a connection it can read (proxy/broker.py's
    Broker): a secret's placeholder sent to a host it is not bound to, and the request rules
    and budgets of a terminated host. Nothing it returns carries a value or a path."""

    def terminates(self, host: str, port: int) -> bool: ...

    def misdirected(
        self, host: str, port: int, target: str, headers: Sequence[tuple[str, str]]
    ) -> str | None: ...

    def judge(
        self, host: str, port: int, method: str, target: str, size: int
    ) -> tuple[Reason, str] | None: ...

    def more_bytes(self, host: str, port: int, size: int) -> tuple[Reason, str] | None: ...


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
    # Client connections not yet tunnels (tunnel.Connection), each until it is gone.
    connections: set[Held] = field(default_factory=set)
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
    # `run` with capture: the names a child looked up, by their synthetic addresses.
    synthetic: SyntheticNames | None = None
    # Chaining: allowed connections are made through this upstream proxy (proxy/upstream.py).
    upstream: Upstream | None = None
    # Approval on a miss (approval.py): who is asked about a destination no entry admits.
    approvals: Approvals | None = None
    # serve --admin: counts decisions, audit failures and relayed bytes (None: nothing).
    meter: Meter | None = None
    # [[secret]] and [[request_rule]] (proxy/broker.py): None when the policy has neither.
    broker: Brokering | None = None

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
        if self.meter is not None:
            self.meter.decided(record.protocol, record.decision, record.reason)
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
                if self.meter is not None:
                    self.meter.decided(protocol, decision.verdict, decision.reason)
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
        if self.meter is not None:
            self.meter.audit_failed()
        if self.audit_error is None:
            self.audit_error = str(exc)
            stderr_log(f"audit log cannot be written ({exc}); refusing new connections")

    def diagnostic(self, line: str) -> None:
        if self.log is not None:
            self.log(line)


def _watch_tunnel(
    state: ProxyState, tunnel: Tunnel, protocol: AuditProtocol, decision: Decision, client: str
) -> None:
    """Track the tunnel; untrack it and log its one diagnostic line when it ends."""
    end = _TunnelEnd(state, tunnel, protocol, decision, client)
    state.tunnels[tunnel] = end
    tunnel.when_done(end)


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

    def __call__(self, stats: RelayStats) -> None:
        state = self.state
        state.tunnels.pop(self.tunnel, None)
        state.client_closed(self.client)
        meter = state.meter
        if meter is not None:
            meter.relayed(stats.bytes_up, stats.bytes_down)
        if state.log is None or not state.log_allowed:
            return
        state.diagnostic(
            f"{self.protocol} {format_authority(self.host, self.port)} {self.verdict.value}"
            f" {self.reason.value} up={stats.bytes_up} down={stats.bytes_down} "
            f"{stats.duration:.3f}s closed_by={stats.closed_by.value}"
        )


def gate_now(
    state: ProxyState,
    protocol: AuditProtocol,
    host: str,
    port: int | str,
    *,
    over_limit: bool = False,
    record_port: int | None = None,
    client: str = "",
) -> Decision | Pending:
    """The audited decision for `host:port` if it needs no DNS query, else a Pending to
    finish and pass to gate_audited(). The proxy's own state (an audit log that cannot be
    written, too many connections) refuses like any other decision. `record_port` replaces
    the port in the audit record (a DNS question has none: 0). `client` (the peer's address)
    is whom a held question is counted against (approval.py's per-client bound)."""
    if state.audit_error is not None and not state.audit_recovered():
        return _refusal(host, port, _AUDIT_UNAVAILABLE, state.audit_error)
    if over_limit:
        decision = _refusal(host, port, _TOO_MANY_CONNECTIONS, "too many connections")
    else:
        decided = check_now(
            state.policy, state.resolver, host, port, self_endpoints=state.self_endpoints
        )
        if isinstance(decided, Pending):
            # Finished under the policy in force when its answer comes (a reload may come
            # while the name is resolved).
            return CurrentPending(state, decided)
        decision = decided
        if state.approvals is not None and decision.reason is _NO_ALLOW_RULE:
            held = _held(state, protocol, decision, host, port, client=client)
            if held is not None:
                return held
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
        return _refusal(host, port, _AUDIT_UNAVAILABLE, state.audit_error or "")
    return decision


class CurrentPending(Pending):
    """A Pending whose decision is the policy's in force when the DNS answer arrives: when a
    reload swapped the policy meanwhile, the resolved addresses are judged again under the
    new one (egress.recheck: no second query). Else a reload's close_denied(), which sees no
    target for a decision in flight, would leave what the old policy admitted open."""

    __slots__ = ("inner", "state")

    def __init__(self, state: ProxyState, inner: Pending) -> None:
        super().__init__(inner.policy, inner.resolver, inner.passed, inner.self_endpoints)
        self.state = state
        self.inner = inner

    async def finish(self) -> Decision:
        decision = await self.inner.finish()
        return _under_current(self.state, self.policy, decision)


def _under_current(state: ProxyState, started: Policy | None, decision: Decision) -> Decision:
    """`decision`, made under `started`, judged again under the policy in force now if a
    reload replaced it (a refusal stays one)."""
    current = state.policy
    if current is started or not decision.allowed:
        return decision
    again = recheck(
        current,
        decision.host,
        decision.port,
        decision.addresses,
        self_endpoints=state.self_endpoints,
    )
    return decision if again.allowed and again.reason is decision.reason else again


def _refusal(host: str, port: int | str, reason: Reason, detail: str) -> Decision:
    try:
        target = parse_target(host, port)
    except HostError as exc:
        return bad_target(exc, port)
    return deny(reason, target, detail)


# -- approval on a miss (approval.py) ----------------------------------------------------


def _held(
    state: ProxyState,
    protocol: AuditProtocol,
    decision: Decision,
    host: str,
    port: int | str,
    *,
    client: str,
) -> HeldMiss | None:
    """A miss the approvals may lift, held as a Pending; None to refuse it as it is. Only a
    plain `no_allow_rule` denial qualifies (report mode lets misses through unasked); a DNS
    question is answered by the name rules alone; an IP literal whose one address is refused
    anyway is never asked about."""
    policy, approvals = state.policy, state.approvals
    if approvals is None or policy is None or decision.verdict is not _DENY or protocol is _DNS:
        return None
    try:
        target = parse_target(host, port)
    except HostError:
        return None
    passed = NamePass(target, None)
    ip = target.host.ip
    if ip is not None:
        checked = decide_addresses(policy, passed, (ip,), self_endpoints=state.self_endpoints)
        if not checked.allowed:
            return None
    return HeldMiss(state, passed, approvals=approvals, protocol=protocol, client=client)


class HeldMiss(Pending):
    """A request no allow entry admits, held while the approvals answer. A Pending, so every
    caller awaits it (and audits the result) as it awaits a DNS query.

    The answer is applied under the policy in force when it arrives, not the one the request
    came in with: a deny entry (or any refusal by the name rules) added by a reload meanwhile
    wins whatever the decider said, and an allow entry added meanwhile admits it as any allowed
    name. An allow answer lifts the missing entry for the name only: the name is then resolved
    and every address judged as for an allowed name (deny_cidrs, metadata, the private and
    special ranges and the proxy's own listeners are never approvable)."""

    __slots__ = ("approvals", "client", "protocol", "state")

    def __init__(
        self,
        state: ProxyState,
        passed: NamePass,
        *,
        approvals: Approvals,
        protocol: AuditProtocol,
        client: str,
    ) -> None:
        assert state.policy is not None  # a miss is held only under a policy
        super().__init__(state.policy, state.resolver, passed, state.self_endpoints)
        self.state = state
        self.approvals = approvals
        self.protocol = protocol
        self.client = client

    async def finish(self) -> Decision:
        target = self.passed.target
        request = MissRequest(self.protocol.value, target.host.text, target.port)
        outcome = await self.approvals.ask(request, client=self.client)
        if outcome.reason is _POLICY_RELOADED:
            return deny(_POLICY_RELOADED, target, outcome.detail)
        state = self.state
        policy = state.policy  # the policy in force now, when the answer has come
        named = decide_name(policy, target)
        lifted = False
        if isinstance(named, Decision):
            if named.reason is not _NO_ALLOW_RULE:
                self._overridden(outcome, named)
                return named  # a deny entry (or no policy at all): never approvable
            if outcome is RELOAD_ADMITTED:
                return named  # admitted by an entry that a later reload took away again
            if not outcome.allowed:
                return deny(outcome.reason, target, f"no allow entry admits it; {outcome.detail}")
            named, lifted = NamePass(target, None), True
        assert policy is not None  # decide_name refuses everything without a policy
        ip = target.host.ip
        if ip is not None:
            decision = decide_addresses(policy, named, (ip,), self_endpoints=state.self_endpoints)
        else:
            # A plain Pending for the rest: the same resolution and address checks.
            resolving = Pending(policy, state.resolver, named, state.self_endpoints)
            decision = _under_current(state, policy, await resolving.finish())
        if not lifted or decision.reason is not _ALLOWED:
            return decision  # an address refused it (or DNS failed): approval lifts no ban
        return dataclasses.replace(decision, reason=outcome.reason, detail=outcome.detail)

    def _overridden(self, outcome: Outcome, decision: Decision) -> None:
        if outcome.allowed and self.state.log is not None:
            self.state.diagnostic(
                f"{self.protocol} {format_authority(decision.host, decision.port)}: the answer"
                f" ({outcome.answer.value}) is overridden by the policy in force now"
                f" ({decision.reason.value})"
            )


def settle_held(state: ProxyState) -> int:
    """A reload: judge each open approval question by the name rules of the policy now in
    force (and an IP literal's address too; a name's addresses are judged when the answer
    comes, without DNS now). A refusal ends the question at once (its requests are refused
    with `policy_reloaded`, its decider stopped); an allow entry that now admits the target
    lets its requests go on as allowed names. Returns how many requests were refused."""
    approvals = state.approvals
    if approvals is None:
        return 0

    def judge(host: str, port: int) -> Outcome | None:
        try:
            target = parse_target(host, port)
        except HostError:
            return RELOAD_REFUSED
        named = decide_name(state.policy, target)
        if isinstance(named, Decision):
            return None if named.reason is _NO_ALLOW_RULE else RELOAD_REFUSED
        if named.rule is None:
            return None  # report mode's pass: the question stands, the answer is re-judged
        ip = target.host.ip
        if ip is not None and state.policy is not None:
            checked = decide_addresses(
                state.policy, named, (ip,), self_endpoints=state.self_endpoints
            )
            if not checked.allowed:
                return RELOAD_REFUSED
        return RELOAD_ADMITTED

    return approvals.settle(judge)


def recheck_session_approved(state: ProxyState, target: OpenTarget) -> Decision | None:
    """close_denied() for an open connection whose target a session answer admits: the
    missing entry stays lifted, its addresses are judged under the current policy. None
    when no session answer admits it."""
    approvals, policy = state.approvals, state.policy
    if approvals is None or policy is None or not approvals.admits(target.host, target.port):
        return None
    try:
        parsed = parse_target(target.host, target.port)
    except HostError as exc:
        return bad_target(exc, target.port)
    passed = NamePass(parsed, None)
    return decide_addresses(policy, passed, target.addresses, self_endpoints=state.self_endpoints)


# -- requests the proxy can read: plain HTTP, and terminated hosts (proxy/terminate.py) ------


def gate_request(
    state: ProxyState,
    protocol: AuditProtocol,
    admitted: Decision,
    request: RequestFacts,
    *,
    rules: bool = True,
) -> Decision | None:
    """The audited refusal of one request on a connection `admitted` let through, or None
    to send it: a placeholder bound to another host (`secret_misdirected`), then with
    `rules` the request rules and budgets (`method_denied`, `path_denied`,
    `budget_exceeded`). Admitted requests are counted against the budgets here."""
    broker = state.broker
    if broker is None:
        return None
    host, port = admitted.host, admitted.port
    name = broker.misdirected(host, port, request.target, request.headers)
    refused: tuple[Reason, str] | None = None
    if name is not None:
        refused = (_SECRET_MISDIRECTED, f"the placeholder of {name} is not bound to this host")
    elif rules:
        refused = broker.judge(host, port, request.method, request.target, request.size)
    if refused is None:
        return None
    return gate_refused(state, protocol, admitted, refused)


def gate_refused(
    state: ProxyState, protocol: AuditProtocol, admitted: Decision, refused: tuple[Reason, str]
) -> Decision:
    """The audited refusal of a request (or of the rest of its body) on an admitted connection."""
    reason, detail = refused
    decision = Decision(_DENY, reason, admitted.host, admitted.port, (), admitted.rule, detail)
    return gate_audited(state, protocol, decision, admitted.host, admitted.port)


class RequestFacts(NamedTuple):
    """What the gate reads of a request: never logged, never audited."""

    method: str
    target: str  # the path and query (origin-form)
    headers: Sequence[tuple[str, str]]
    size: int  # head bytes plus the declared body length (0 for chunked: counted as it comes)
