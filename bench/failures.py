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


def sigkill_trials(n: int) -> list[float]:
    """Seconds from SIGKILL until every one of 50 pending calls has failed."""
    out = []
    for _ in range(n):
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        s = procs.spawn("s", Sleeper)
        pid = s.pid.call_one().get(timeout=30)
        pending = [s.wait.call_one() for _ in range(50)]
        t = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        out.append(_time_to_fail(pending, t))
        procs.stop().get(timeout=30)
    return out


def sigstop_trials(n: int) -> list[float]:
    """Seconds from SIGSTOP until the hung proc's pending calls failed."""
    out = []
    for _ in range(n):
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        s = procs.spawn("s", Sleeper)
        pid = s.pid.call_one().get(timeout=30)
        pending = [s.wait.call_one() for _ in range(5)]
        t = time.perf_counter()
        os.kill(pid, signal.SIGSTOP)
        out.append(_time_to_fail(pending, t))
        procs.stop().get(timeout=30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--stop-trials", type=int, default=3)
    args = ap.parse_args()
    am.unhandled_fault_hook = lambda failure: None  # expected failures
    kill = sigkill_trials(args.trials)
    stop = sigstop_trials(args.stop_trials)
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
