"""Dialing through an upstream proxy (`serve --upstream`, `[egress] upstream`).

The decision is made before this, by the gate, exactly as without an upstream: only the
last hop changes. Instead of `dial.start_connect` to the checked addresses, the proxy
connects to the upstream and asks it (HTTP CONNECT or SOCKS5, protocols/upstream.py) for
a connection to the checked address (`upstream_target = "address"`: each checked address
in RFC 8305 order, the next one only when the upstream says it could not reach the one
asked for) or to the name (`"name"`: once; the upstream resolves it, pinning is partial).
Once the upstream has answered, the connection is handed to the caller's protocol as
`start_connect` would hand over a fresh one (connection_made, then any bytes the
upstream sent after its reply), and reported through the same callback. So tunnels,
plain HTTP forwarding (which sends origin-form requests through the tunnel: the upstream
never sees the name in that case unless it is asked for it) and captured connections
chain alike.

The upstream's own address is the one hop that is not policy-checked: it is what the
operator configured. A name there is resolved by the proxy's resolver (the hosts file or
--nameserver as for every name, the answer not judged by the policy). Its credentials
go only into the handshake; messages name the upstream's host and port, never them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from typing import cast

from egressbox.core.decide import Decision
from egressbox.core.errors import ResolveError
from egressbox.core.hosts import format_authority
from egressbox.core.ip import IPAddress
from egressbox.core.upstream import UpstreamTarget
from egressbox.net.dial import (
    DialCallback,
    DialError,
    DialFailure,
    Dialing,
    interleave_families,
    start_connect,
)
from egressbox.net.resolve import Resolver
from egressbox.protocols.upstream import (
    UPSTREAM_FAILED,
    Handshake,
    Upstream,
    UpstreamRefusedError,
    handshake,
)


class _Handshaking(asyncio.Protocol):
    """The upstream connection's protocol until the upstream has answered the handshake."""

    def __init__(self, machine: Handshake, answered: asyncio.Future[None]) -> None:
        self.machine = machine
        self.answered = answered
        self.transport: asyncio.Transport | None = None
        self.eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.machine.start())

    def data_received(self, data: bytes) -> None:
        try:
            out = self.machine.feed(data)
        except UpstreamRefusedError as exc:
            self._fail(exc)
            return
        if out and self.transport is not None:
            self.transport.write(out)
        if self.machine.done and not self.answered.done():
            # Hold what comes next for the caller's protocol (the handover is a loop turn away).
            assert self.transport is not None
            self.transport.pause_reading()
            self.answered.set_result(None)

    def eof_received(self) -> bool:
        self.eof = True
        if not self.machine.done:
            message = "the upstream proxy closed the connection before it answered"
            self._fail(UpstreamRefusedError(UPSTREAM_FAILED, message))
            return False
        return True  # passed on to the caller's protocol at the handover

    def connection_lost(self, exc: Exception | None) -> None:
        message = "the upstream proxy's connection was lost during the handshake"
        self._fail(UpstreamRefusedError(UPSTREAM_FAILED, message))

    def _fail(self, exc: UpstreamRefusedError) -> None:
        if not self.answered.done():
            self.answered.set_exception(exc)


class UpstreamDial:
    """A connection being made through the upstream (see dial_through); `cancel()` closes
    whatever it opened, as Dialing's does. `address` is the checked address the upstream
    was asked for (with `name`: the first checked one), what a plain-HTTP forwarder
    compares a later request's decision with. (Not a Dialing subclass: that class is
    compiled in the proxy core, and an interpreted class cannot inherit from it.)"""

    __slots__ = ("_dialing", "address", "on_done", "task", "transport")

    def __init__(
        self,
        upstream: Upstream,
        resolver: Resolver,
        decision: Decision,
        protocol: asyncio.Protocol,
        on_done: DialCallback,
        *,
        timeout: float,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.address: IPAddress | None = decision.addresses[0] if decision.addresses else None
        self.on_done: DialCallback | None = on_done
        self.transport: asyncio.Transport | None = None
        self._dialing: Dialing | None = None
        run = self._run(upstream, resolver, decision, protocol, timeout=timeout, loop=loop)
        self.task = loop.create_task(run)

    def cancel(self) -> None:
        self.on_done = None
        self.task.cancel()
        self._drop()

    def _drop(self) -> None:
        if self._dialing is not None:
            self._dialing.cancel()
            self._dialing = None
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    async def _run(
        self,
        upstream: Upstream,
        resolver: Resolver,
        decision: Decision,
        protocol: asyncio.Protocol,
        *,
        timeout: float,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        error: DialError | None = None
        shake: _Handshaking | None = None
        try:
            async with asyncio.timeout(timeout):
                shake = await self._through(upstream, resolver, decision, loop)
        except TimeoutError:
            self._drop()
            where = format_authority(decision.host, decision.port)
            error = DialError(
                DialFailure.CONNECT_TIMEOUT,
                f"no connection to {where} through the upstream proxy "
                f"{_upstream_text(upstream)} within {timeout:g} s",
            )
        except DialError as exc:
            self._drop()
            error = exc
        except Exception as exc:  # a bug must not leave the caller waiting
            self._drop()
            error = DialError(DialFailure.UPSTREAM_FAILED, f"internal error: {exc!r}")
        on_done, self.on_done = self.on_done, None
        if on_done is None:
            self._drop()
            return
        if error is not None or shake is None:
            on_done(None, error or DialError(DialFailure.UPSTREAM_FAILED, "no connection"))
            return
        transport = self._hand_over(shake, protocol)
        if transport is None:
            message = f"the upstream proxy {_upstream_text(upstream)} closed the tunnel"
            on_done(None, DialError(DialFailure.UPSTREAM_FAILED, message))
            return
        on_done(transport, None)

    def _hand_over(
        self, shake: _Handshaking, protocol: asyncio.Protocol
    ) -> asyncio.Transport | None:
        """Give the open tunnel to the caller's protocol as a fresh connection."""
        transport, self.transport = self.transport, None
        if transport is None or transport.is_closing():
            return None
        transport.resume_reading()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if shake.machine.trailing:
            protocol.data_received(shake.machine.trailing)
        if shake.eof and not protocol.eof_received():
            transport.close()
        return transport

    async def _through(
        self,
        upstream: Upstream,
        resolver: Resolver,
        decision: Decision,
        loop: asyncio.AbstractEventLoop,
    ) -> _Handshaking:
        where = await _upstream_addresses(upstream, resolver)
        targets: list[str | IPAddress]
        if upstream.proxy.target is UpstreamTarget.NAME:
            targets = [decision.host]
        else:
            targets = list(interleave_families(decision.addresses))
        last: UpstreamRefusedError | None = None
        for target in targets:
            try:
                shake = await self._attempt(upstream, where, target, decision.port, loop)
            except UpstreamRefusedError as exc:
                last = exc
                if not exc.retry:
                    break
                continue
            if not isinstance(target, str):
                self.address = target
            return shake
        if last is None:
            raise DialError(DialFailure.UPSTREAM_FAILED, "no checked address to ask for")
        raise DialError(DialFailure(last.failure), str(last))

    async def _attempt(
        self,
        upstream: Upstream,
        where: tuple[IPAddress, ...],
        target: str | IPAddress,
        port: int,
        loop: asyncio.AbstractEventLoop,
    ) -> _Handshaking:
        self._drop()  # a previous attempt's connection
        answered: asyncio.Future[None] = loop.create_future()
        shake = _Handshaking(handshake(upstream, target, port), answered)
        connected: asyncio.Future[asyncio.Transport] = loop.create_future()

        def tcp_done(transport: asyncio.Transport | None, error: DialError | None) -> None:
            self._dialing = None
            if connected.done():
                if transport is not None:
                    transport.abort()
                return
            if transport is None:
                assert error is not None
                message = f"cannot reach the upstream proxy {_upstream_text(upstream)}: {error}"
                connected.set_exception(DialError(DialFailure.UPSTREAM_FAILED, message))
            else:
                connected.set_result(transport)

        # Its own timeout is the outer one's (this one only has to exist).
        self._dialing = start_connect(where, upstream.proxy.port, shake, tcp_done, timeout=3600)
        self.transport = await connected
        await answered
        return shake


async def _upstream_addresses(upstream: Upstream, resolver: Resolver) -> tuple[IPAddress, ...]:
    host = upstream.proxy.host
    with contextlib.suppress(ValueError):
        return (ipaddress.ip_address(host),)
    try:
        return (await resolver.resolve(host)).addresses
    except ResolveError as exc:
        message = f"cannot resolve the upstream proxy {host}: {exc}"
        raise DialError(DialFailure.UPSTREAM_FAILED, message) from None


def _upstream_text(upstream: Upstream) -> str:
    return format_authority(upstream.proxy.host, upstream.proxy.port)


def dial_through(
    upstream: Upstream,
    resolver: Resolver,
    decision: Decision,
    protocol: asyncio.Protocol,
    on_done: DialCallback,
    *,
    timeout: float,
    loop: asyncio.AbstractEventLoop,
) -> UpstreamDial:
    """`start_connect` through `upstream` for an allowed decision: `protocol` gets the
    tunnel as a fresh connection, `on_done` is called once (unless cancelled first)."""
    return UpstreamDial(upstream, resolver, decision, protocol, on_done, timeout=timeout, loop=loop)
