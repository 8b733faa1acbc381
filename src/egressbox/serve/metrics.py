"""serve's metrics: what the proxy counts, and its rendering in the Prometheus formats.

The proxy's hot path keeps plain integers (`Metrics`, the gate's Meter): a decision costs one
method call and one dict increment keyed by its three enums (about 0.1 us, measured), no label
building and no lock. Gauges (open connections and tunnels, readiness) are read from the
proxy's state when a snapshot is taken. A `Snapshot` is one process's numbers at one moment,
as JSON-ready data: with `--workers N` each worker sends its own to the worker that serves the
admin listener (see fleet.py), and `families()` turns every worker's snapshot into metric
families with a `worker` label, which prometheus_client renders (text format 0.0.4, or
OpenMetrics when the scraper asks for it).

The decision counter is incremented where the audit record is written (ProxyState.emit and
emit_decision), after the write succeeded: egressbox_decisions_total always adds up to the
records in the audit log (a record that could not be written counts as an audit write failure
instead). Relayed bytes are counted when a tunnel ends, so a long tunnel shows its bytes at
its end; plain-HTTP forwarding is not counted there.
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry

from egressbox.audit.record import AuditProtocol
from egressbox.core.errors import Reason, Verdict

# Upper bounds (seconds) of the DNS query histogram: a loopback or LAN resolver answers in
# well under a millisecond, a cold recursive lookup in tens to hundreds, and the whole
# resolution is bounded by [dns] timeout (5 s by default).
DNS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
RELOAD_OUTCOMES = ("ok", "refused")

DecisionKey = tuple[AuditProtocol, Verdict, Reason]


@dataclass
class Snapshot:
    """One process's numbers at one moment (JSON-ready with to_json / from_json)."""

    worker: int
    decisions: dict[tuple[str, str, str], int] = field(default_factory=dict)
    audit_failures: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    dns_queries: dict[str, int] = field(default_factory=dict)
    dns_cache_hits: int = 0
    # Per DNS_BUCKETS bound, then one for everything slower (not cumulative).
    dns_buckets: list[int] = field(default_factory=lambda: [0] * (len(DNS_BUCKETS) + 1))
    dns_seconds: float = 0.0
    reloads: dict[str, int] = field(default_factory=dict)
    internal_errors: int = 0
    connections: int = 0
    tunnels: int = 0
    ready: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "decisions": [[*key, count] for key, count in self.decisions.items()],
            "audit_failures": self.audit_failures,
            "bytes": [self.bytes_up, self.bytes_down],
            "dns_queries": self.dns_queries,
            "dns_cache_hits": self.dns_cache_hits,
            "dns_buckets": self.dns_buckets,
            "dns_seconds": self.dns_seconds,
            "reloads": self.reloads,
            "internal_errors": self.internal_errors,
            "connections": self.connections,
            "tunnels": self.tunnels,
            "ready": self.ready,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Snapshot:
        """A snapshot from to_json()'s data; ValueError (or TypeError) when it is not one."""
        decisions: dict[tuple[str, str, str], int] = {}
        for protocol, verdict, reason, count in data["decisions"]:
            decisions[(str(protocol), str(verdict), str(reason))] = _count(count)
        buckets = [_count(n) for n in data["dns_buckets"]]
        if len(buckets) != len(DNS_BUCKETS) + 1:
            raise ValueError("wrong number of DNS buckets")
        up, down = data["bytes"]
        return cls(
            worker=_count(data["worker"]),
            decisions=decisions,
            audit_failures=_count(data["audit_failures"]),
            bytes_up=_count(up),
            bytes_down=_count(down),
            dns_queries={str(k): _count(v) for k, v in data["dns_queries"].items()},
            dns_cache_hits=_count(data["dns_cache_hits"]),
            dns_buckets=buckets,
            dns_seconds=float(data["dns_seconds"]),
            reloads={str(k): _count(v) for k, v in data["reloads"].items()},
            internal_errors=_count(data["internal_errors"]),
            connections=_count(data["connections"]),
            tunnels=_count(data["tunnels"]),
            ready=bool(data["ready"]),
        )


def _count(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return value


class Metrics:
    """The counts of one process; the proxy calls it as its gate.Meter (and the resolver
    as its DnsMeter), serve calls reloaded()."""

    def __init__(self, worker: int = 0) -> None:
        self.worker = worker
        self.decisions: dict[DecisionKey, int] = {}
        self.audit_failures = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.dns_queries: dict[str, int] = {}
        self.dns_cache_hits = 0
        self.dns_buckets = [0] * (len(DNS_BUCKETS) + 1)
        self.dns_seconds = 0.0
        self.reloads = dict.fromkeys(RELOAD_OUTCOMES, 0)

    # -- the Meter: called on the proxy's paths -------------------------------------------

    def decided(self, protocol: AuditProtocol, verdict: Verdict, reason: Reason) -> None:
        key = (protocol, verdict, reason)
        decisions = self.decisions
        decisions[key] = decisions.get(key, 0) + 1

    def audit_failed(self) -> None:
        self.audit_failures += 1

    def relayed(self, up: int, down: int) -> None:
        self.bytes_up += up
        self.bytes_down += down

    def dns_query(self, seconds: float, outcome: str) -> None:
        self.dns_queries[outcome] = self.dns_queries.get(outcome, 0) + 1
        self.dns_buckets[bisect.bisect_left(DNS_BUCKETS, seconds)] += 1
        self.dns_seconds += seconds

    def dns_cache_hit(self) -> None:
        self.dns_cache_hits += 1

    # -- serve's own events --------------------------------------------------------------

    def reloaded(self, ok: bool) -> None:
        self.reloads["ok" if ok else "refused"] += 1

    def snapshot(
        self, *, connections: int, tunnels: int, internal_errors: int, ready: bool
    ) -> Snapshot:
        return Snapshot(
            worker=self.worker,
            decisions={(p.value, v.value, r.value): n for (p, v, r), n in self.decisions.items()},
            audit_failures=self.audit_failures,
            bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
            dns_queries=dict(self.dns_queries),
            dns_cache_hits=self.dns_cache_hits,
            dns_buckets=list(self.dns_buckets),
            dns_seconds=self.dns_seconds,
            reloads=dict(self.reloads),
            internal_errors=internal_errors,
            connections=connections,
            tunnels=tunnels,
            ready=ready,
        )


# -- rendering ---------------------------------------------------------------------------


def families(snapshots: Iterable[Snapshot], build: Mapping[str, str]) -> Iterator[Metric]:
    """The metric families of every worker's snapshot (label `worker`), and build info."""
    shots = sorted(snapshots, key=lambda s: s.worker)
    info = GaugeMetricFamily(
        "egressbox_build_info", "egressbox's version and proxy core (value 1)", labels=[*build]
    )
    info.add_metric(list(build.values()), 1)
    yield info
    yield _decisions(shots)
    yield from _counters(shots)
    yield from _gauges(shots)
    yield _dns_histogram(shots)


def _decisions(shots: list[Snapshot]) -> Metric:
    family = CounterMetricFamily(
        "egressbox_decisions",
        "Decisions audited (one per audit record written), by protocol, decision and reason",
        labels=["worker", "protocol", "decision", "reason"],
    )
    for shot in shots:
        for (protocol, verdict, reason), count in sorted(shot.decisions.items()):
            family.add_metric([str(shot.worker), protocol, verdict, reason], count)
    return family


def _counters(shots: list[Snapshot]) -> Iterator[Metric]:
    simple: list[tuple[str, str, Callable[[Snapshot], int]]] = [
        (
            "egressbox_audit_write_failures",
            "Audit records that could not be written (each refused its request)",
            lambda s: s.audit_failures,
        ),
        (
            "egressbox_dns_cache_hits",
            "Names answered from the resolver's cache",
            lambda s: s.dns_cache_hits,
        ),
        (
            "egressbox_internal_errors",
            "Bugs caught in a connection's callbacks (each closed that connection)",
            lambda s: s.internal_errors,
        ),
    ]
    for name, doc, value in simple:
        family = CounterMetricFamily(name, doc, labels=["worker"])
        for shot in shots:
            family.add_metric([str(shot.worker)], value(shot))
        yield family
    relayed = CounterMetricFamily(
        "egressbox_relayed_bytes",
        "Bytes relayed by tunnels that ended (up: towards the destination)",
        labels=["worker", "direction"],
    )
    queries = CounterMetricFamily(
        "egressbox_dns_queries",
        "DNS resolutions sent upstream (A and AAAA together), by outcome",
        labels=["worker", "outcome"],
    )
    reloads = CounterMetricFamily(
        "egressbox_reloads",
        "Policy reloads (SIGHUP or --watch-policy), by outcome (refused keeps the old policy)",
        labels=["worker", "outcome"],
    )
    for shot in shots:
        worker = str(shot.worker)
        relayed.add_metric([worker, "up"], shot.bytes_up)
        relayed.add_metric([worker, "down"], shot.bytes_down)
        for outcome, count in sorted(shot.dns_queries.items()):
            queries.add_metric([worker, outcome], count)
        for outcome in RELOAD_OUTCOMES:
            reloads.add_metric([worker, outcome], shot.reloads.get(outcome, 0))
    yield relayed
    yield queries
    yield reloads


def _gauges(shots: list[Snapshot]) -> Iterator[Metric]:
    gauges: list[tuple[str, str, Callable[[Snapshot], int]]] = [
        (
            "egressbox_connections_open",
            "Client connections open that are not tunnels (being decided, or forwarding)",
            lambda s: s.connections,
        ),
        ("egressbox_tunnels_open", "Tunnels open", lambda s: s.tunnels),
        (
            "egressbox_ready",
            "1 while accepting with a writable audit log, 0 while draining or refusing",
            lambda s: int(s.ready),
        ),
    ]
    for name, doc, value in gauges:
        family = GaugeMetricFamily(name, doc, labels=["worker"])
        for shot in shots:
            family.add_metric([str(shot.worker)], value(shot))
        yield family


def _dns_histogram(shots: list[Snapshot]) -> Metric:
    family = HistogramMetricFamily(
        "egressbox_dns_query_duration_seconds",
        "Time a DNS resolution sent upstream took",
        labels=["worker"],
    )
    bounds = [*(repr(b) for b in DNS_BUCKETS), "+Inf"]
    for shot in shots:
        cumulative, buckets = 0, []
        for bound, count in zip(bounds, shot.dns_buckets, strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        family.add_metric([str(shot.worker)], buckets, sum_value=shot.dns_seconds)
    return family


class _Collector(Collector):
    def __init__(self, source: Callable[[], Iterable[Snapshot]], build: Mapping[str, str]):
        self._source = source
        self._build = dict(build)

    def collect(self) -> Iterable[Metric]:
        return list(families(self._source(), self._build))


class Exposition:
    """Renders the snapshots `source` returns, in the format a scraper's Accept asks for."""

    def __init__(self, source: Callable[[], Iterable[Snapshot]], build: Mapping[str, str]):
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Collector(source, build))

    def render(self, accept: str) -> tuple[bytes, str]:
        """(body, content type)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self._registry), content_type


def build_info() -> dict[str, str]:
    from egressbox.protocols import http1

    # The package is loaded already (it is this module's parent): read its version without
    # an import of the package, which would close an import cycle through its lazy exports.
    version = str(getattr(sys.modules["egressbox"], "__version__", "unknown"))
    compiled = not (http1.__file__ or "").endswith(".py")
    return {"version": version, "core": "compiled" if compiled else "interpreted"}
