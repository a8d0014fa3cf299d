"""Small helpers shared by the workloads: percentiles, timing, process facts."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

#: Timeout (s) for any single ``.get()`` in a workload; nothing waits forever.
GET_TIMEOUT_S = 60.0
#: Timeout (s) for ``procs.stop().get()``.
STOP_TIMEOUT_S = 30.0

now = time.perf_counter


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of an already sorted list."""
    if not sorted_values:
        raise ValueError("no samples")
    k = max(0, min(len(sorted_values) - 1, int(round(q / 100.0 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


def latency_stats(samples_s: Iterable[float], scale: float = 1e6) -> dict[str, float]:
    """p50/p99/mean/min/max of samples in seconds, scaled (default: to µs)."""
    xs = sorted(s * scale for s in samples_s)
    return {
        "p50": percentile(xs, 50),
        "p99": percentile(xs, 99),
        "mean": statistics.fmean(xs),
        "min": xs[0],
        "max": xs[-1],
        "n": len(xs),
    }


def time_calls(fn: Callable[[], Any], n: int) -> list[float]:
    """Run ``fn`` ``n`` times, return each duration in seconds."""
    out = []
    for _ in range(n):
        t0 = now()
        fn()
        out.append(now() - t0)
    return out


def rss_mb(pid: int) -> dict[str, float]:
    """RSS (and USS/PSS where psutil can read them) of ``pid`` in MB (1e6 bytes)."""
    try:
        import psutil

        p = psutil.Process(pid)
        out = {"rss_mb": p.memory_info().rss / 1e6, "threads": float(p.num_threads())}
        try:
            full = p.memory_full_info()
            out["uss_mb"] = full.uss / 1e6
            out["pss_mb"] = getattr(full, "pss", 0) / 1e6
        except Exception:
            pass
        return out
    except ImportError:  # e.g. the Monarch venv without psutil: same number from /proc
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return {"rss_mb": int(fields["VmRSS"].split()[0]) * 1024 / 1e6, "threads": float(fields["Threads"].strip())}


def _ppid_map() -> dict[int, int]:
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            # fields after the ")" of comm: state ppid ...
            rest = stat[stat.rindex(")") + 2 :].split()
            if rest[0] == "Z":
                continue  # zombies are dead
            out[int(name)] = int(rest[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def live_descendants(pid: int | None = None) -> list[int]:
    """Pids of live (non-zombie) descendants of ``pid`` (default: this process)."""
    root = os.getpid() if pid is None else pid
    ppids = _ppid_map()
    kids: dict[int, list[int]] = {}
    for child, parent in ppids.items():
        kids.setdefault(parent, []).append(child)
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def stop_procs(procs: Any) -> float:
    """Stop a proc mesh with a timeout; return seconds taken."""
    t0 = now()
    procs.stop().get(timeout=STOP_TIMEOUT_S)
    return now() - t0
