"""Noop ``call_one`` round trip to an actor in a worker proc, sync and async actor.

One worker proc hosts a sync actor (``def noop``) and an async actor
(``async def noop``); for each, 200 warm-up calls, then 2,000 timed
``call_one().get()`` from the controller's main thread. p50/p99 in µs.
"""

from __future__ import annotations

from typing import Any

from bench._actors import AsyncNoop, Noop
from bench._api import this_host
from bench._util import GET_TIMEOUT_S, latency_stats, stop_procs, time_calls


def run(quick: bool = False) -> dict[str, Any]:
    warmup, n = (100, 500) if quick else (200, 2000)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    out: dict[str, Any] = {"info": {}}
    try:
        for kind, cls in (("sync", Noop), ("async", AsyncNoop)):
            mesh = procs.spawn(f"noop_{kind}", cls)
            ep = mesh.noop
            time_calls(lambda: ep.call_one().get(timeout=GET_TIMEOUT_S), warmup)
            lat = latency_stats(time_calls(lambda: ep.call_one().get(timeout=GET_TIMEOUT_S), n))
            out[f"{kind}_p50_us"] = lat["p50"]
            out[f"{kind}_p99_us"] = lat["p99"]
            out["info"][kind] = lat
    finally:
        out["info"]["stop_s"] = stop_procs(procs)
    return out
