"""Worker RSS: memory of a worker proc hosting one sync noop actor, after 200 calls.

RSS via psutil (``/proc`` when psutil is missing), MB = 1e6 bytes; USS/PSS
and thread count in ``info``. ``torch_loaded`` asks the actor whether
``"torch"`` is in its ``sys.modules`` (it must not be).
"""

from __future__ import annotations

from typing import Any

from bench._actors import Noop
from bench._api import this_host
from bench._util import GET_TIMEOUT_S, cmdline, rss_mb, stop_procs


def run(quick: bool = False) -> dict[str, Any]:
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        actor = procs.spawn("rss", Noop)
        for _ in range(200):
            actor.noop.call_one().get(timeout=GET_TIMEOUT_S)
        pid = actor.pid.call_one().get(timeout=GET_TIMEOUT_S)
        torch_loaded = actor.loaded.call_one("torch").get(timeout=GET_TIMEOUT_S)
        mem = rss_mb(pid)
        return {"rss_mb": mem["rss_mb"], "torch_loaded": bool(torch_loaded), "info": {**mem, "pid": pid, "cmdline": cmdline(pid)}}
    finally:
        stop_procs(procs)
