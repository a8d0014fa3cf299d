"""Pipelined throughput: 5,000 ``call_one`` futures issued, then all ``.get()``.

Sync noop actor in one worker proc; 500-call warm-up, then the median of 3 reps
of 5,000 (calls/s = 5,000 / time from first issue to last reply read).
"""

from __future__ import annotations

import statistics
from typing import Any

from bench._actors import Noop
from bench._api import this_host
from bench._util import GET_TIMEOUT_S, now, stop_procs


def _burst(ep: Any, n: int) -> float:
    t0 = now()
    futures = [ep.call_one() for _ in range(n)]
    for f in futures:
        f.get(timeout=GET_TIMEOUT_S)
    return now() - t0


def run(quick: bool = False) -> dict[str, Any]:
    n, reps = (5000, 1) if quick else (5000, 3)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        ep = procs.spawn("pipe", Noop).noop
        ep.call_one().get(timeout=GET_TIMEOUT_S)
        _burst(ep, 500)
        rates = [n / _burst(ep, n) for _ in range(reps)]
        return {"calls_s": statistics.median(rates), "info": {"reps": rates, "n": n}}
    finally:
        stop_procs(procs)
