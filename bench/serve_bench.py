"""Services: routing overhead, throughput over 4 replicas, and a SIGKILL under load.

Run: python -m bench.serve_bench [--quick]
Prints a table and writes bench/results/serve.json. Every figure is a ratio
against a baseline measured in the same run:

1. **noop latency**: ``svc.noop.route().get()`` on a one-replica service vs
   ``mesh.noop.call_one().get()`` on a one-proc actor mesh; the two alternate
   call by call so that machine noise hits both alike. Target: p50 within 1.3x.
2. **throughput**: 5,000 requests, at most 64 outstanding, through 4 replicas
   with least-loaded routing vs plain ``call_one`` round-robin over 4 one-proc
   meshes; 4 rounds in ABBA order, medians. Each request sleeps a time drawn from one seeded sequence (mostly
   0, sometimes 2 ms), the same for both, so uneven work is what routing faces.
3. **failure**: 4 replicas under a steady 200 requests/s of 15 ms each (sync actors, one at a time); one replica's proc is
   SIGKILLed after 2 s. Counted: successes, ``ReplicaFailed`` (may have run),
   anything else, and futures still pending 30 s after the load ends (must be 0);
   the time until the replica serves again (target under 10 s); p99 before the
   kill and during recovery. Run twice: a plain endpoint, and one declared
   idempotent (retried instead of failed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from actormesh.actor import Actor, endpoint, this_host
from actormesh.serve import ReplicaFailed, Service

from bench._util import latency_stats

GET_S = 60.0


class Worker(Actor):
    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def work(self, sleep_s: float) -> int:
        if sleep_s:
            time.sleep(sleep_s)
        return os.getpid()

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def noop_latency(rounds: int, per_round: int) -> dict[str, Any]:
    """Alternating blocks of direct call_one and route on one replica."""
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    svc = Service(1, 1, Worker, name="noop")
    try:
        direct = procs.spawn("direct", Worker)
        direct.initialized.get(timeout=GET_S)
        svc.ready().get(timeout=GET_S)
        ep, route = direct.noop, svc.noop
        a: list[float] = []
        b: list[float] = []
        for _ in range(50):  # warm-up
            ep.call_one().get(timeout=GET_S)
            route.route().get(timeout=GET_S)
        clock = time.perf_counter
        for _ in range(rounds * per_round):  # one of each in turn: both see the same machine
            t = clock()
            ep.call_one().get(timeout=GET_S)
            t1 = clock()
            route.route().get(timeout=GET_S)
            a.append(t1 - t)
            b.append(clock() - t1)
        da, db = latency_stats(a), latency_stats(b)
        return {"direct_p50_us": round(da["p50"], 1), "direct_p99_us": round(da["p99"], 1), "route_p50_us": round(db["p50"], 1),
                "route_p99_us": round(db["p99"], 1), "p50_ratio": round(db["p50"] / da["p50"], 3), "p99_ratio": round(db["p99"] / da["p99"], 3)}
    finally:
        svc.stop().get(timeout=GET_S)
        procs.stop().get(timeout=GET_S)


def _drive(issue: Any, sleeps: list[float], window: int) -> dict[str, Any]:
    """Issue one request per entry of ``sleeps`` with at most ``window`` outstanding."""
    sem = threading.Semaphore(window)
    lat: list[float] = []
    errors = [0]
    lock = threading.Lock()
    futures = []
    t0 = time.perf_counter()
    for i, s in enumerate(sleeps):
        sem.acquire()
        start = time.perf_counter()
        fut = issue(i, s)

        def done(f: Any, start: float = start) -> None:
            with lock:
                lat.append(time.perf_counter() - start)
                if f.exception(timeout=0) is not None:
                    errors[0] += 1
            sem.release()

        fut._add_done_callback(done)
        futures.append(fut)
    for f in futures:
        f.exception(timeout=GET_S)
    wall = time.perf_counter() - t0
    st = latency_stats(lat, 1e3)
    return {"req_per_s": round(len(sleeps) / wall, 1), "p50_ms": round(st["p50"], 3), "p99_ms": round(st["p99"], 3), "errors": errors[0]}


def throughput(n: int, window: int, rounds: int) -> dict[str, Any]:
    rng = random.Random(7)
    sleeps = [0.002 if rng.random() < 0.2 else 0.0 for _ in range(n)]
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    svc = Service(1, 4, Worker, name="tput", max_concurrency=64, max_queue=n)
    try:
        mesh = procs.spawn("rr", Worker)
        mesh.initialized.get(timeout=GET_S)
        svc.ready().get(timeout=GET_S)
        members = [mesh.slice(gpus=i).work for i in range(4)]
        runs: dict[str, list[dict[str, Any]]] = {"call_one_rr": [], "route_least_loaded": []}
        for k in range(rounds):  # ABBA order: drift in the machine's load hits both alike
            order = ["call_one_rr", "route_least_loaded"][:: 1 if k % 2 == 0 else -1]
            for which in order:
                issue = (lambda i, s: members[i % 4].call_one(s)) if which == "call_one_rr" else (lambda i, s: svc.work.route(s))
                runs[which].append(_drive(issue, sleeps, window))
        base, served = (_median_run(runs[w]) for w in ("call_one_rr", "route_least_loaded"))
        return {"requests": n, "window": window, "rounds": rounds, "call_one_rr": base, "route_least_loaded": served,
                "throughput_ratio": round(served["req_per_s"] / base["req_per_s"], 3), "p99_ratio": round(served["p99_ms"] / base["p99_ms"], 3)}
    finally:
        svc.stop().get(timeout=GET_S)
        procs.stop().get(timeout=GET_S)


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the median over the rounds."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def failure(rate: float, seconds: float, idempotent: bool) -> dict[str, Any]:
    svc = Service(1, 4, Worker, name="chaos", max_concurrency=32, max_queue=1024, idempotent=["work"] if idempotent else [])
    try:
        svc.ready().get(timeout=GET_S)
        victim = svc.replicas()[0]
        pid = victim.mesh.pid.call_one().get(timeout=GET_S)
        records: list[tuple[float, float, str]] = []  # (issued, latency, outcome)
        lock = threading.Lock()
        futures = []
        t0 = time.perf_counter()
        killed = back = None
        n = int(rate * seconds)
        for i in range(n):
            target = t0 + i / rate
            while (now := time.perf_counter()) < target:
                time.sleep(min(0.001, target - now))
            if killed is None and now - t0 >= 2.0:
                os.kill(pid, signal.SIGKILL)
                killed = time.perf_counter()
            if killed is not None and back is None and any(r.slot == 0 and r.state == "healthy" and r.generation > 0 for r in svc.replicas()):
                back = time.perf_counter()
            issued = time.perf_counter()
            fut = svc.work.route(0.015)  # 15 ms: each replica is busy ~75% of the time, so the kill lands on work in flight

            def done(f: Any, issued: float = issued) -> None:
                exc = f.exception(timeout=0)
                outcome = "ok" if exc is None else "may_have_run" if isinstance(exc, ReplicaFailed) else type(exc).__name__
                with lock:
                    records.append((issued, time.perf_counter() - issued, outcome))

            fut._add_done_callback(done)
            futures.append(fut)
        deadline = time.monotonic() + 30
        while back is None and time.monotonic() < deadline:
            if any(r.slot == 0 and r.state == "healthy" and r.generation > 0 for r in svc.replicas()):
                back = time.perf_counter()
            time.sleep(0.01)
        pending = 0
        for f in futures:
            try:
                f.exception(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                pending += 1
        outcomes: dict[str, int] = {}
        for _, _, o in records:
            outcomes[o] = outcomes.get(o, 0) + 1
        before = [lat for t, lat, _ in records if killed is not None and t < killed]
        during = [lat for t, lat, _ in records if killed is not None and t >= killed and (back is None or t <= back)]
        return {
            "idempotent": idempotent, "requests": n, "outcomes": outcomes, "pending_after_30s": pending,
            "replica_back_s": round(back - killed, 2) if back and killed else None,
            "p99_before_ms": round(latency_stats(before, 1e3)["p99"], 2) if before else None,
            "p99_recovery_ms": round(latency_stats(during, 1e3)["p99"], 2) if during else None,
            "restarts": svc.metrics().restarts,
            "failed_in_flight": sum(r.failed_in_flight for r in svc.metrics().replicas),
            "retried": sum(r.retried for r in svc.metrics().replicas),
        }
    finally:
        svc.stop().get(timeout=GET_S)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    args = ap.parse_args()
    q = args.quick
    result = {
        "noop": noop_latency(rounds=4 if q else 10, per_round=100 if q else 300),
        "throughput": throughput(n=1000 if q else 5000, window=64, rounds=2 if q else 4),
        "failure": failure(rate=200.0, seconds=5.0 if q else 8.0, idempotent=False),
        "failure_idempotent": failure(rate=200.0, seconds=5.0 if q else 8.0, idempotent=True),
    }
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "serve.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    nl, tp, fl = result["noop"], result["throughput"], result["failure"]
    print(f"\nroute vs call_one p50: {nl['p50_ratio']}x (target <= 1.3x); p99: {nl['p99_ratio']}x")
    print(f"4 replicas least-loaded vs call_one round-robin: throughput {tp['throughput_ratio']}x, p99 {tp['p99_ratio']}x")
    for key in ("failure", "failure_idempotent"):
        fl = result[key]
        print(f"{key}: {fl['outcomes']}, pending {fl['pending_after_30s']}, back in {fl['replica_back_s']} s (target < 10 s), "
              f"p99 before {fl['p99_before_ms']} ms, during recovery {fl['p99_recovery_ms']} ms")


if __name__ == "__main__":
    main()
