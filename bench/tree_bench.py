"""Tree casting at scale: broadcast+gather on 16, 64 and 256 procs spread over
several host agents on this machine, and the cast tree for 4,096 virtual procs.

Run: python -m bench.tree_bench [--sizes 16 64 256] [--hosts 4] [--reps 30]
Prints a table and writes bench/results/tree.json. Figures: p50 latency of a
noop ``call()`` over the whole mesh, controller messages sent per cast (counted),
the same with the tree disabled (fan-out above N: a star) for comparison, and
the spawn time of the procs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from actormesh import config
from actormesh.actor import Actor, endpoint
from actormesh.mesh import HostMesh
from actormesh.runtime import current_runtime
from actormesh.runtime._cast import tree_stats


class Noop(Actor):
    @endpoint
    def noop(self) -> None:
        return None


def start_agents(n: int) -> tuple[list[str], list[subprocess.Popen[str]]]:
    rt = current_runtime()
    secret_file = os.path.join(rt.job_dir, "bench-secret")
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, rt.secret.hex().encode())
    os.close(fd)
    agents, procs = [], []
    for i in range(n):
        addr = f"unix:{os.path.join(rt.job_dir, f'agent-{i}.sock')}"
        p = subprocess.Popen(
            [sys.executable, "-m", "actormesh.host", "--address", addr, "--secret-file", secret_file, "--print-address", "--controller", rt.address],
            stdout=subprocess.PIPE,
            text=True,
        )
        agents.append(p.stdout.readline().strip())  # type: ignore[union-attr]
        procs.append(p)
    return agents, procs


def measure(mesh, reps: int) -> tuple[float, float]:
    rt = current_runtime()
    mesh.noop.call().get(timeout=120)
    lat = []
    for _ in range(reps):
        t = time.perf_counter()
        mesh.noop.call().get(timeout=120)
        lat.append(time.perf_counter() - t)
    before = rt.messages_sent()
    mesh.noop.call().get(timeout=120)
    return statistics.median(lat) * 1e3, rt.messages_sent() - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    agents, agent_procs = start_agents(args.hosts)
    hosts = HostMesh(agents=agents)
    rows = []
    try:
        for n in args.sizes:
            per = max(1, n // args.hosts)
            t = time.perf_counter()
            procs = hosts.spawn_procs(per_host={"procs": per})
            mesh = procs.spawn("noop", Noop)
            mesh.initialized.get(timeout=300)
            spawn_s = time.perf_counter() - t
            tree_ms, tree_msgs = measure(mesh, args.reps)
            with config.configured(max_cast_fanout=100_000):
                star_ms, star_msgs = measure(mesh, args.reps)
            rows.append(
                {"procs": per * args.hosts, "spawn_s": round(spawn_s, 2), "tree_p50_ms": round(tree_ms, 2), "tree_controller_msgs": tree_msgs,
                 "star_p50_ms": round(star_ms, 2), "star_controller_msgs": star_msgs, "depth": tree_stats(per * args.hosts, 16)["depth"]}
            )
            print(rows[-1], flush=True)
            procs.stop().get(timeout=120)
    finally:
        for p in agent_procs:
            p.terminate()
        for p in agent_procs:
            p.wait(timeout=30)
    sim = tree_stats(4096, 16)
    print("simulated 4096 procs, fan-out 16:", sim)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "tree.json").write_text(json.dumps({"rows": rows, "simulation_4096": sim}, indent=2))
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="broadcast+gather (noop call) over host agents")
        for col in rows[0]:
            table.add_column(col)
        for r in rows:
            table.add_row(*(str(v) for v in r.values()))
        Console().print(table)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
