"""The dashboard under a 64-proc, 1,000-actor job: cost to the controller's call path, failure-to-page time.

Run: python -m bench.dashboard_bench [--procs 64] [--meshes 16] [--rounds 4] [--calls 1000]

Spawns ``--procs`` procs (telemetry on) and ``--meshes`` actor meshes over all
of them (16 x 64 = 1,024 actors). Then, round by round, interleaved:

- ``plain``: noop ``call_one`` p50 from the controller, no dashboard;
- ``dashboard``: the same while the dashboard runs and a page is open (a
  separate process follows ``/api/events`` as the browser page does).

Last, with the page open, one actor fails (``crash`` broadcast to one member)
and one proc is SIGKILLed; the page process stamps the arrival of the first
state that shows each. Targets: dashboard/plain <= 1.05, failure to page <= 1 s.
Writes bench/results/dashboard.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from actormesh import config, telemetry
from actormesh.actor import Actor, endpoint, this_host
from actormesh.dashboard import start_dashboard

ROOT = Path(__file__).resolve().parent.parent

PAGE = r"""
import json, sys, time, httpx
url = sys.argv[1]
with httpx.stream("GET", url + "api/events", timeout=None) as r:
    for line in r.iter_lines():
        if line.startswith("data: "):
            s = json.loads(line[6:])
            print(json.dumps({"t": time.time(), "version": s["version"], "failures": [f["mesh"] for f in s["failures"]],
                              "dead": sum(1 for h in s["hosts"] for p in h["procs"] if p["status"] != "running")}), flush=True)
"""


class Noop(Actor):
    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def crash(self) -> None:
        raise RuntimeError("bench: injected failure")


def p50_us(ep: Any, n: int) -> float:
    for _ in range(100):
        ep.call_one().get(timeout=60)
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        ep.call_one().get(timeout=60)
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e6


class Page:
    """A process following the dashboard's event stream, like an open browser tab."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PAGE, url], stdout=subprocess.PIPE, text=True)
        self.first = json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]

    def until(self, pred: Any, timeout_s: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            event = json.loads(line)
            if pred(event):
                return event
        raise TimeoutError("the page never showed it")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=64)
    ap.add_argument("--meshes", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "dashboard.json"))
    args = ap.parse_args()
    import actormesh.actor as am

    am.unhandled_fault_hook = lambda failure: None  # the injected failures are expected
    telemetry.enable("dashboard-bench")
    t0 = time.monotonic()
    with config.configured(telemetry=True, proc_spawn_timeout=300):
        procs = this_host().spawn_procs(per_host={"gpus": args.procs})
    procs.initialized.get(timeout=600)
    meshes = [procs.spawn(f"m{i}", Noop) for i in range(args.meshes)]
    for m in meshes:
        m.noop.call().get(timeout=300)
    spawn_s = time.monotonic() - t0
    print(f"{args.procs} procs, {args.procs * args.meshes} actors up in {spawn_s:.1f}s", flush=True)
    target = meshes[0].slice(gpus=0).noop
    result: dict[str, Any] = {"procs": args.procs, "actors": args.procs * args.meshes, "spawn_s": spawn_s, "plain": [], "dashboard": []}
    try:
        for r in range(args.rounds):
            result["plain"].append(p50_us(target, args.calls))
            dash = start_dashboard(port=0)
            page = Page(dash.url)
            try:
                page.until(lambda e: e["version"] >= 2)  # the collector has gathered everything at least once more
                result["dashboard"].append(p50_us(target, args.calls))
            finally:
                page.close()
                dash.stop()
            print(f"round {r + 1}: plain {result['plain'][-1]:.0f}µs  dashboard+page {result['dashboard'][-1]:.0f}µs", flush=True)
        dash = start_dashboard(port=0)
        page = Page(dash.url)
        try:
            victim = meshes[1].slice(gpus=3)
            t_fail = time.time()
            victim.crash.broadcast()
            seen = page.until(lambda e: meshes[1]._mesh_name in e["failures"])
            result["actor_failure_to_page_s"] = seen["t"] - t_fail
            pid = meshes[2].slice(gpus=5).pid.call_one().get(timeout=60)
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            seen = page.until(lambda e: e["dead"] >= 1 or meshes[2]._mesh_name in e["failures"])
            result["proc_kill_to_page_s"] = seen["t"] - t_kill
        finally:
            page.close()
            dash.stop()
    finally:
        procs.stop().get(timeout=300)
    plain, dashed = statistics.median(result["plain"]), statistics.median(result["dashboard"])
    result.update(plain_p50_us=plain, dashboard_p50_us=dashed, ratio=dashed / plain, targets={"ratio": 1.05, "failure_to_page_s": 1.0})
    print(f"call_one p50: plain {plain:.0f}µs, dashboard+page {dashed:.0f}µs ({dashed / plain:.3f}x); failure to page: "
          f"actor {result['actor_failure_to_page_s']:.2f}s, killed proc {result['proc_kill_to_page_s']:.2f}s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
