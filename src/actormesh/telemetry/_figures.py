"""The runtime's own figures: per actor and per process, kept as plain counters.

Each actor's figures are written only by that actor's thread (async actors:
its loop), so no lock is taken; readers (the stats snapshot) see values that
may be one message behind. Process figures written from several threads
(``bytes_out``) are statistics, not invariants.
"""

from __future__ import annotations

import bisect
import os
import time
from typing import Any

__all__ = ["LATENCY_BUCKETS_S", "ActorFigures", "ProcFigures", "FIGURES", "process_usage"]

#: Upper bounds (seconds) of the endpoint latency histogram; the last bucket is +Inf.
LATENCY_BUCKETS_S: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ActorFigures:
    """Counters of one actor (kept across restarts of the same member)."""

    __slots__ = ("messages_in", "errors", "restarts", "counts", "total_s")

    def __init__(self) -> None:
        self.messages_in = 0
        self.errors = 0
        self.restarts = 0
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.total_s = 0.0

    def handled(self, seconds: float) -> None:
        """One message handled in ``seconds`` (endpoint latency)."""
        self.messages_in += 1
        self.total_s += seconds
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1

    def as_dict(self) -> dict[str, Any]:
        """The counters as builtins (for pickling and JSON)."""
        return {"messages_in": self.messages_in, "errors": self.errors, "restarts": self.restarts,
                "latency_counts": list(self.counts), "latency_sum_s": self.total_s}


class ProcFigures:
    """Counters of this process and the table of its actors' figures."""

    def __init__(self) -> None:
        self.bytes_out = 0
        self.started = time.time()
        self.actors: dict[str, ActorFigures] = {}

    def actor(self, name: str) -> ActorFigures:
        """The figures of the actor named ``name`` (made on first use)."""
        fig = self.actors.get(name)
        if fig is None:
            fig = self.actors.setdefault(name, ActorFigures())
        return fig

    def restarted(self, name: str) -> None:
        """The member named ``name`` was replaced in place after a failure."""
        self.actor(name).restarts += 1

    def prune(self, live: set[str]) -> None:
        """Forget figures of actors that are gone (keeps the table bounded)."""
        for name in [n for n in self.actors if n not in live]:
            self.actors.pop(name, None)


FIGURES = ProcFigures()

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_usage() -> tuple[int, float]:
    """(resident set size in bytes, CPU seconds used so far) of this process."""
    rss = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t = os.times()
    return rss, t.user + t.system
