"""Cost of telemetry on the noop ``call_one`` round trip: off and on vs the code before telemetry.

Run: python -m bench.telemetry_bench [--rounds 3] [--calls 2000] [--base REV]

Three variants, each in a fresh controller process that spawns one worker with
a sync noop actor, warms up, then times ``call_one().get()``:

- ``base``: the source tree before telemetry existed (``git archive`` of
  ``--base``; default: the parent of the commit that added
  src/actormesh/telemetry), so "today's" figure comes from the same run;
- ``off``: this tree, telemetry off (the default);
- ``on``: this tree with ``configure(telemetry=True)``: figures in every proc,
  tracing armed (OpenTelemetry SDK installed); calls made outside any span
  carry no trace context;
- ``traced`` (information, no target): ``on`` with every call made inside
  ``span("step")``: a call span on the controller, a trace context on the
  wire and an endpoint span on the worker.

Variants are interleaved round by round (the machine is shared and noisy).
Reported: the ratio of the medians of the rounds' p50, the ratio of their
minimums (other load only ever adds time), and the median of the per-round
ratios (each variant against the base run just before it, which cancels slow
drifts of the machine's load). Targets: off/base <= 1.03, on/base <= 1.15.
Also reported: the CPU time per call of the controller and the worker
together (psutil; far less sensitive to other load than wall time), and what
the off path adds per call, timed in-process with timeit
on the very statements telemetry added (nanoseconds; noise-free, a lower
bound). Writes bench/results/telemetry.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
mode, warmup, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from actormesh import config
if mode in ("on", "traced"):
    config.configure(telemetry=True)
from actormesh.actor import Actor, endpoint, this_host
import contextlib
if mode == "traced":
    from actormesh.actor import span
    step = lambda: span("step")
else:
    step = contextlib.nullcontext

class Noop(Actor):
    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def pid(self) -> int:
        import os
        return os.getpid()

import psutil
procs = this_host().spawn_procs(per_host={"gpus": 1})
try:
    mesh = procs.spawn("noop", Noop)
    ep = mesh.noop
    worker = psutil.Process(mesh.pid.call_one().get(timeout=60))
    for _ in range(warmup):
        ep.call_one().get(timeout=60)
    xs = []
    me = psutil.Process()
    cpu0 = sum(me.cpu_times()[:2]) + sum(worker.cpu_times()[:2])
    for _ in range(n):
        t0 = time.perf_counter()
        with step():
            ep.call_one().get(timeout=60)
        xs.append(time.perf_counter() - t0)
    cpu = sum(me.cpu_times()[:2]) + sum(worker.cpu_times()[:2]) - cpu0
finally:
    procs.stop().get(timeout=30)
xs.sort()
print(json.dumps({"p50_us": xs[len(xs) // 2] * 1e6, "p99_us": xs[int(len(xs) * 0.99)] * 1e6, "cpu_us": cpu / n * 1e6}))
"""


def base_rev() -> str:
    added = subprocess.run(
        ["git", "log", "--diff-filter=A", "--format=%H", "--", "src/actormesh/telemetry/__init__.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()
    if not added:
        raise SystemExit("no commit adds src/actormesh/telemetry yet; commit first or give --base REV")
    return f"{added[-1]}^"


def extract(rev: str, into: str) -> str:
    """The ``src`` tree of ``rev`` under ``into``; returns its path."""
    archive = os.path.join(into, "src.tar")
    with open(archive, "wb") as f:
        subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return os.path.join(into, "src")


def measure(mode: str, src: str, warmup: int, calls: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACTORMESH_", "OTEL_"))}
    env["PYTHONPATH"] = src
    out = subprocess.run(
        [sys.executable, "-c", CHILD, "off" if mode == "base" else mode, str(warmup), str(calls)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir(),
    )
    if out.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def added_off_path_ns() -> float:
    """Nanoseconds the telemetry-off path adds per call: the checks in Endpoint._prepare,
    Route.send and the cell (figures, trace context), timed against the old unpacking."""
    import timeit

    setup = (
        "class S: on = False; tracing = False\n"
        "class C: figures = None\n"
        "st, cell, msg = S(), C(), ((), {})\n"
        "import time; now = time.perf_counter"
    )
    added = (
        "st.tracing\n"  # Endpoint._prepare
        "st.on\n"  # Route.send
        "fig, scope = cell.figures, None\n"
        "t0 = now() if fig is not None else 0.0\n"
        "args, kwargs = msg[0], msg[1]\n"
        "len(msg) > 2\n"
        "fig is not None or scope is not None"
    )
    n = 2_000_000
    new = min(timeit.repeat(added, setup, number=n, repeat=5)) / n
    old = min(timeit.repeat("args, kwargs = msg", setup, number=n, repeat=5)) / n
    return (new - old) * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--base", default=None, help="git revision of 'today' (default: before telemetry)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "telemetry.json"))
    args = ap.parse_args()
    rev = args.base or base_rev()
    p50: dict[str, list[float]] = {"base": [], "off": [], "on": [], "traced": []}
    cpu: dict[str, list[float]] = {m: [] for m in p50}
    with tempfile.TemporaryDirectory(prefix="telemetry-bench-") as tmp:
        here = str(ROOT / "src")
        srcs = {"base": extract(rev, tmp), "off": here, "on": here, "traced": here}
        for r in range(args.rounds):
            for mode in p50:
                got = measure(mode, srcs[mode], args.warmup, args.calls)
                p50[mode].append(got["p50_us"])
                cpu[mode].append(got["cpu_us"])
            print(f"round {r + 1}: " + "  ".join(f"{m} {p50[m][-1]:.0f}µs (cpu {cpu[m][-1]:.0f}µs)" for m in p50), flush=True)
    med = {m: statistics.median(v) for m, v in p50.items()}
    low = {m: min(v) for m, v in p50.items()}
    result: dict[str, object] = {"base_rev": rev, "rounds": p50, "median_p50_us": med, "min_p50_us": low,
                                 "targets": {"off_vs_base": 1.03, "on_vs_base": 1.15}}
    for stat, fig in (("min", low), ("median", med)):
        ratios = {f"{m}_vs_base": fig[m] / fig["base"] for m in ("off", "on", "traced")}
        result[stat] = ratios
        print(f"noop call_one p50 ({stat} of {args.rounds} rounds): base {fig['base']:.0f}µs  "
              + "  ".join(f"{m} {fig[m]:.0f}µs ({ratios[m + '_vs_base']:.3f}x)" for m in ("off", "on", "traced")))
    paired = {f"{m}_vs_base": statistics.median(x / b for x, b in zip(p50[m], p50["base"])) for m in ("off", "on", "traced")}
    result["paired_median"] = paired
    print("median of per-round ratios: " + "  ".join(f"{k} {v:.3f}x" for k, v in paired.items()))
    cpu_med = {m: statistics.median(v) for m, v in cpu.items()}
    result["cpu_us_per_call"] = {"rounds": cpu, "median": cpu_med,
                                 "ratios": {f"{m}_vs_base": cpu_med[m] / cpu_med["base"] for m in ("off", "on", "traced")}}
    print("CPU per call (controller + worker, median): " + "  ".join(f"{m} {cpu_med[m]:.0f}µs" for m in cpu_med)
          + "  ratios: " + "  ".join(f"{k} {v:.3f}x" for k, v in result["cpu_us_per_call"]["ratios"].items()))
    result["off_path_added_ns"] = added_off_path_ns()
    print(f"the off path adds {result['off_path_added_ns']:.0f} ns per call (timeit of the added statements)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
