"""Run one workload in this interpreter and write its result as JSON.

``BENCH_IMPL=actormesh|monarch python -m bench._runner WORKLOAD --out PATH [--quick] [--params JSON]``

The parent (``bench.cli``) starts one runner per workload and implementation,
so every workload gets a fresh controller runtime, a hard wall-clock limit and
its own log. A runner that hangs dumps every thread's stack to its log before
the parent kills it. After the workload returns, the runner checks that no
child process it started is still alive (and kills and reports any).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import platform
import signal
import sys
import time
import traceback
from typing import Any

WORKLOADS = ("baseline", "noop", "pipelined", "broadcast", "payload", "spawn", "actors", "rss")


def _impl_version(impl: str) -> str:
    from importlib import metadata

    try:
        return metadata.version("torchmonarch" if impl == "monarch" else "actormesh")
    except metadata.PackageNotFoundError:
        return "?"


def _leftovers(grace_s: float = 5.0) -> list[str]:
    """Children still alive after the workload (waits ``grace_s``, then kills them)."""
    from bench._util import cmdline, live_descendants

    deadline = time.monotonic() + grace_s
    left = live_descendants()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = live_descendants()
    report = [f"{pid}: {cmdline(pid)}" for pid in left]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench._runner")
    ap.add_argument("workload", choices=WORKLOADS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--params", default="{}", help="JSON object of extra keyword arguments for run()")
    ap.add_argument("--hang-dump-s", type=float, default=0.0, help="dump all stacks to stderr after this many seconds")
    args = ap.parse_args(argv)
    if args.hang_dump_s > 0:
        faulthandler.dump_traceback_later(args.hang_dump_s, exit=False)
    impl = os.environ.get("BENCH_IMPL", "actormesh")
    result: dict[str, Any] = {
        "workload": args.workload,
        "impl": impl,
        "impl_version": _impl_version(impl),
        "python": platform.python_version(),
        "quick": args.quick,
    }
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(f"bench.{args.workload}")
        metrics = module.run(quick=args.quick, **json.loads(args.params))
        result["ok"] = True
        result["info"] = metrics.pop("info", {})
        result["metrics"] = metrics
    except BaseException as exc:  # report, never hide
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    result["wall_s"] = time.perf_counter() - t0
    if impl == "actormesh":  # what lives as long as the runtime (its zygote) ends with it
        from actormesh.actor import shutdown_context

        shutdown_context()
    result["leftover_procs"] = _leftovers()
    faulthandler.cancel_dump_traceback_later()
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, args.out)
    sys.stdout.flush()
    sys.stderr.flush()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
