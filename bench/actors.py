"""100 actors on 2 procs: spawn 100 actor meshes on a 2-proc mesh, call each once.

Per rep: start 2 procs and warm them up with one actor and one call (not
timed); then time 100 ``procs.spawn(...)`` plus one ``noop.call()`` per mesh,
waiting for all 100 gathers (200 actors answer); stop the procs (not timed).
Median of 3 reps. Fresh procs per rep rather than stopping the 100 meshes:
``ActorMesh.stop()`` is not something this figure should depend on.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench._actors import Noop
from bench._api import this_host
from bench._util import GET_TIMEOUT_S, now, stop_procs

N = 100


def run(quick: bool = False) -> dict[str, Any]:
    reps = 1 if quick else 3
    times, stops = [], []
    for r in range(reps):
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        try:
            procs.spawn("warm", Noop).noop.call().get(timeout=GET_TIMEOUT_S)
            t0 = now()
            meshes = [procs.spawn(f"a{i}", Noop) for i in range(N)]
            futures = [m.noop.call() for m in meshes]
            for f in futures:
                f.get(timeout=GET_TIMEOUT_S)
            times.append(now() - t0)
        finally:
            stops.append(stop_procs(procs))
    return {"median_s": statistics.median(times), "info": {"reps_s": times, "proc_stop_s": stops, "meshes": N, "procs": 2}}
