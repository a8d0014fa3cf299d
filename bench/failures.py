"""Failure-detection figures: SIGKILL to all pending futures failed, SIGSTOP to detection.

Run: python -m bench.failures [--trials 20] [--stop-trials 3]
Prints a table and writes bench/results/failures.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path

from actormesh.actor import Actor, SupervisionError, endpoint, this_host
import actormesh.actor as am


class Sleeper(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def wait(self) -> None:
        threading.Event().wait(60)


def _time_to_fail(futures: list, start: float) -> float:
    last = start
    for fut in futures:
        try:
            fut.get(timeout=30)
        except SupervisionError:
            pass
        last = max(last, time.perf_counter())
    return last - start


def signal_trials(sig: int, n: int, pending: int) -> list[float]:
    """Seconds from sending ``sig`` to a worker until all its ``pending`` calls failed."""
    out = []
    for _ in range(n):
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        s = procs.spawn("s", Sleeper)
        pid = s.pid.call_one().get(timeout=30)
        futures = [s.wait.call_one() for _ in range(pending)]
        t = time.perf_counter()
        os.kill(pid, sig)
        out.append(_time_to_fail(futures, t))
        procs.stop().get(timeout=30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--stop-trials", type=int, default=3)
    args = ap.parse_args()
    am.unhandled_fault_hook = lambda failure: None  # expected failures
    kill = signal_trials(signal.SIGKILL, args.trials, pending=50)
    stop = signal_trials(signal.SIGSTOP, args.stop_trials, pending=5)  # hung, not dead: heartbeats tell
    rows = {
        "sigkill_to_all_failed_p50_ms": statistics.median(kill) * 1e3,
        "sigkill_to_all_failed_max_ms": max(kill) * 1e3,
        "sigstop_to_detected_p50_s": statistics.median(stop),
        "sigstop_to_detected_max_s": max(stop),
        "trials": {"sigkill": args.trials, "sigstop": args.stop_trials},
    }
    for k, v in rows.items():
        print(f"{k:32} {v if isinstance(v, dict) else round(v, 3)}")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "failures.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
