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
import ipaddress
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Unpack, cast

from egressbox.audit.record import (
    AuditRecord,
)
from egressbox.core.decide import Decision, SelfEndpoints
from egressbox.core.errors import AuditError, Reason, Verdict
from egressbox.core.hosts import format_authority
from egressbox.core.ip import IPAddress
from egressbox.core.limits import Limits
from egressbox.core.policy import Policy
from egressbox.core.synthetic import SyntheticNames
from egressbox.net.netinfo import local_addresses

# Imported at run time: compiled dataclasses resolve their field types.
from egressbox.net.resolve import DnsMeter, DnsResolver, Resolution, Resolver
from egressbox.protocols.proxy_header import parse_trusted
from egressbox.protocols.upstream import Upstream, credentials_from_env
from egressbox.proxy.approval import Approvals
from egressbox.proxy.check import recheck
from egressbox.proxy.gate import (
    Held,
    OpenTarget,
    ProxyState,
    RecordCallback,
    recheck_session_approved,
    settle_held,
)
from egressbox.proxy.listeners import (
    CapturedConnection,
    HttpConnection,
    ProxyHeaderConnection,
    ProxyHeaderGate,
    SocksConnection,
)
from egressbox.proxy.options import ProxyKeywords, ProxyOptions
from egressbox.proxy.tunnel import Connection

if TYPE_CHECKING:
    from egressbox.proxy.broker import Broker

# Listen backlog: large enough for a burst of short tunnels from a parallel
# build (Linux caps it at net.core.somaxconn, 4096 by default).
LISTEN_BACKLOG = 1024


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


@dataclass(frozen=True)
class Listener:
    """One listening socket: its kind and bound address."""

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
        options: ProxyOptions | None = None,
        /,
        **keywords: Unpack[ProxyKeywords],
    ) -> None:
        """`keywords` are ProxyOptions' fields (proxy/options.py), over `options` when both
        are given; the state every connection shares is made whole here."""
        if keywords:
            given = options if options is not None else ProxyOptions()
            options = dataclasses.replace(given, **keywords)
        elif options is None:
            options = ProxyOptions()
        self.options = options
        self.records: list[AuditRecord] = []
        on_record = options.on_record
        if options.keep_records:
            on_record = _chain(self.records.append, on_record)
        self._listen = options.listen
        self._ports = {"http": options.http_port, "socks5": options.socks_port}
        self._given = {"http": list(options.http_sockets), "socks5": list(options.socks_sockets)}
        self._capture = list(options.capture_sockets)
        self._destinations = options.destinations
        self._dns = list(options.dns_sockets)
        self._dns_udp: list[asyncio.DatagramTransport] = []
        self._own_resolver = options.resolver is None
        self._upstream = options.upstream
        self._upstream_credentials = options.upstream_credentials
        self._credentials_read = options.upstream_credentials is not None
        self.broker = _broker_for(policy, options.broker, options.secrets)
        self.state = ProxyState(
            policy=policy,
            resolver=options.resolver or default_resolver(policy, options.meter),
            limits=options.limits or (policy.limits if policy is not None else Limits()),
            audit=options.audit,
            on_record=on_record,
            log=options.log,
            socks_credentials=options.socks_credentials,
            log_allowed=options.log_allowed,
            synthetic=_synthetic(options),
            meter=options.meter,
            approvals=Approvals(options.on_miss, timeout=options.ask_timeout, log=options.log)
            if options.on_miss is not None
            else None,
            upstream=self._upstream_for(policy),
            broker=self.broker,
        )
        self.header_gate = (
            ProxyHeaderGate(parse_trusted(options.proxy_protocol_from))
            if options.proxy_protocol_from is not None
            else None
        )
        self._servers: list[asyncio.Server] = []
        self.listeners: list[Listener] = []

    @property
    def placeholders(self) -> dict[str, str]:
        """What a client holds in place of each [[secret]]'s value (name -> placeholder)."""
        return dict(self.broker.placeholders) if self.broker is not None else {}

    @property
    def ca_pem(self) -> str | None:
        """The CA certificate (PEM) a client must trust for the terminated hosts."""
        return self.broker.ca.cert_pem if self.broker is not None else None

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        factories = {"http": HttpConnection, "socks5": SocksConnection}
        try:
            for kind, factory in factories.items():
                for sock in self._sockets(kind):
                    await self._serve(kind, sock, factory)
            await self._serve_capture()
        except GeneratorExit:
            self.abort()  # the coroutine is being finalized: nothing may be awaited
            raise
        except BaseException:
            await self.close(0)
            raise
        self.state.self_endpoints = self._self_endpoints()
        self.state.loop = asyncio.get_running_loop()
        self.state.fd_capacity = fd_capacity(_soft_nofile())

    async def _serve_capture(self) -> None:
        """The capture listeners and the DNS sockets of a child's namespace, if given."""
        from egressbox.proxy.dns import Answerer, UdpServer, serve_tcp

        state = self.state
        loop = asyncio.get_running_loop()
        for sock in self._capture:
            server = await loop.create_server(
                lambda: CapturedConnection(state, self._destinations),
                sock=sock,
                backlog=LISTEN_BACKLOG,
            )
            self._servers.append(server)
        if not self._dns:
            return
        assert state.synthetic is not None
        answerer = Answerer(state, state.synthetic)
        for sock in self._dns:
            if sock.type == socket.SOCK_DGRAM:
                transport, _ = await loop.create_datagram_endpoint(
                    lambda: UdpServer(answerer), sock=sock
                )
                self._dns_udp.append(transport)
            else:
                tcp = await asyncio.start_server(lambda r, w: serve_tcp(answerer, r, w), sock=sock)
                self._servers.append(tcp)

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
        state, gate = self.state, self.header_gate
        loop = asyncio.get_running_loop()
        if gate is not None:  # --proxy-protocol: the header first, then the listener's own
            server = await loop.create_server(
                lambda: ProxyHeaderConnection(state, gate, factory),
                sock=sock,
                backlog=LISTEN_BACKLOG,
            )
        else:
            server = await loop.create_server(
                lambda: factory(state), sock=sock, backlog=LISTEN_BACKLOG
            )
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
        if state.approvals is not None:
            # Requests held for an answer are refused now (audited), not left to the drain.
            await state.approvals.aclose()
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
        if state.approvals is not None:
            with contextlib.suppress(RuntimeError):
                state.approvals.close()
        # A closed loop refuses to schedule the transports' callbacks: go on.
        for server in self._servers:
            with contextlib.suppress(RuntimeError):
                server.close()
        for transport in self._dns_udp:
            with contextlib.suppress(RuntimeError):
                transport.close()
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

    def set_policy(self, policy: Policy, *, close_denied: bool = True) -> int:
        """Swap the policy atomically: connections decided from now on use it, and what is
        open is judged again (close_denied()): the open connections and the requests held
        for an approval answer that it would not admit are closed, each audited with
        `policy_reloaded`. Returns how many. With `close_denied=False` (serve
        --keep-open-on-reload) open connections are left alone and held questions wait for
        their answer (which is still applied under this policy).

        Its [limits] apply to new connections; its [dns] settings replace the
        resolver unless the caller supplied one. Cached decisions are never reused
        under another policy (egress.check_now's memo holds the policy it was made by).
        """
        state = self.state
        old = state.policy
        if self._own_resolver and (old is None or old.dns != policy.dns):
            state.resolver = default_resolver(policy, state.meter)
        state.limits = policy.limits
        state.policy = policy
        if self._upstream is None:  # the policy's [egress] upstream, unless one was given
            state.upstream = self._upstream_for(policy)
        return self.close_denied() if close_denied else 0

    def close_denied(self) -> int:
        """Close everything open that the current policy would not admit now; return how
        many connections (and held requests) were closed.

        Every open tunnel (CONNECT, SOCKS5, captured), forwarding connection (kept alive
        between requests, or upgraded to a WebSocket) and dial in flight is judged with
        egress.recheck on the target and the addresses it was admitted with and connected
        to: the rules of a new decision, without DNS (names by the name rules, addresses
        by the new CIDR rules and bans), so a reload never waits on a resolver. Each one
        closed gets an audit record of its own (`deny`, `policy_reloaded`) and a line on
        the log saying the rule that closed it. Requests held for an approval answer are
        judged by the name rules (gate.settle_held). A decision waiting for its DNS answer
        is judged under the policy in force when the answer comes (gate.CurrentPending).
        """
        state = self.state
        judged: dict[tuple[str, int, tuple[IPAddress, ...]], Decision] = {}
        closed = settle_held(state)
        held: list[Held] = [*state.connections, *state.forwarders]
        for tunnel, end in list(state.tunnels.items()):
            target = end.target()
            if not self._admits(target, judged):
                tunnel.abort()
                self._audit_closed(target)
                closed += 1
        for item in held:
            found = item.target()
            if found is not None and not self._admits(found, judged):
                item.abort()
                self._audit_closed(found)
                closed += 1
        return closed

    def _admits(
        self,
        target: OpenTarget,
        judged: dict[tuple[str, int, tuple[IPAddress, ...]], Decision],
    ) -> bool:
        """Whether the policy admits `target` now; `judged` keeps this pass's decisions
        (a thousand tunnels to one host are judged once)."""
        state = self.state
        key = (target.host, target.port, target.addresses)
        decision = judged.get(key)
        if decision is None:
            decision = recheck(
                state.policy,
                target.host,
                target.port,
                target.addresses,
                self_endpoints=state.self_endpoints,
            )
            if decision.reason is Reason.NO_ALLOW_RULE:
                decision = recheck_session_approved(state, target) or decision
            judged[key] = decision
        if not decision.allowed and state.log is not None:
            state.diagnostic(
                f"{target.protocol} {format_authority(target.host, target.port)} closed:"
                f" the reloaded policy denies it ({decision.reason.value})"
            )
        return decision.allowed

    def _audit_closed(self, target: OpenTarget) -> None:
        """The closure's own record: `deny` with `policy_reloaded` (an audit log that
        cannot be written stops admission as always; the connection is closed anyway)."""
        closure = Decision(
            Verdict.DENY,
            Reason.POLICY_RELOADED,
            target.host,
            target.port,
            target.addresses,
            detail="closed: the reloaded policy does not admit it",
        )
        with contextlib.suppress(AuditError):
            self.state.emit_decision(target.protocol, closure)

    @property
    def policy(self) -> Policy | None:
        return self.state.policy

    @property
    def approvals(self) -> Approvals | None:
        """The questions asked on a miss and their answers (None without on_miss)."""
        return self.state.approvals

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
        upstream = self.state.upstream
        if upstream is not None:
            line["upstream"] = upstream.proxy.url
            line["pinning"] = upstream.proxy.pinning
        return line

    @property
    def proxy_protocol_refusals(self) -> dict[str, int]:
        """Connections refused before a PROXY protocol header was read, by cause."""
        return dict(self.header_gate.refusals) if self.header_gate is not None else {}

    def _upstream_for(self, policy: Policy | None) -> Upstream | None:
        """The upstream to chain to: the one given, else the policy's (None: dial directly).
        Credentials are read from the environment once, when an upstream first needs them."""
        proxy = self._upstream or (policy.upstream if policy is not None else None)
        if proxy is None:
            return None
        if not self._credentials_read:
            self._credentials_read = True
            self._upstream_credentials = credentials_from_env(os.environ)
        return Upstream(proxy, self._upstream_credentials)


def _synthetic(options: ProxyOptions) -> SyntheticNames | None:
    """The names a child's capture listeners and DNS share: the given ones, else new ones
    when either is served."""
    if options.synthetic is not None:
        return options.synthetic
    return SyntheticNames() if options.capture_sockets or options.dns_sockets else None


def _chain(first: RecordCallback, second: RecordCallback | None) -> RecordCallback:
    def both(record: AuditRecord) -> None:
        first(record)
        if second is not None:
            second(record)

    return both


def default_resolver(policy: Policy | None, meter: DnsMeter | None = None) -> Resolver:
    """The resolver a policy's [dns] table describes, built on first use."""
    return LazyResolver(policy, meter)


class LazyResolver:
    """Builds the DnsResolver on the first query: importing dnspython costs
    ~30 ms, which `egressbox run -- CMD` would otherwise pay on every start."""

    def __init__(self, policy: Policy | None, meter: DnsMeter | None = None) -> None:
        self._policy = policy
        self._meter = meter
        self._resolver: Resolver | None = None

    async def resolve(self, host: str) -> Resolution:
        if self._resolver is None:
            self._resolver = _dns_resolver(self._policy, self._meter)
        return await self._resolver.resolve(host)

    def resolve_now(self, host: str) -> Resolution | None:
        """A cached (or hosts-file) answer without a query; None before the first query."""
        if self._resolver is None:
            return None
        lookup = getattr(self._resolver, "resolve_now", None)
        return None if lookup is None else cast("Resolution | None", lookup(host))


def _dns_resolver(policy: Policy | None, meter: DnsMeter | None = None) -> Resolver:
    if policy is None:
        return DnsResolver(meter=meter)
    dns = policy.dns
    servers = [(str(ip), port) for ip, port in dns.nameservers] or None
    return DnsResolver(
        servers,
        timeout=dns.timeout,
        cache_size=dns.cache_size,
        max_ttl=dns.max_ttl,
        meter=meter,
    )


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


def _broker_for(
    policy: Policy | None, broker: Broker | None, secrets: Mapping[str, str] | None
) -> Broker | None:
    """The policy's [[secret]] and [[request_rule]] entries, their values read now (once):
    `secrets` gives values by name instead of each entry's source (ValueError for a name no
    [[secret]] entry has). `broker`: one made already (`run` makes it before the fork: the
    child's placeholders and the CA its view trusts)."""
    if broker is None:
        if policy is None or (not policy.secrets and not policy.request_rules):
            if secrets:
                raise ValueError("secrets= needs [[secret]] entries in the policy (their hosts)")
            return None
        from egressbox.proxy.broker import Broker

        broker = Broker.for_policy(policy)
        assert broker is not None
    given = dict(secrets or {})
    unknown = sorted(set(given) - {s.name for s in broker.secrets})
    if unknown:
        raise ValueError(f"secrets= names no [[secret]] entry of the policy: {', '.join(unknown)}")
    for name, value in given.items():
        broker.set_value(name, value)
    broker.load(skip=given)
    return broker
