"""Training figures (issue 25): ``python -m bench.train_bench [--quick] [--out PATH]``.

Every figure is a ratio to a baseline measured in the same run (the machine
is shared and noisy), rounds interleaved, medians of the rounds:

1. **step time**, 2 procs, a 4M-parameter GPT, AdamW, the data made on the
   ranks: a step through ``spawn_trainer`` (``step_figures.call().get()`` on
   the controller: round trip, loss and figures included) against a plain
   ``torchrun`` script of the same model, data and optimizer that reads its
   loss every step, for DDP (``Plan(dp=2)``) and FSDP2 (``Plan(fsdp=2)``).
   Wall time is the 10th percentile of the steps (the machine's other load
   moves medians by +-40%); CPU seconds per step (user + system, summed over
   the ranks, and with the controller's) is the steadier overhead figure.
2. **controller CPU per step** (``time.process_time`` of the controller, all
   its threads) with the global batch 16x larger, batches sent from the
   controller against data read on the ranks.
3. **memory per rank**, counted from the tensors (parameters, gradients,
   optimizer state; ``Trainer.info()["state_bytes"]``), a 100M-parameter GPT
   with AdamW after one step: ``fsdp=2`` against ``dp=2``.
4. **recovery**: an elastic trainer (checkpoint every 5 steps) on the demo
   model; rank 1 SIGKILLed after step 7: time from the kill to the end of
   step 8 against one ordinary step, and the steps replayed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # both sides: one intra-op thread per proc on a 2-core machine

import torch  # noqa: E402

from actormesh.actor import this_host  # noqa: E402
from actormesh.parallel import Plan, Recovery, spawn_elastic_trainer, spawn_trainer  # noqa: E402
from actormesh.parallel.models import GPTConfig, gpt, lm_loss, synthetic_batches  # noqa: E402

STEP_CFG = GPTConfig(vocab_size=256, d_model=256, n_heads=4, n_blocks=5, seq_len=64)
STEP_BATCH = 16
ADAMW = partial(torch.optim.AdamW, lr=1e-3)

TORCHRUN_SCRIPT = textwrap.dedent('''
    """The same training as the trainer's, written as a plain torchrun script."""
    import json, sys, time
    import torch, torch.distributed as dist
    from actormesh.parallel.models import GPTConfig, gpt, lm_loss, synthetic_batches

    plan, steps, warmup, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cfg = GPTConfig(**json.loads(sys.argv[5]))
    batch = int(sys.argv[6])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = gpt(cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_blocks, cfg.seq_len)
    if plan == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = batch // world
    data = synthetic_batches(cfg, batch, seed=1)
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            cpu0 = time.process_time()
        x, y = next(data)
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        start = time.perf_counter()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        float(total)  # the loss read every step, as a training loop logs it
        if i >= warmup:
            times.append(time.perf_counter() - start)
    cpu = torch.tensor([time.process_time() - cpu0], dtype=torch.float64)
    dist.all_reduce(cpu)
    if rank == 0:
        times.sort()
        json.dump({"p10_s": times[len(times) // 10], "cpu_s": float(cpu) / steps}, open(out, "w"))
    dist.barrier()
    dist.destroy_process_group()
''')


def shards(dp_rank: int, dp_size: int, start_step: int, cfg: GPTConfig, batch: int) -> Iterator[tuple[Any, Any]]:
    """This data-parallel rank's share of the global synthetic batches, from ``start_step``."""
    n = batch // dp_size
    for i, (x, y) in enumerate(synthetic_batches(cfg, batch, seed=1)):
        if i >= start_step:
            yield x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]


def model_of(cfg: GPTConfig) -> Any:
    return partial(gpt, cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_blocks, cfg.seq_len)


def torchrun_step_s(plan: str, steps: int, warmup: int) -> tuple[float, float]:
    """(10th percentile step wall time, CPU seconds per step summed over the ranks); one retry (torchrun's
    standalone rendezvous sometimes fails to start on a busy machine)."""
    try:
        return _torchrun_once(plan, steps, warmup)
    except RuntimeError as exc:
        print(f"retrying the torchrun baseline once: {str(exc)[-300:]}", file=sys.stderr)
        return _torchrun_once(plan, steps, warmup)


def _torchrun_once(plan: str, steps: int, warmup: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        script, out = os.path.join(tmp, "train.py"), os.path.join(tmp, "out.json")
        with open(script, "w") as f:
            f.write(TORCHRUN_SCRIPT)
        cfg = json.dumps({k: getattr(STEP_CFG, k) for k in ("vocab_size", "d_model", "n_heads", "n_blocks", "seq_len")})
        done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "2",
                               script, plan, str(steps), str(warmup), out, cfg, str(STEP_BATCH)], timeout=600,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode and not os.path.exists(out):  # an abort after the figures were written costs nothing
            raise RuntimeError(f"the torchrun baseline ({plan}) failed with exit {done.returncode}:\n{done.stderr[-3000:]}")
        with open(out) as f:
            got = json.load(f)
            return float(got["p10_s"]), float(got["cpu_s"])


def _cpu_s(pids: list[int]) -> float:
    import psutil

    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def actormesh_step_s(procs: Any, plan: Plan, steps: int, warmup: int) -> tuple[float, float, float]:
    """(10th percentile step wall time, CPU seconds per step of the ranks, of the ranks and the controller)."""
    trainer = spawn_trainer(procs, model_of(STEP_CFG), lm_loss, ADAMW, plan, timeout=300,
                            data=partial(shards, cfg=STEP_CFG, batch=STEP_BATCH))
    try:
        pids = [i["pid"] for i in trainer.info.call().get(timeout=60).values()]
        times = []
        for i in range(warmup + steps):
            if i == warmup:
                ranks0, controller0 = _cpu_s(pids), time.process_time()
            start = time.perf_counter()
            trainer.step_figures.call().get(timeout=120)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        ranks = (_cpu_s(pids) - ranks0) / steps
        times.sort()
        return times[len(times) // 10], ranks, ranks + (time.process_time() - controller0) / steps
    finally:
        trainer.stop().get(timeout=60)


def bench_step_time(rounds: int, steps: int) -> dict[str, Any]:
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    out: dict[str, Any] = {}
    try:
        for name, plan in (("ddp", Plan(dp=2)), ("fsdp", Plan(fsdp=2))):
            rows = []
            for _ in range(rounds):
                t_wall, t_cpu = torchrun_step_s(name, steps, 5)
                a_wall, a_cpu, a_cpu_all = actormesh_step_s(procs, plan, steps, 5)
                rows.append({"wall": a_wall / t_wall, "cpu_ranks": a_cpu / t_cpu, "cpu_all": a_cpu_all / t_cpu,
                             "actormesh_ms": 1000 * a_wall, "torchrun_ms": 1000 * t_wall})
            out[name] = {key: statistics.median(r[key] for r in rows) for key in rows[0]} | {"rounds": rows}
    finally:
        procs.stop().get(timeout=60)
    return out


def controller_cpu_per_step(procs: Any, batch: int, on_ranks: bool, steps: int) -> float:
    cfg = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_blocks=2, seq_len=64)
    kw = {"data": partial(shards, cfg=cfg, batch=batch)} if on_ranks else {}
    trainer = spawn_trainer(procs, model_of(cfg), lm_loss, ADAMW, Plan(dp=2), timeout=300, **kw)
    try:
        batches = synthetic_batches(cfg, batch, seed=1)
        trainer.step.call(*(() if on_ranks else (next(batches),))).get(timeout=120)
        start = time.process_time()
        for _ in range(steps):
            trainer.step.call(*(() if on_ranks else (next(batches),))).get(timeout=120)
        return (time.process_time() - start) / steps
    finally:
        trainer.stop().get(timeout=60)


def bench_controller_cpu(steps: int) -> dict[str, Any]:
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    out: dict[str, Any] = {}
    try:
        for label, on_ranks in (("data on the ranks", True), ("batches sent", False)):
            small = controller_cpu_per_step(procs, 16, on_ranks, steps)
            large = controller_cpu_per_step(procs, 256, on_ranks, steps)
            out[label] = {"cpu_ms_batch16": 1000 * small, "cpu_ms_batch256": 1000 * large, "ratio_16x": large / small}
    finally:
        procs.stop().get(timeout=60)
    return out


def bench_memory() -> dict[str, Any]:
    cfg = GPTConfig(vocab_size=256, d_model=768, n_heads=12, n_blocks=14, seq_len=16)
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    out: dict[str, Any] = {}
    try:
        for name, plan in (("dp=2", Plan(dp=2)), ("fsdp=2", Plan(fsdp=2))):
            trainer = spawn_trainer(procs, model_of(cfg), lm_loss, ADAMW, plan, timeout=600,
                                    data=partial(shards, cfg=cfg, batch=2))
            try:
                trainer.step.call().get(timeout=600)
                info = trainer.info.call().get(timeout=120).values()
            finally:
                trainer.stop().get(timeout=120)
            per_rank = [sum(i["state_bytes"].values()) for i in info]
            out[name] = {"bytes_per_rank": max(per_rank), "params_per_rank": max(i["local_params"] for i in info),
                         "split": info[0]["state_bytes"]}
        out["ratio_fsdp_over_dp"] = out["fsdp=2"]["bytes_per_rank"] / out["dp=2"]["bytes_per_rank"]
        out["model_params"] = out["dp=2"]["params_per_rank"]
    finally:
        procs.stop().get(timeout=60)
    return out


def bench_recovery(rounds: int) -> dict[str, Any]:
    cfg = GPTConfig(vocab_size=64, d_model=64, n_heads=4, n_blocks=3, seq_len=32)
    runs = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            recovery = Recovery(tmp, checkpoint_every=5, max_restarts=1)
            with spawn_elastic_trainer(model_of(cfg), lm_loss, ADAMW, Plan(dp=2), recovery=recovery, timeout=300,
                                       data=partial(shards, cfg=cfg, batch=16)) as trainer:
                step_s = []
                for _ in range(7):
                    start = time.perf_counter()
                    trainer.step()
                    step_s.append(time.perf_counter() - start)
                pid = trainer.mesh.info.call().get(timeout=60).values()[1]["pid"]
                killed = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
                fig = trainer.step_figures()
                recover_s = time.perf_counter() - killed
            runs.append({"kill_to_next_step_s": recover_s, "step_s": statistics.median(step_s[2:]),
                         "replayed": 2 if fig.recovery and "replayed 2 step(s)" in fig.recovery else None, "note": fig.recovery})
    return {"runs": runs, "kill_to_next_step_s": statistics.median(r["kill_to_next_step_s"] for r in runs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    p.add_argument("--skip", nargs="*", default=[], choices=["step", "cpu", "memory", "recovery"])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "train.json"))
    args = p.parse_args()
    rounds, steps = (1, 10) if args.quick else (3, 30)
    results: dict[str, Any] = {}
    sections = (("step", lambda: bench_step_time(rounds, steps)), ("cpu", lambda: bench_controller_cpu(steps)),
                ("memory", bench_memory), ("recovery", lambda: bench_recovery(1 if args.quick else 2)))
    for name, run in sections:
        if name in args.skip:
            continue
        started = time.monotonic()
        results[name] = run()
        print(f"{name} ({time.monotonic() - started:.0f}s): {json.dumps(results[name], default=str)}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    report(results)


def report(r: dict[str, Any]) -> None:
    if "step" in r:
        for name in ("ddp", "fsdp"):
            s = r["step"][name]
            print(f"step {name:>4}, actormesh / torchrun: wall p10 {s['actormesh_ms']:.1f} / {s['torchrun_ms']:.1f} ms = {s['wall']:.3f}x; "
                  f"CPU per step, ranks {s['cpu_ranks']:.3f}x, ranks + controller {s['cpu_all']:.3f}x "
                  f"(wall per round {', '.join(format(x['wall'], '.2f') for x in s['rounds'])})")
    if "cpu" in r:
        for label, c in r["cpu"].items():
            print(f"controller CPU per step, {label}: batch 16 {c['cpu_ms_batch16']:.2f} ms, batch 256 {c['cpu_ms_batch256']:.2f} ms "
                  f"({c['ratio_16x']:.2f}x for a 16x batch)")
    if "memory" in r:
        m = r["memory"]
        print(f"memory per rank ({m['model_params'] / 1e6:.0f}M params, AdamW): fsdp=2 {m['fsdp=2']['bytes_per_rank'] / 2**20:,.0f} MiB / "
              f"dp=2 {m['dp=2']['bytes_per_rank'] / 2**20:,.0f} MiB = {m['ratio_fsdp_over_dp']:.3f}x")
    if "recovery" in r:
        for run in r["recovery"]["runs"]:
            print(f"recovery: SIGKILL -> next step {run['kill_to_next_step_s']:.1f}s (an ordinary step {1000 * run['step_s']:.0f} ms), "
                  f"replayed {run['replayed']} step(s)")


if __name__ == "__main__":
    main()
