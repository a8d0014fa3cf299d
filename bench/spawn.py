"""Spawn to first reply: ``spawn_procs(per_host={"gpus": 4})`` + ``spawn`` of an actor
+ ``call().get()`` answered by all 4. Median of 3 runs; procs stopped between
runs (stop time not counted). The first run also pays the controller
runtime's start-up; all runs are in ``info.runs_s``.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench._actors import Noop
from bench._api import this_host
from bench._util import GET_TIMEOUT_S, now, stop_procs


def run(quick: bool = False) -> dict[str, Any]:
    runs = 2 if quick else 3
    times, stops = [], []
    for i in range(runs):
        t0 = now()
        procs = this_host().spawn_procs(per_host={"gpus": 4})
        try:
            mesh = procs.spawn("first", Noop)
            mesh.noop.call().get(timeout=GET_TIMEOUT_S)
            times.append(now() - t0)
        finally:
            stops.append(stop_procs(procs))
    return {"median_s": statistics.median(times), "info": {"runs_s": times, "stop_s": stops}}
