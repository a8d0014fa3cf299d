"""Counters and latency windows per replica, and the snapshots ``svc.metrics()`` returns.

Counting happens on the request path (the caller's thread and the runtime's
loop thread, under the service's lock), so it is a few integer additions and
one append to a fixed-size ring; percentiles are computed only when a snapshot
is taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LatencyWindow", "ReplicaStats", "ReplicaMetrics", "ServiceMetrics", "percentile"]

#: Latencies kept per replica for p50/p99 (the most recent ones).
WINDOW = 2048


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of already sorted values, nearest rank; 0.0 when empty."""
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


class LatencyWindow:
    """The last ``size`` latencies in seconds (a ring; O(1) per sample)."""

    __slots__ = ("_values", "_next", "_size")

    def __init__(self, size: int = WINDOW) -> None:
        self._values: list[float] = []
        self._next = 0
        self._size = size

    def add(self, seconds: float) -> None:
        """Record one latency."""
        values = self._values
        if len(values) < self._size:
            values.append(seconds)
        else:
            i = self._next
            values[i] = seconds
            self._next = i + 1 if i + 1 < self._size else 0

    def values(self) -> list[float]:
        """A copy of the samples held."""
        return list(self._values)


class ReplicaStats:
    """Live counters of one replica slot (mutated under the service's lock)."""

    __slots__ = ("requests", "errors", "failed_in_flight", "retried", "restarts", "latency")

    def __init__(self) -> None:
        self.requests = 0  #: requests finished (value or error)
        self.errors = 0  #: requests that ended in an error (endpoint raised or replica died)
        self.failed_in_flight = 0  #: requests in flight when the replica died
        self.retried = 0  #: of those, retried elsewhere (idempotent endpoints)
        self.restarts = 0  #: times the replica was rebuilt after a failure
        self.latency = LatencyWindow()


@dataclass(frozen=True)
class ReplicaMetrics:
    """A snapshot of one replica: counters since it was added, latency in ms over the
    last requests (time from ``route`` to the result, queueing included)."""

    replica: int
    state: str
    healthy: bool
    requests: int
    errors: int
    in_flight: int
    queued: int
    restarts: int
    failed_in_flight: int
    retried: int
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class ServiceMetrics:
    """A snapshot of a whole service: sums over its replicas, latency over all of them."""

    name: str
    replicas: list[ReplicaMetrics] = field(default_factory=list)
    requests: int = 0
    errors: int = 0
    in_flight: int = 0
    queued: int = 0
    restarts: int = 0
    overloaded: int = 0  #: requests refused with ServiceOverloaded
    p50_ms: float = 0.0
    p99_ms: float = 0.0

    @property
    def healthy_replicas(self) -> int:
        """How many replicas take requests now."""
        return sum(1 for r in self.replicas if r.healthy)


def replica_snapshot(slot: int, state: str, in_flight: int, queued: int, stats: ReplicaStats) -> ReplicaMetrics:
    """A frozen view of one replica's counters (call under the service's lock)."""
    lat = sorted(stats.latency.values())
    return ReplicaMetrics(
        replica=slot, state=state, healthy=state == "healthy", requests=stats.requests, errors=stats.errors,
        in_flight=in_flight, queued=queued, restarts=stats.restarts, failed_in_flight=stats.failed_in_flight,
        retried=stats.retried, p50_ms=percentile(lat, 0.5) * 1e3, p99_ms=percentile(lat, 0.99) * 1e3,
    )


def service_snapshot(name: str, replicas: list[ReplicaMetrics], all_latencies: list[float], overloaded: int) -> ServiceMetrics:
    """Sum replica snapshots into a service snapshot."""
    lat = sorted(all_latencies)
    return ServiceMetrics(
        name=name, replicas=replicas, requests=sum(r.requests for r in replicas), errors=sum(r.errors for r in replicas),
        in_flight=sum(r.in_flight for r in replicas), queued=sum(r.queued for r in replicas),
        restarts=sum(r.restarts for r in replicas), overloaded=overloaded,
        p50_ms=percentile(lat, 0.5) * 1e3, p99_ms=percentile(lat, 0.99) * 1e3,
    )
