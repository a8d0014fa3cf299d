"""Broadcast to an 8-proc mesh: gather latency and fire-and-forget rate.

* ``gather_p50_ms`` / ``gather_p99_ms``: ``mesh.noop.call().get()`` on a mesh of
  8 procs (one sync noop actor each): 50 warm-up, then 500 timed.
* ``bcast_s``: N ``mesh.noop.broadcast()`` then one ``call().get()`` to flush
  (per-sender order is guaranteed, so when it returns every broadcast has
  run); broadcasts/s = N / total time. N = 5,000, median of 3 reps.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench._actors import Noop
from bench._api import this_host
from bench._util import GET_TIMEOUT_S, latency_stats, now, stop_procs, time_calls

PROCS = 8


def _fire(ep: Any, n: int) -> float:
    t0 = now()
    for _ in range(n):
        ep.broadcast()
    ep.call().get(timeout=GET_TIMEOUT_S * 2)
    return now() - t0


def run(quick: bool = False) -> dict[str, Any]:
    warmup, n, nb, reps = (20, 100, 1000, 1) if quick else (50, 500, 5000, 3)
    procs = this_host().spawn_procs(per_host={"gpus": PROCS})
    try:
        ep = procs.spawn("bcast", Noop).noop
        ep.call().get(timeout=GET_TIMEOUT_S)
        time_calls(lambda: ep.call().get(timeout=GET_TIMEOUT_S), warmup)
        lat = latency_stats(time_calls(lambda: ep.call().get(timeout=GET_TIMEOUT_S), n), scale=1e3)
        _fire(ep, 200)
        rates = [nb / _fire(ep, nb) for _ in range(reps)]
        return {
            "gather_p50_ms": lat["p50"],
            "gather_p99_ms": lat["p99"],
            "bcast_s": statistics.median(rates),
            "info": {"gather_ms": lat, "bcast_reps": rates, "broadcasts": nb, "procs": PROCS},
        }
    finally:
        stop_procs(procs)
