"""Workspace sync: ``python -m bench.sync_bench [--mib 200] [--files 800] [--hosts 2] [--reps 3] [--out PATH]``.

A tree of ``--mib`` MiB in ``--files`` files (random bytes, in subdirectories)
is made in a temp dir and synced to the hosts of a ``ProcessJob`` (real host
agents on their own loopback addresses, each with its own workspace root).

Rows, all in one run:

- ``first``: the first sync (every file hashed, sent to every host, written);
- ``one_changed``: one file edited, then synced again (median of ``--reps``):
  the target is under 1 s;
- ``unchanged``: a sync with nothing changed (the floor: scan + one round trip);
- ``cp -r``: ``shutil.copytree`` of the tree once, the local-copy baseline.

Ratios are against ``first`` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from actormesh.job import ProcessJob

MiB = 1 << 20
OUT = Path(__file__).resolve().parent / "results" / "sync.json"
TIMEOUT_S = 600.0


def make_tree(root: Path, mib: int, files: int) -> list[Path]:
    """``files`` files of ``mib`` MiB in total, 20 per directory."""
    size = max(1, mib * MiB // files)
    paths = []
    for i in range(files):
        p = root / f"d{i // 20:03d}" / f"f{i:05d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(size))
        paths.append(p)
    (root / "main.py").write_text("print('v0')\n")
    return paths


def timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=200)
    ap.add_argument("--files", type=int, default=800)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="am-sync-bench-") as tmp:
        src = Path(tmp) / "proj"
        make_tree(src, args.mib, args.files)
        copy_s, _ = timed(lambda: shutil.copytree(src, Path(tmp) / "copy"))
        shutil.rmtree(Path(tmp) / "copy")
        job = ProcessJob({"hosts": args.hosts})
        try:
            hosts = job.state().hosts
            first_s, first = timed(lambda: hosts.sync_workspace(src).get(timeout=TIMEOUT_S))
            changed = []
            for v in range(args.reps):
                (src / "main.py").write_text(f"print('v{v + 1}')\n")
                s, rep = timed(lambda: hosts.sync_workspace(src).get(timeout=TIMEOUT_S))
                assert rep.files_sent == args.hosts, rep
                changed.append(s)
            unchanged_s, _ = timed(lambda: hosts.sync_workspace(src).get(timeout=TIMEOUT_S))
        finally:
            job.kill()
    one = statistics.median(changed)
    rows = [
        ("first", first_s, first.files_sent, first.bytes_sent),
        ("one_changed", one, args.hosts, 0),
        ("unchanged", unchanged_s, 0, 0),
        ("cp -r", copy_s, args.files + 1, args.mib * MiB),
    ]
    print(f"sync of {args.mib} MiB in {args.files + 1} files to {args.hosts} hosts ({platform.node()}, {os.cpu_count()} cpus)")
    print(f"{'row':<12} {'seconds':>9} {'vs first':>9} {'files sent':>11}")
    for name, s, files, _ in rows:
        print(f"{name:<12} {s:>9.3f} {s / first_s:>9.3f} {files:>11}")
    print(f"one changed file: {one:.3f} s (target < 1 s): {'met' if one < 1.0 else 'NOT met'}")
    result = {"mib": args.mib, "files": args.files + 1, "hosts": args.hosts, "first_s": first_s, "one_changed_s": one,
              "one_changed_all_s": changed, "unchanged_s": unchanged_s, "copytree_s": copy_s, "ratio_one_changed_vs_first": one / first_s,
              "first_bytes_sent": first.bytes_sent, "python": sys.version.split()[0]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
