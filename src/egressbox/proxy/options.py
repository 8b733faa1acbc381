"""EgressProxy's options, declared once: `EgressProxy(policy, **keywords)` takes exactly
these names (an unknown one is a TypeError naming it), `EgressProxy(policy, ProxyOptions(...))`
the same as one value.

Read once, when the proxy is constructed: nothing here is on a connection's path (and the
module is not compiled).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from egressbox.proxy.approval import DEFAULT_TIMEOUT as DEFAULT_ASK_TIMEOUT

if TYPE_CHECKING:
    from egressbox.audit.record import AuditSink
    from egressbox.core.limits import Limits
    from egressbox.core.synthetic import SyntheticNames
    from egressbox.core.upstream import UpstreamProxy
    from egressbox.net.original import Destinations
    from egressbox.net.resolve import Resolver
    from egressbox.protocols.upstream import UpstreamCredentials
    from egressbox.proxy.approval import Decider
    from egressbox.proxy.broker import Broker
    from egressbox.proxy.gate import Credentials, Log, Meter, RecordCallback


@dataclass(frozen=True, kw_only=True)
class ProxyOptions:
    """How an EgressProxy listens, records, asks and chains.

    `log` gets one line per connection; with `log_allowed` False only refusals (the audit
    records have everything). `capture_sockets` (listeners a child's connections are
    redirected to) and `dns_sockets` (UDP sockets and TCP listeners of its DNS) serve `run`
    with capture; `synthetic` is the names they share; `destinations` where the connect
    supervisor's captured connections were going (run without a namespace). `meter` (serve
    --admin) counts decisions, audit failures, relayed bytes and the own resolver's queries.
    `on_miss` is asked about a destination no allow entry admits (proxy/approval.py: deny,
    once or session; no answer within `ask_timeout` seconds denies). `proxy_protocol_from`
    (CIDR texts; None: off) makes the HTTP and SOCKS5 listeners read a PROXY protocol header
    first and refuse every other sender. `upstream` chains to that proxy instead of the
    policy's [egress] upstream (README "Through an upstream proxy"); its credentials default
    to EGRESSBOX_UPSTREAM_USER/PASSWORD, read once when an upstream is first used (ValueError
    when only one of them is set). `secrets` gives [[secret]] values by name; `broker` is one
    made already (`run` makes it before the fork).
    """

    listen: str = "127.0.0.1"
    http_port: int | None = 0
    socks_port: int | None = 0
    resolver: Resolver | None = None
    audit: AuditSink | None = None
    on_record: RecordCallback | None = None
    keep_records: bool = False
    log: Log | None = None
    socks_credentials: Credentials | None = None
    http_sockets: Sequence[socket.socket] = ()
    socks_sockets: Sequence[socket.socket] = ()
    limits: Limits | None = None
    log_allowed: bool = True
    capture_sockets: Sequence[socket.socket] = ()
    dns_sockets: Sequence[socket.socket] = ()
    synthetic: SyntheticNames | None = None
    destinations: Destinations | None = None
    meter: Meter | None = None
    on_miss: Decider | None = None
    ask_timeout: float = DEFAULT_ASK_TIMEOUT
    proxy_protocol_from: Sequence[str] | None = None
    upstream: UpstreamProxy | None = None
    upstream_credentials: UpstreamCredentials | None = None
    secrets: Mapping[str, str] | None = None
    broker: Broker | None = None


class ProxyKeywords(TypedDict, total=False):
    """ProxyOptions' fields as `EgressProxy(policy, **keywords)` takes them, so that a caller's
    type checker sees each keyword and its type (tests/proxy/test_options.py holds the two
    equal, name for name and type for type)."""

    listen: str
    http_port: int | None
    socks_port: int | None
    resolver: Resolver | None
    audit: AuditSink | None
    on_record: RecordCallback | None
    keep_records: bool
    log: Log | None
    socks_credentials: Credentials | None
    http_sockets: Sequence[socket.socket]
    socks_sockets: Sequence[socket.socket]
    limits: Limits | None
    log_allowed: bool
    capture_sockets: Sequence[socket.socket]
    dns_sockets: Sequence[socket.socket]
    synthetic: SyntheticNames | None
    destinations: Destinations | None
    meter: Meter | None
    on_miss: Decider | None
    ask_timeout: float
    proxy_protocol_from: Sequence[str] | None
    upstream: UpstreamProxy | None
    upstream_credentials: UpstreamCredentials | None
    secrets: Mapping[str, str] | None
    broker: Broker | None
