"""Prometheus text exposition of the runtime's figures (``/metrics``).

Takes the per-process snapshots the dashboard gathers (see
``actormesh.runtime.stats_snapshot``) and renders them with prometheus-client,
one sample per proc and per actor.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ._figures import LATENCY_BUCKETS_S

__all__ = ["render_prometheus", "PROMETHEUS_CONTENT_TYPE"]

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _SnapshotCollector:
    def __init__(self, snapshots: Sequence[dict[str, Any]]) -> None:
        self._snapshots = snapshots

    def describe(self) -> list[Any]:
        return []  # nothing to check at registration: names are fixed below

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        proc_labels = ["proc", "host", "pid"]
        out = CounterMetricFamily("actormesh_proc_messages_out", "Messages a process sent to other processes", labels=proc_labels)
        sent = CounterMetricFamily("actormesh_proc_bytes_out", "Message payload bytes a process sent", labels=proc_labels)
        rss = GaugeMetricFamily("actormesh_proc_rss_bytes", "Resident memory of a process", labels=proc_labels)
        cpu = CounterMetricFamily("actormesh_proc_cpu_seconds", "CPU seconds a process used", labels=proc_labels)
        actor_labels = ["proc", "mesh", "actor", "rank"]
        msgs = CounterMetricFamily("actormesh_actor_messages_in", "Messages an actor handled", labels=actor_labels)
        errs = CounterMetricFamily("actormesh_actor_errors", "Endpoint calls of an actor that raised", labels=actor_labels)
        restarts = CounterMetricFamily("actormesh_actor_restarts", "Times an actor was restarted in place", labels=actor_labels)
        depth = GaugeMetricFamily("actormesh_actor_mailbox_depth", "Messages waiting in an actor's mailbox", labels=actor_labels)
        latency = HistogramMetricFamily("actormesh_endpoint_latency_seconds", "Time an actor took to handle a message", labels=actor_labels)
        for snap in self._snapshots:
            p = [snap["address"], snap["hostname"], str(snap["pid"])]
            out.add_metric(p, snap["messages_out"])
            sent.add_metric(p, snap["bytes_out"])
            rss.add_metric(p, snap["rss_bytes"])
            cpu.add_metric(p, snap["cpu_s"])
            for a in snap["actors"]:
                labels = [snap["address"], a["mesh"], a["display"], str(a["rank"])]
                msgs.add_metric(labels, a["messages_in"])
                errs.add_metric(labels, a["errors"])
                restarts.add_metric(labels, a["restarts"])
                depth.add_metric(labels, a["mailbox"])
                latency.add_metric(labels, _buckets(a["latency_counts"]), a["latency_sum_s"])
        yield from (out, sent, rss, cpu, msgs, errs, restarts, depth, latency)


def _buckets(counts: Sequence[int]) -> list[tuple[str, float]]:
    bounds = [*(repr(b) for b in LATENCY_BUCKETS_S), "+Inf"]
    total = 0
    rows: list[tuple[str, float]] = []
    for bound, n in zip(bounds, counts):
        total += n
        rows.append((bound, total))
    return rows


def render_prometheus(snapshots: Sequence[dict[str, Any]]) -> bytes:
    """The figures of ``snapshots`` (one dict per process) as Prometheus text.

    Needs prometheus-client (``pip install actormesh[dashboard]``).
    """
    try:
        from prometheus_client import CollectorRegistry, generate_latest
    except ImportError as exc:
        raise ImportError("Prometheus output needs prometheus-client: pip install 'actormesh[dashboard]'") from exc
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshots))  # type: ignore[arg-type]
    return generate_latest(registry)
