"""The controller's CPU cost of one cast, on 8 and on 64 local procs.

Run: python -m bench.cast_cost [--sizes 8 64] [--casts 400] [--rounds 5]
Prints a table and writes bench/results/cast_cost.json.

Figures, per cast, in µs of controller CPU (``time.process_time``: every thread
of the controller, so the loop thread that writes frames and takes in replies
counts as well as the caller's thread), less what the controller burns meanwhile
with nothing cast (heartbeats and liveness of every proc: its rate, timed idle,
times the wall time of the casts):

* ``bcast_us``: ``mesh.noop.broadcast()``, ``--casts`` of them then one
  ``call().get()`` to flush (per-sender order: when it returns every broadcast
  has run); the flush's own cost, timed alone, is taken off.
* ``gather_us``: ``mesh.noop.call().get()``, one after the other.
* ``*_caller_us``: the same, the caller's thread only (``time.thread_time``).
* ``gather_wall_us``: wall time per ``call().get()`` (the tree's latency, for reference).

``--slice`` casts to a slice instead: the first ``n`` of ``2n`` procs (so
``--sizes 8 64`` spawns 16 and 128), cast to as one view again and again.

``--heartbeat-interval S`` relaxes the controller's liveness pings (and the
timeouts that follow from them) to ``S`` seconds: the controller pings every
child it has not heard from lately, and under a tree most children answer
their subtree root, not the controller, so with casts in flight the pings and
the liveness checks of busy children cost the controller CPU per proc per
second, on top of the casts. The idle rate above takes off only what it costs
while the procs are idle; this option shows the cast alone.

Each figure is the median of ``--rounds`` rounds. The last row is the ratio of
the largest size to the smallest: with the tree's fan-out at its default (16),
a cast should cost the controller O(fan-out), not O(procs) (issue 13). A call
still decodes one reply per member, so ``gather_us`` keeps a small per-member part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench._actors import Noop
from bench._api import this_host
from bench._util import GET_TIMEOUT_S, stop_procs


def _cpu() -> tuple[float, float]:
    return time.process_time(), time.thread_time()


def _idle_rate(seconds: float) -> float:
    """Controller CPU per second of wall time with nothing cast (heartbeats, liveness)."""
    time.sleep(0.2)
    c0, w0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return (time.process_time() - c0) / (time.perf_counter() - w0)


def _per_call(ep: Any, n: int, idle: float) -> tuple[float, float, float]:
    """Controller CPU (process less its idle rate, caller thread) and wall time per ``call().get()``, in seconds."""
    p0, t0 = _cpu()
    w0 = time.perf_counter()
    for _ in range(n):
        ep.call().get(timeout=GET_TIMEOUT_S)
    p1, t1 = _cpu()
    wall = time.perf_counter() - w0
    return (p1 - p0 - idle * wall) / n, (t1 - t0) / n, wall / n


def _per_broadcast(ep: Any, n: int, idle: float, flush: tuple[float, ...]) -> tuple[float, float]:
    """Controller CPU per ``broadcast()``, the final flushing call's cost taken off."""
    p0, t0 = _cpu()
    w0 = time.perf_counter()
    for _ in range(n):
        ep.broadcast()
    ep.call().get(timeout=GET_TIMEOUT_S * 4)
    p1, t1 = _cpu()
    return (p1 - p0 - idle * (time.perf_counter() - w0) - flush[0]) / n, (t1 - t0 - flush[1]) / n


def measure(n_procs: int, casts: int, rounds: int, as_slice: bool = False) -> dict[str, Any]:
    """Spawn ``n_procs`` local procs with a noop actor each and time casts to them
    (``as_slice``: ``2 * n_procs`` procs, casts to the first ``n_procs``)."""
    procs = this_host().spawn_procs(per_host={"procs": 2 * n_procs if as_slice else n_procs})
    try:
        mesh = procs.spawn("cast_cost", Noop)
        ep = (mesh.slice(procs=slice(0, n_procs)) if as_slice else mesh).noop
        ep.call().get(timeout=GET_TIMEOUT_S * 4)
        _per_call(ep, 50, 0.0)  # warm-up: connections, caches
        _per_broadcast(ep, 50, 0.0, (0.0, 0.0, 0.0))
        idle = _idle_rate(2.0)
        gathers, bcasts = [], []
        for _ in range(rounds):
            gathers.append(_per_call(ep, casts // 4, idle))
            bcasts.append(_per_broadcast(ep, casts, idle, gathers[-1]))
        med = lambda xs, k: statistics.median(x[k] for x in xs) * 1e6  # noqa: E731
        return {
            "procs": n_procs,
            "bcast_us": round(med(bcasts, 0), 1),
            "bcast_caller_us": round(med(bcasts, 1), 1),
            "gather_us": round(med(gathers, 0), 1),
            "gather_caller_us": round(med(gathers, 1), 1),
            "gather_wall_us": round(med(gathers, 2), 1),
            "idle_cpu_pct": round(idle * 100, 2),
        }
    finally:
        stop_procs(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--casts", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cast_cost.json")
    ap.add_argument("--slice", action="store_true", help="cast to the first n of 2n procs")
    ap.add_argument("--heartbeat-interval", type=float, default=None, help="seconds; default: as configured")
    args = ap.parse_args()
    if args.heartbeat_interval is not None:
        from actormesh import config

        hb = args.heartbeat_interval
        config.configure(heartbeat_interval=hb, heartbeat_timeout=max(hb * 2, 3.0), link_timeout=max(hb * 4, 10.0))
    rows = []
    for n in args.sizes:
        rows.append(measure(n, args.casts, args.rounds, args.slice))
        print(rows[-1], flush=True)
    lo, hi = rows[0], rows[-1]
    ratio: dict[str, Any] = {k: round(hi[k] / lo[k], 2) if lo[k] > 0 else None for k in lo if k != "procs"}
    ratio["procs"] = f"{hi['procs']}/{lo['procs']}"
    print("ratio", ratio, flush=True)
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "ratio": ratio, "slice": args.slice, "heartbeat_interval": args.heartbeat_interval}, indent=2))
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="controller CPU per cast (µs)")
        for col in rows[0]:
            table.add_column(col)
        for r in [*rows, ratio]:
            table.add_row(*(str(r[c]) for c in rows[0]))
        Console().print(table)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
