"""What a `serve` process runs besides the proxy, for a fleet: the admin listener with its
metrics and readiness, the other workers' numbers, systemd notifications, the policy watch
and the drain.

Workers (`--workers N`): the parent binds the admin listener before it forks and gives it to
worker 0 only, which serves it for all of them. Every other worker sends a snapshot of its
numbers (metrics.Snapshot, one JSON datagram) every SNAPSHOT_INTERVAL, when it starts to
drain and when it has drained, on one AF_UNIX datagram socketpair whose other end worker 0
reads. /metrics then shows every worker's series under its `worker` label (the others' at
most a second old); /readyz is ready only when worker 0 and every other worker's latest
snapshot (at most PEER_STALE old) say ready. Why not one admin port per worker: a scraper
would need N targets on ports it cannot know; why not prometheus_client's multiprocess mode:
its values live in memory-mapped files written on every increment (a lock and a getpid() per
decision), its gauges cannot be read from the proxy's state at scrape time, and it needs an
environment variable set before the library is imported.

The drain (SIGTERM/SIGINT): /readyz turns 503 at once and systemd is told STOPPING=1; with
`--drain-delay S` the proxy keeps accepting for S seconds, so that a load balancer checking
/readyz stops sending new connections before the listeners close (a listener that closes
resets the connections still waiting in its accept queue); then the proxy drains as before
([limits] drain_timeout), and the admin listener closes last.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from egressbox.core.decide import SelfEndpoints
from egressbox.core.hosts import format_authority
from egressbox.proxy.gate import ProxyState, stderr_log
from egressbox.serve.systemd import Notifier
from egressbox.serve.watch import WATCH_INTERVAL, PolicyWatch

if TYPE_CHECKING:
    from egressbox.proxy.broker import Broker

    # admin.py and metrics.py load prometheus_client (about 50 ms): only with --admin.
    from egressbox.proxy.server import EgressProxy
    from egressbox.serve.admin import AdminServer
    from egressbox.serve.metrics import Metrics, Snapshot

# How often a worker sends its numbers to the one serving the admin listener.
SNAPSHOT_INTERVAL = 1.0
# An older snapshot means that worker stopped answering: not ready.
PEER_STALE = 3.0 * SNAPSHOT_INTERVAL
# The largest snapshot datagram read (a snapshot is a few KiB: a series per reason seen).
MAX_SNAPSHOT_BYTES = 1 << 18


@dataclass
class Prepared:
    """What serve() made before any event loop or fork, for every serving process."""

    admin_socket: socket.socket | None = None
    # Its address, kept apart: a worker that closed its copy of the socket still needs it.
    admin_address: tuple[str, int] | None = None
    admin_token: str | None = None
    # Listening sockets passed by systemd (socket activation), by kind (http, socks5).
    inherited: dict[str, socket.socket] = field(default_factory=dict)
    notifier: Notifier = field(default_factory=lambda: Notifier(None))
    watch: PolicyWatch | None = None
    drain_delay: float = 0.0
    workers: int = 1
    # [[secret]] / [[request_rule]]: the broker every proxy of this serve uses (its values
    # read and the operator's CA loaded at start: serve/brokering.py); None: nothing to it.
    broker: Broker | None = None

    def set_admin(self, sock: socket.socket) -> None:
        from egressbox.serve.admin import address_of

        self.admin_socket = sock
        self.admin_address = address_of(sock)

    @property
    def admin_on(self) -> bool:
        return self.admin_address is not None

    def admin_authority(self) -> str | None:
        address = self.admin_address
        return format_authority(*address) if address is not None else None


def with_admin(endpoints: SelfEndpoints, address: tuple[str, int]) -> SelfEndpoints:
    """The proxy's own endpoints plus the admin listener's: a client may not be proxied to
    it (the same rule as for the proxy's own ports)."""
    from egressbox.net.netinfo import local_addresses

    host, port = address
    ip = ipaddress.ip_address(host)
    wildcard = set(endpoints.wildcard_ports)
    local = endpoints.local_addresses
    if ip.is_unspecified:
        wildcard.add(port)
        local = local or frozenset(local_addresses())
    return SelfEndpoints(endpoints.endpoints | {(ip, port)}, frozenset(wildcard), local)


class ProcessStatus:
    """Readiness and metrics of one serving process (and, in worker 0, of its peers)."""

    def __init__(self, counts: Metrics, state: ProxyState, peers: Peers | None = None) -> None:
        from egressbox.serve.metrics import Exposition, build_info

        self.counts = counts
        self.state = state
        self.peers = peers
        self.draining = False
        self._exposition = Exposition(self.snapshots, build_info())

    def local_ready(self) -> tuple[bool, str]:
        state = self.state
        if self.draining:
            return False, "draining"
        if not state.accepting:
            return False, "not accepting"
        if state.audit_error is not None and not state.audit_recovered():
            return False, f"the audit log cannot be written ({state.audit_error})"
        return True, ""

    def ready(self) -> tuple[bool, str]:
        ready, why = self.local_ready()
        if ready and self.peers is not None:
            why = self.peers.problem()
            ready = not why
        return ready, why

    def snapshot(self) -> Snapshot:
        state = self.state
        return self.counts.snapshot(
            connections=len(state.connections),
            tunnels=len(state.tunnels),
            internal_errors=state.internal_errors,
            ready=self.local_ready()[0],
        )

    def snapshots(self) -> list[Snapshot]:
        own = [self.snapshot()]
        return own if self.peers is None else own + self.peers.latest()

    def metrics(self, accept: str) -> tuple[bytes, str]:
        return self._exposition.render(accept)


class Peers:
    """Worker 0's copy of the other workers' latest snapshots."""

    def __init__(
        self, sock: socket.socket, count: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._sock = sock
        self._count = count
        self._clock = clock
        self._latest: dict[int, tuple[float, Snapshot]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._sock.setblocking(False)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self.read)

    def read(self) -> None:
        from egressbox.serve.metrics import Snapshot

        while True:
            try:
                data = self._sock.recv(MAX_SNAPSHOT_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            try:
                shot = Snapshot.from_json(json.loads(data))
            except (ValueError, TypeError, KeyError):
                continue  # not from one of our workers: nothing to count
            if 0 < shot.worker < self._count:
                self._latest[shot.worker] = (self._clock(), shot)

    def latest(self) -> list[Snapshot]:
        return [shot for _, shot in sorted(self._latest.values(), key=lambda t: t[1].worker)]

    def problem(self) -> str:
        """Why not every other worker is ready ("" when all are)."""
        now = self._clock()
        for worker in range(1, self._count):
            seen = self._latest.get(worker)
            if seen is None:
                return f"worker {worker} has not reported yet"
            at, shot = seen
            if now - at > PEER_STALE:
                return f"worker {worker} has not reported for {now - at:.0f} s"
            if not shot.ready:
                return f"worker {worker} is not ready"
        return ""

    def close(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._sock.fileno())
        self._sock.close()


class ServingProcess:
    """One serving process's extras: a single `serve`, or one worker of `--workers N`."""

    def __init__(
        self,
        prepared: Prepared,
        *,
        index: int = 0,
        channel: socket.socket | None = None,
        admin_socket: socket.socket | None = None,
    ) -> None:
        self.prepared = prepared
        self.index = index
        self.channel = channel  # worker 0: the end it reads; the others: the end they send on
        self.admin_socket = admin_socket if index == 0 else None
        self.metrics: Metrics | None = None
        if prepared.admin_on:
            from egressbox.serve.metrics import Metrics

            self.metrics = Metrics(index)
        self.status: ProcessStatus | None = None
        self.admin: AdminServer | None = None
        self.stop = asyncio.Event()
        self._hurry = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def single(self) -> bool:
        return self.prepared.workers <= 1

    async def start(self, proxy: EgressProxy) -> None:
        """After the proxy started: the admin listener (worker 0), the peers' channel."""
        state = proxy.state
        if self.prepared.admin_address is not None:
            state.self_endpoints = with_admin(state.self_endpoints, self.prepared.admin_address)
        if self.metrics is None:
            return
        peers = None
        if self.index == 0 and self.channel is not None:
            peers = Peers(self.channel, self.prepared.workers)
            peers.start()
        self.status = ProcessStatus(self.metrics, state, peers)
        if self.admin_socket is not None:
            from egressbox.serve.admin import AdminServer

            self.admin = AdminServer(
                self.admin_socket, self.status, token=self.prepared.admin_token
            )
            await self.admin.start()

    def ready_line(self, line: dict[str, str]) -> dict[str, str]:
        """The ready line with the admin listener's address (a single process; the workers'
        parent adds it itself)."""
        authority = self.prepared.admin_authority()
        if authority is not None and self.single:
            line["admin"] = authority
        return line

    def serving(self, reload: Callable[[], object]) -> None:
        """After the ready line: tell systemd (a single process), watch the policy file (a
        single process: the workers' parent watches for them), send snapshots (a worker
        other than 0)."""
        loop = asyncio.get_running_loop()
        if self.single:
            self.prepared.notifier.notify("READY=1", "STATUS=serving")
            if self.prepared.watch is not None:
                self._tasks.append(loop.create_task(_watch(self.prepared.watch, reload)))
        elif self.index > 0 and self.channel is not None and self.status is not None:
            self._tasks.append(loop.create_task(self._send_snapshots()))

    def on_stop_signal(self) -> None:
        """SIGINT/SIGTERM: the first one starts the drain, a second one cuts --drain-delay."""
        if self.stop.is_set():
            self._hurry.set()
        self.stop.set()

    async def drain(self, proxy: EgressProxy) -> None:
        if self.status is not None:
            self.status.draining = True
        if self.single:
            self.prepared.notifier.notify("STOPPING=1", "STATUS=draining")
        self._send_snapshot()
        if self.prepared.drain_delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._hurry.wait(), self.prepared.drain_delay)
        await proxy.close()
        # Snapshots (and the watch) go on through the drain, so worker 0 keeps this worker's
        # numbers current; then the final ones, for worker 0 to show while it drains.
        for task in self._tasks:
            task.cancel()
        self._send_snapshot()
        if self.admin is not None:
            await self.admin.close()
        if self.status is not None and self.status.peers is not None:
            self.status.peers.close()

    def reloaded(self, ok: bool) -> None:
        if self.metrics is not None:
            self.metrics.reloaded(ok)

    async def _send_snapshots(self) -> None:
        while True:
            self._send_snapshot()
            await asyncio.sleep(SNAPSHOT_INTERVAL)

    def _send_snapshot(self) -> None:
        if self.index == 0 or self.channel is None or self.status is None:
            return
        data = json.dumps(self.status.snapshot().to_json()).encode()
        # Never wait: worker 0 reads at once, and a lost snapshot is replaced a second later.
        with contextlib.suppress(OSError):
            self.channel.send(data, socket.MSG_DONTWAIT)


async def _watch(watch: PolicyWatch, reload: Callable[[], object]) -> None:
    while True:
        await asyncio.sleep(WATCH_INTERVAL)
        try:
            if watch.poll():
                reload()
        except Exception as exc:  # a bug must not end the watch silently
            stderr_log(f"--watch-policy: {exc!r}")
