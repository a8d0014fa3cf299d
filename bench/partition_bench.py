"""Automatic partitioner vs torch's defaults: ``python -m bench.partition_bench [--quick] [--out PATH]``.

Four figures, each against the default in the same run (torch's pipelining
and torchtitan split blocks by count, earlier stages one longer):

1. the issue's uneven 13-block model (per-block fwd+bwd ms below): slowest
   stage of the equal-layer split and of ``partition`` over the optimum, at
   2 and 4 stages (goal for ``partition``: <= 1.05x);
2. measured: MLP blocks with hidden widths proportional to those costs,
   profiled with ``profile_layers``, run with ``torch.distributed.pipelining``
   (gloo, 2 procs, 1F1B, 4 microbatches, SGD), equal-layer vs ``partition``
   boundaries: step time ratio;
3. FSDP2 (``fully_shard`` per block) vs DDP at world size 4 with Adam:
   parameter + gradient + optimizer bytes allocated per rank (goal <= 0.55x);
4. ``auto_plan`` on 2 ranks with the link measured (no heads, so no tp):
   predicted vs measured step time of each candidate, run with torch's DDP,
   FSDP2 and pipelining (SGD: optimizer time is not modelled).

Workers run torch with one thread (one core per rank on this 2-core box). A
step time is the fastest of 24 steps (8 with --quick), the plans taking
turns step by step, after 2 warm-up steps each. Other work on the box
distorts measured figures (a
pipeline gains nothing when its ranks share a core), so runs also report
``concurrency`` (2 x a matmul loop's time alone / its time with both ranks
running it; 2.0 when idle) and the load average. Writes
bench/results/partition.json and prints a table; about 1-2 minutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: Per-block forward+backward ms of the issue's uneven 13-block model.
UNEVEN_13 = [11.0, 14.0, 15.0, 1.0, 4.0, 10.0, 7.0, 1.0, 1.0, 1.0, 5.0, 5.0, 4.0]
D, UNIT, ROWS = 256, 64, 1024  # model width, hidden width per cost unit, global batch rows
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "partition.json"


def make_model(widths: list[int], seed: int = 0) -> Any:
    """Residual MLP blocks ``x + down(gelu(up(x)))`` of the given hidden widths, in ``model.blocks``."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, w: int) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(D, w), nn.Linear(w, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    class Uneven(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(w) for w in widths)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(seed)
    return Uneven()


def widths_13() -> list[int]:
    return [int(c) * UNIT for c in UNEVEN_13]


def sample(rows: int = ROWS) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)


# --------------------------------------------------------------------------- workers


def _pipeline_step(model: Any, plan: dict[str, Any], rank: int, world: int, x: Any, y: Any) -> Any:
    """One 1F1B step of this rank's stage (``torch.distributed.pipelining``), then SGD."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stages = [range(a, b) for a, b in plan["stages"]]
    mod = torch.nn.Sequential(*[model.blocks[i] for i in stages[rank]])
    sched = Schedule1F1B(PipelineStage(mod, rank, world, torch.device("cpu")), n_microbatches=plan["microbatches"], loss_fn=F.mse_loss)
    opt = torch.optim.SGD(mod.parameters(), lr=1e-3)

    def step() -> None:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        opt.step()
        opt.zero_grad()

    return step


def _data_parallel_step(model: Any, plan: dict[str, Any], rank: int, world: int, x: Any, y: Any) -> Any:
    """One step on this rank's share of the batch, with FSDP2 (``fully_shard`` per block) or DDP, then SGD."""
    import torch
    import torch.nn.functional as F

    if plan["fsdp"] > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    local = slice(rank * ROWS // world, (rank + 1) * ROWS // world)

    def step() -> None:
        F.mse_loss(model(x[local]), y[local]).backward()
        opt.step()
        opt.zero_grad()

    return step


def _runners(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """name -> callable running one training step of that plan on this rank."""
    import torch.distributed as dist

    x, y = sample()
    runners = {plan["name"]: (_pipeline_step if plan["pp"] > 1 else _data_parallel_step)(make_model(cfg["widths"]), plan, rank, world, x, y)
               for plan in cfg["plans"]}
    dist.barrier()
    return runners


def concurrency(rank: int, world: int) -> float:
    """How many of the ranks really run at once: ``world * t(one rank alone) / t(all together)``."""
    import torch
    import torch.distributed as dist

    a = torch.randn(192, 192)

    def burn() -> float:
        t0 = time.perf_counter()
        for _ in range(300):
            a @ a
        return time.perf_counter() - t0

    alone = torch.zeros(1)
    for r in range(world):
        dist.barrier()
        if rank == r:
            alone += burn()
    dist.barrier()
    together = torch.tensor([burn()])
    dist.all_reduce(alone, op=dist.ReduceOp.SUM)
    dist.all_reduce(together, op=dist.ReduceOp.MAX)
    return float(alone.item() / together.item())


def worker_steps(cfg: dict[str, Any], rank: int, world: int) -> dict[str, float]:
    """Step seconds of each plan: the fastest of ``reps`` steps, the plans taking turns step by step."""
    import torch.distributed as dist

    busy = concurrency(rank, world)
    runners = _runners(cfg, rank, world)
    times: dict[str, list[float]] = {n: [] for n in runners}
    for name, step in runners.items():  # warm-up: shape inference, allocator, DDP buckets
        for _ in range(2):
            step()
    for _ in range(cfg["reps"]):
        for name, step in runners.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    return {**{n: min(t) for n, t in times.items()}, "concurrency": min(busy, concurrency(rank, world))}


def worker_memory(cfg: dict[str, Any], rank: int, world: int) -> dict[str, float]:
    """Largest per-rank parameter + gradient + Adam-state bytes, DDP vs FSDP2, after one step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    def nbytes(ts: Any) -> int:
        return sum(local(t).numel() * local(t).element_size() for t in ts if torch.is_tensor(t))

    x, y = sample()
    out: dict[str, float] = {}
    for mode in ("ddp", "fsdp"):
        model = make_model(cfg["widths"])
        if mode == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for b in model.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(model, mesh=mesh)
            params = list(model.parameters())
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
            params = list(model.parameters())
        opt = torch.optim.Adam(params, lr=1e-3)
        F.mse_loss(model(x[: ROWS // world]), y[: ROWS // world]).backward()
        opt.step()
        parts = {"params": nbytes(params), "grads": nbytes(p.grad for p in params),
                 "optimizer": nbytes(v for s in opt.state.values() for v in s.values())}
        for k, v in parts.items():
            t = torch.tensor([float(v)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out[f"{mode}_{k}"] = t.item()
        out[f"{mode}_total"] = sum(out[f"{mode}_{k}"] for k in parts)
        del model, opt
    return out


def worker_main(kind: str, rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = worker_steps(cfg, rank, world) if kind == "steps" else worker_memory(cfg, rank, world)
        if rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
        gc.collect()  # DDP/FSDP/pipeline objects release their collectives before the group goes
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_workers(kind: str, world: int, cfg: dict[str, Any], timeout_s: float = 240.0) -> dict[str, float]:
    """Run ``world`` worker processes (plain subprocesses); rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-m", "bench.partition_bench", "--worker",
                               json.dumps({"kind": kind, "rank": r, "world": world, "port": port, "cfg": cfg})],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lines = [ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT ")]
    for p, (_, err) in zip(procs, outs):
        # gloo sometimes aborts in teardown ("terminate called without an active exception") after
        # all results are in: keep them, say so; any other failure is fatal
        if p.returncode and not (lines and p.returncode < 0):
            raise RuntimeError(f"{kind} worker failed (rc {p.returncode}):\n{err[-3000:]}")
        if p.returncode:
            print(f"note: a {kind} worker died in teardown (rc {p.returncode}) after reporting", file=sys.stderr)
    return json.loads(lines[0][len("RESULT "):])


def fig_costs() -> dict[str, Any]:
    from actormesh.parallel._partition import even_split, partition, stage_times

    out: dict[str, Any] = {"costs_ms": UNEVEN_13}
    for k in (2, 4):
        opt = partition(UNEVEN_13, k)
        best, equal = max(stage_times(UNEVEN_13, opt)), max(stage_times(UNEVEN_13, even_split(13, k)))
        out[f"stages_{k}"] = {"partition": [[r.start, r.stop] for r in opt], "slowest_partition_ms": best,
                              "slowest_equal_ms": equal, "equal_over_optimum": round(equal / best, 3),
                              "partition_over_optimum": 1.0}
    costs = [((i * 7919) % 97 + 1) / 97 for i in range(1000)]
    t0 = time.perf_counter()
    partition(costs, 64)
    out["partition_1000x64_s"] = round(time.perf_counter() - t0, 4)
    return out


def fig_pipeline(quick: bool) -> dict[str, Any]:
    from actormesh.parallel._partition import even_split, partition, stage_times
    from actormesh.parallel._profile import profile_layers

    widths = widths_13()
    costs = profile_layers(make_model(widths), sample(ROWS // 4)[0], repeats=5)  # microbatch-sized profile
    auto, equal = partition(costs, 2), even_split(13, 2)

    def step(stages: list[range]) -> float:  # auto_plan's pipeline model: fill/drain, then the slowest stage repeats
        t = stage_times(costs, stages)
        return sum(t) + 3 * max(t)

    pred = step(equal) / step(auto)
    plans = [{"name": n, "pp": 2, "stages": [[r.start, r.stop] for r in s], "microbatches": 4}
             for n, s in (("equal", equal), ("auto", auto))]
    measured = run_workers("steps", 2, {"widths": widths, "plans": plans, "reps": 8 if quick else 24})
    return {"profiled_block_ms": [round(c.forward_backward_s * 1e3, 3) for c in costs],
            "equal_stages": plans[0]["stages"], "auto_stages": plans[1]["stages"],
            "predicted_equal_over_auto": round(pred, 3), "equal_step_s": measured["equal"],
            "auto_step_s": measured["auto"], "measured_equal_over_auto": round(measured["equal"] / measured["auto"], 3),
            "concurrency": round(measured["concurrency"], 2)}


def fig_memory() -> dict[str, Any]:
    mem = run_workers("memory", 4, {"widths": widths_13()})
    return {**mem, "fsdp_over_ddp": round(mem["fsdp_total"] / mem["ddp_total"], 3)}


def fig_auto(quick: bool) -> tuple[dict[str, Any], str]:
    from actormesh.parallel._auto import auto_plan

    widths = widths_13()
    choice = auto_plan(lambda: make_model(widths), sample(), 2, link_gbps="measure", optimizer_states=0.0, repeats=5)
    runnable = [c for c in choice.candidates if c.valid and c.tp == 1]
    plans = [{"name": c.name, "pp": c.pp, "fsdp": c.fsdp, "microbatches": c.microbatches,
              "stages": [[r.start, r.stop] for r in c.stages]} for c in runnable]
    measured = run_workers("steps", 2, {"widths": widths, "plans": plans, "reps": 8 if quick else 24})
    rows: list[dict[str, Any]] = [{"plan": c.name, "chosen": c is choice.chosen, "predicted_s": round(c.step_s, 5),
             "measured_s": round(measured[c.name], 5), "measured_over_predicted": round(measured[c.name] / c.step_s, 3)}
            for c in runnable]
    fastest = min(rows, key=lambda r: r["measured_s"])["plan"]
    return {"candidates": rows, "chosen": choice.chosen.name, "fastest_measured": fastest,
            "link": {k: getattr(choice.link, k) for k in ("gbps", "latency_s", "sharded_factor", "fsdp_call_s")},
            "concurrency": round(measured["concurrency"], 2)}, choice.explain()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # JSON: kind, rank, world, port, cfg
    args = ap.parse_args()
    if args.worker:
        worker_main(**json.loads(args.worker))
        return
    import torch

    torch.set_num_threads(1)  # profile as the workers run: one thread each
    t0 = time.perf_counter()
    results: dict[str, Any] = {"loadavg_before": list(os.getloadavg()), "costs": fig_costs(),
                               "pipeline": fig_pipeline(args.quick), "memory": fig_memory()}
    results["auto_plan"], explanation = fig_auto(args.quick)
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    results["loadavg_after"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(explanation, end="\n\n")
    report(results)
    print(f"\nwrote {args.out} ({results['wall_s']} s)")


def report(r: dict[str, Any]) -> None:
    c, p, m, a = r["costs"], r["pipeline"], r["memory"], r["auto_plan"]
    rows = [
        ("13-block costs, 2 stages: slowest stage / optimum", "equal layers", f"{c['stages_2']['equal_over_optimum']:.2f}x", "partition", "1.00x", "<= 1.05x"),
        ("13-block costs, 4 stages: slowest stage / optimum", "equal layers", f"{c['stages_4']['equal_over_optimum']:.2f}x", "partition", "1.00x", "<= 1.05x"),
        ("pipeline step, 2 procs gloo 1F1B (measured)", "equal layers", f"{1e3 * p['equal_step_s']:.1f} ms", "auto stages",
         f"{1e3 * p['auto_step_s']:.1f} ms", f"equal/auto {p['measured_equal_over_auto']:.2f}x (predicted {p['predicted_equal_over_auto']:.2f}x)"),
        ("param+grad+Adam bytes per rank, world 4", "DDP", f"{m['ddp_total'] / 2**20:.2f} MiB", "FSDP2",
         f"{m['fsdp_total'] / 2**20:.2f} MiB", f"{m['fsdp_over_ddp']:.2f}x (goal <= 0.55x)"),
    ]
    rows += [(f"auto_plan step time, {x['plan']}" + (" (chosen)" if x["chosen"] else ""), "predicted", f"{1e3 * x['predicted_s']:.1f} ms",
              "measured", f"{1e3 * x['measured_s']:.1f} ms", f"measured/predicted {x['measured_over_predicted']:.2f}x") for x in a["candidates"]]
    rows.append(("auto_plan choice vs fastest measured", "chosen", a["chosen"], "fastest", a["fastest_measured"],
                 f"link {a['link']['gbps']:.1f} Gbps, {1e6 * a['link']['latency_s']:.0f} us (measured)"))
    rows.append(("ranks running at once (2.0 = idle machine)", "pipeline run", f"{p['concurrency']:.2f}",
                 "auto_plan run", f"{a['concurrency']:.2f}", f"load average {r['loadavg_before'][0]:.1f} -> {r['loadavg_after'][0]:.1f}"))
    from rich.console import Console
    from rich.table import Table

    t = Table(title="automatic partitioner vs torch defaults")
    for h in ("figure", "baseline", "value", "ours", "value", "ratio / goal"):
        t.add_column(h)
    for row in rows:
        t.add_row(*row)
    Console(width=180).print(t)


if __name__ == "__main__":
    main()
