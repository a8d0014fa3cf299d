"""Tensor engine figures: ``python -m bench.tensor_bench [--quick] [--monarch] [--out PATH]``.

Three figures, each a ratio against a baseline measured in the same run:

1. dispatch: ``t = t + 1`` on a 4x4 tensor inside ``procs.activate()`` on 4
   procs, N ops (20,000; 5,000 with --quick) until ``inspect(t)`` returns:
   ops/s, best of 3 reps (2 with --quick) after a warm-up. The per-op split on the controller
   (interception floor, dispatch, encode, send) and the worker's cost per op
   are measured in-process (see ``bench/_tensor_split.py``). ``--monarch``
   runs the same loop under Monarch 0.7.0 in a subprocess (2,000 ops, 1,000
   with --quick: it is ~20-40x slower; best of 2), between our first and
   second rep, for the "x Monarch" ratio; goal >= 20x Monarch and >= 10,000 ops/s.
2. training: a 2-layer MLP (1024 -> 1024 -> 1024, batch 64 per rank) trained
   data-parallel on 2 procs written only with distributed tensors (forward,
   mse, backward, ``p.grad.reduce_("dp", "avg")`` under no_grad, SGD) vs the
   same model under torch DDP in an SPMD actor mesh (actormesh.spmd, gloo).
   Step time = time of K steps until the last loss is read / K (inspect(loss)
   on the controller; ``loss.item()`` inside the DDP actors, slowest rank);
   best of the reps, the two taking turns rep by rep. Goal <= 1.5x.
3. all-reduce of 64 MiB float32 over 4 procs: ``t.reduce_("gpu", "sum")``
   and out-of-place ``t.reduce("gpu", "sum")``, M calls until ``inspect`` of
   one element returns, vs ``torch.distributed.all_reduce`` called in an
   SPMD actor per proc (gloo; slowest rank), best of the reps. Goal <= 1.2x.

Every worker runs torch with one intra-op thread (OMP_NUM_THREADS=1, checked)
on this 2-core box. Other work on the machine distorts the figures, so the
run reports the load average around each figure and ``concurrency`` (2 x a
matmul loop's time alone / its time with both DDP ranks running it; 2.0
when idle). Writes bench/results/tensor.json and prints a markdown table;
about 2-3 minutes (plus ~1 minute with --monarch).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "tensor.json"
MONARCH_PYTHON = os.environ.get("BENCH_MONARCH_PYTHON", "/work/monarch-venv/bin/python")
GET_S = 180.0  # deadline of any single wait on the mesh
# workers inherit these: one torch thread each, and this repo importable for bench's actors
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import actormesh.tensor as te  # noqa: E402
from actormesh.actor import this_host  # noqa: E402
from actormesh.spmd import setup_torch_elastic_env  # noqa: E402
from bench._tensor_actors import BATCH, IN, LR, OUT as D_OUT, SPMDBench, ThreadProbe, make_mlp  # noqa: E402


_names = itertools.count()


def fetch(t: Any) -> Any:
    return te.fetch_shard(t).result(timeout=GET_S)


def load() -> float:
    return round(os.getloadavg()[0], 2)


def spawn(dims: dict[str, int]) -> tuple[Any, list[int]]:
    """Procs with one torch thread each (checked: returns each proc's thread count)."""
    # a distinct name per mesh: the engine registry is keyed by proc-mesh name, and every
    # unnamed mesh is "anon" (a later mesh would reach the first one's engine; see the report)
    procs = this_host().spawn_procs(dims, name=f"tbench{next(_names)}")
    threads = [n for n, _ in procs.spawn("threads", ThreadProbe).threads.call().get(timeout=GET_S).values()]
    return procs, threads


def spmd(dims: dict[str, int]) -> tuple[Any, Any]:
    procs, _ = spawn(dims)
    setup_torch_elastic_env(procs, timeout=GET_S)
    return procs, procs.spawn("spmd_bench", SPMDBench)


def close(procs: Any) -> None:
    """Stop tensor-engine ``procs`` once the deletes of their dead tensors are sent: a client left with
    queued deletes of a stopped mesh fails every later flush (see the report)."""
    gc.collect()
    with procs.activate():
        pass  # leaving the block flushes
    procs.stop().get(timeout=60)


def slowest(values: Any) -> float:
    return max(values.values())


# --------------------------------------------------------------------------- 1. dispatch


def ops_per_s(procs: Any, n: int) -> tuple[float, float]:
    """(ops/s of ``n`` ops until inspect returns, the controller thread's CPU share of that time)."""
    with procs.activate():
        t = torch.zeros(4, 4)
    start = float(fetch(t)[0, 0])
    t0, c0 = time.perf_counter(), time.thread_time()
    with procs.activate():
        for _ in range(n):
            t = t + 1
    c1 = time.thread_time()
    value = float(fetch(t)[0, 0])
    wall = time.perf_counter() - t0
    if value != start + n:
        raise AssertionError(f"dispatch loop computed {value}, expected {start + n}")
    return n / wall, (c1 - c0) / wall


def monarch_dispatch(n: int, reps: int) -> dict[str, Any]:
    """Monarch 0.7.0's rate for the same loop, or the reason there is none."""
    if not os.path.exists(MONARCH_PYTHON):
        return {"error": f"no Monarch interpreter at {MONARCH_PYTHON} (set BENCH_MONARCH_PYTHON)"}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    try:
        p = subprocess.run([MONARCH_PYTHON, "-m", "bench._tensor_monarch", str(n), str(reps)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"Monarch run passed 600 s: {str(exc.stderr or '')[-2000:]}"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        return {"error": f"rc {p.returncode}: {(p.stderr or p.stdout)[-3000:]}"}
    return json.loads(lines[0][len("RESULT "):])


def fig_dispatch(quick: bool, monarch: bool) -> dict[str, Any]:
    from bench._tensor_split import split

    n, reps = (5000, 2) if quick else (20000, 3)
    out: dict[str, Any] = {"n": n, "load_before": load()}
    procs, out["worker_threads"] = spawn({"gpu": 4})
    try:
        ops_per_s(procs, 1000)  # warm-up: engine spawn, propagation cache, first batches
        runs = [ops_per_s(procs, n)]
        if monarch:  # between our reps, so both see much the same machine load
            out["monarch"] = monarch_dispatch(1000 if quick else 2000, 2)
        runs += [ops_per_s(procs, n) for _ in range(reps - 1)]
        rates = [r for r, _ in runs]
        out["ops_s"], out["reps_ops_s"] = max(rates), rates
        # controller thread's CPU time / wall time of the loop: ~1 means controller-bound
        out["controller_cpu_share"] = max(runs)[1]
        out["split"] = sp = split(procs, n, fetch, reps=3 if quick else 5)
    finally:
        close(procs)
    out["end_to_end_us"] = 1e6 / out["ops_s"]
    # what the measured CPU costs allow on this machine were it idle: controller alone, or
    # controller + 4 workers sharing the cores, whichever binds (an estimate, not a measurement)
    cpu = sp["controller_total_us"] + 4 * (sp["worker_unpickle_us"] + sp["worker_run_us"])
    out["idle_estimate_ops_s"] = 1e6 / max(sp["controller_total_us"], cpu / (os.cpu_count() or 1))
    if "ops_s" in out.get("monarch", {}):
        out["x_monarch"] = out["ops_s"] / out["monarch"]["ops_s"]
    out["load_after"] = load()
    return out


# --------------------------------------------------------------------------- 2. training


def te_training(procs: Any) -> Any:
    """The data-parallel step written only with distributed tensors; returns step() -> loss."""
    with procs.activate():
        model = make_mlp()
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=LR)
        x, y = torch.randn(BATCH, IN), torch.randn(BATCH, D_OUT)

    def step() -> Any:
        with procs.activate():  # leaving it flushes: one batch per step
            loss = F.mse_loss(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in params:
                    p.grad.reduce_("dp", "avg")
            opt.step()
            opt.zero_grad()
        return loss

    return step


def count_commands(step: Any) -> int:
    """Commands one step records (ops, reductions, deletes not counted)."""
    from actormesh.tensor._client import EngineClient

    record, count = EngineClient.record, [0]

    def counting(self: Any, cmd: Any) -> None:
        count[0] += 1
        record(self, cmd)

    EngineClient.record = counting  # type: ignore[method-assign]
    try:
        fetch(step())
    finally:
        EngineClient.record = record  # type: ignore[method-assign]
    return count[0]


def te_steps(step: Any, k: int) -> float:
    t0 = time.perf_counter()
    for _ in range(k):
        loss = step()
    fetch(loss)
    return (time.perf_counter() - t0) / k


def training_runs(procs: Any, ddp: Any, k: int, reps: int, out: dict[str, Any]) -> None:
    """Both loops, taking turns rep by rep; every distributed tensor dies on return."""
    step = te_training(procs)
    out["loss_first"] = float(fetch(step()))
    te_steps(step, 3)
    out["commands_per_step"] = count_commands(step)
    out["params"] = ddp.setup_ddp.call().get(timeout=GET_S).values()[0]
    ddp.ddp_steps.call(3).get(timeout=GET_S)
    te_s, ddp_s = [], []
    for _ in range(reps):  # taking turns: both see the same machine load
        te_s.append(te_steps(step, k))
        ddp_s.append(slowest(ddp.ddp_steps.call(k).get(timeout=GET_S)))
    out["loss_last"] = float(fetch(step()))
    out.update(te_step_s=min(te_s), ddp_step_s=min(ddp_s), reps_te_step_s=te_s, reps_ddp_step_s=ddp_s)


def fig_training(quick: bool) -> dict[str, Any]:
    k, reps = (8, 2) if quick else (20, 3)
    out: dict[str, Any] = {"k": k, "load_before": load()}
    procs, out["worker_threads"] = spawn({"dp": 2})
    ddp_procs, ddp = spmd({"dp": 2})
    try:
        out["concurrency_before"] = min(ddp.concurrency.call().get(timeout=GET_S).values())
        training_runs(procs, ddp, k, reps, out)
        out["concurrency_after"] = min(ddp.concurrency.call().get(timeout=GET_S).values())
    finally:
        close(procs)
        ddp_procs.stop().get(timeout=60)
    out["load_after"] = load()
    out["te_over_ddp"] = out["te_step_s"] / out["ddp_step_s"]
    return out


# --------------------------------------------------------------------------- 3. all-reduce


def te_reduce_s(procs: Any, t: Any, m: int, inplace: bool) -> float:
    t0 = time.perf_counter()
    with procs.activate():
        for _ in range(m):
            if inplace:
                t.reduce_("gpu", "sum")
            else:
                r = t.reduce("gpu", "sum")
                last = r[0]
                del r
        last = t[0] if inplace else last
    fetch(last)
    return (time.perf_counter() - t0) / m


def allreduce_runs(procs: Any, base: Any, numel: int, m: int, reps: int) -> dict[str, list[float]]:
    """Seconds per call of each form, taking turns rep by rep; every distributed tensor dies on return."""
    with procs.activate():
        t = torch.ones(numel)
        t.reduce_("gpu", "sum")
        check = t[numel - 1].clone()
        t.zero_()  # zeros stay zeros however often they are summed
    got = float(fetch(check))
    if got != 4.0:
        raise AssertionError(f"reduce_ over 4 procs gave {got}, expected 4.0")
    te_reduce_s(procs, t, 1, inplace=False)  # warm-up both forms and gloo
    base.all_reduce.call(numel, 1).get(timeout=GET_S)
    runs: dict[str, list[float]] = {"reduce_inplace": [], "all_reduce": [], "reduce": [], "clone_all_reduce": []}
    for _ in range(reps):
        runs["reduce_inplace"].append(te_reduce_s(procs, t, m, inplace=True))
        runs["all_reduce"].append(slowest(base.all_reduce.call(numel, m).get(timeout=GET_S)))
        runs["reduce"].append(te_reduce_s(procs, t, m, inplace=False))
        runs["clone_all_reduce"].append(slowest(base.all_reduce.call(numel, m, True).get(timeout=GET_S)))
    return runs


def fig_allreduce(quick: bool) -> dict[str, Any]:
    numel = 64 * 2**20 // 4
    m, reps = (3, 2) if quick else (8, 3)
    out: dict[str, Any] = {"mib": 64, "calls_per_rep": m, "load_before": load()}
    procs, out["worker_threads"] = spawn({"gpu": 4})
    base_procs, base = spmd({"gpu": 4})
    try:
        runs = allreduce_runs(procs, base, numel, m, reps)
    finally:
        close(procs)
        base_procs.stop().get(timeout=60)
    for name, values in runs.items():
        out[f"{name}_s"], out[f"reps_{name}_s"] = min(values), values
    out["load_after"] = load()
    out["inplace_over_all_reduce"] = out["reduce_inplace_s"] / out["all_reduce_s"]
    out["out_of_place_over_all_reduce"] = out["reduce_s"] / out["all_reduce_s"]
    out["out_of_place_over_clone_all_reduce"] = out["reduce_s"] / out["clone_all_reduce_s"]
    return out


# --------------------------------------------------------------------------- report


def report(r: dict[str, Any]) -> str:
    d, s, tr, ar = r["dispatch"], r["dispatch"]["split"], r["training"], r["allreduce"]
    m = d.get("monarch", {})
    mon = (f"{m['ops_s']:,.0f} ops/s (n={m['n']})" if "ops_s" in m else ("ERROR: " + m["error"].splitlines()[-1][:120] if m else "not run (--monarch)"))
    x = f"{d['x_monarch']:.1f}x Monarch (goal >= 20x); " if "x_monarch" in d else ""
    rows = [
        ("dispatch `t = t + 1`, 4 procs, until inspect", "Monarch 0.7.0", mon, f"{d['ops_s']:,.0f} ops/s (n={d['n']})",
         f"{x}goal >= 10,000 ops/s; controller CPU share {d['controller_cpu_share']:.2f}; "
         f"idle-machine estimate {d['idle_estimate_ops_s']:,.0f} ops/s"),
        ("  controller per op: interception floor / dispatch / encode / send", "floor", f"{s['interception_us']:.1f} us",
         f"{s['dispatch_us']:.1f} / {s['encode_us']:.1f} / {s['send_us']:.1f} us",
         f"controller total {s['controller_total_us']:.1f} us = {s['controller_total_us'] / s['interception_us']:.1f}x floor; "
         f"end to end {d['end_to_end_us']:.1f} us/op"),
        ("  inside dispatch: propagate() cache hit, Tensor._make", "", "", f"{s['propagate_hit_us']:.2f}, {s['make_handle_us']:.2f} us", ""),
        ("  worker per op: unpickle / run (in-process); drain after flush", "", "",
         f"{s['worker_unpickle_us']:.1f} / {s['worker_run_us']:.1f} us; {s['drain_us']:.1f} us", f"batch of {s['batch_commands']} commands"),
        (f"training step, MLP {tr['params']:,} params, 2 procs, batch {BATCH}/rank", "torch DDP (SPMD actors)",
         f"{1e3 * tr['ddp_step_s']:.1f} ms", f"{1e3 * tr['te_step_s']:.1f} ms ({tr['commands_per_step']} commands/step)",
         f"{tr['te_over_ddp']:.2f}x (goal <= 1.5x); loss {tr['loss_first']:.4f} -> {tr['loss_last']:.4f}"),
        ("all-reduce 64 MiB fp32, 4 procs, in place `reduce_`", "dist.all_reduce (SPMD actors)",
         f"{1e3 * ar['all_reduce_s']:.1f} ms", f"{1e3 * ar['reduce_inplace_s']:.1f} ms", f"{ar['inplace_over_all_reduce']:.2f}x (goal <= 1.2x)"),
        ("all-reduce 64 MiB fp32, 4 procs, out of place `reduce`", "dist.all_reduce (SPMD actors)",
         f"{1e3 * ar['all_reduce_s']:.1f} ms", f"{1e3 * ar['reduce_s']:.1f} ms", f"{ar['out_of_place_over_all_reduce']:.2f}x (goal <= 1.2x)"),
        ("  same, against torch's out-of-place form", "t.clone() + dist.all_reduce",
         f"{1e3 * ar['clone_all_reduce_s']:.1f} ms", f"{1e3 * ar['reduce_s']:.1f} ms", f"{ar['out_of_place_over_clone_all_reduce']:.2f}x"),
        ("load: ranks at once (2.0 = idle) / load average", "", f"{tr['concurrency_before']:.2f} -> {tr['concurrency_after']:.2f}",
         f"{r['loadavg_before'][0]:.1f} -> {r['loadavg_after'][0]:.1f}", f"worker torch threads {sorted(set(d['worker_threads']))}"),
    ]
    lines = ["| figure | baseline | baseline value | tensor engine | ratio / goal |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer ops, steps and repetitions")
    ap.add_argument("--monarch", action="store_true", help="also run the dispatch loop under Monarch 0.7.0")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    results: dict[str, Any] = {"loadavg_before": list(os.getloadavg()), "cpus": os.cpu_count(), "quick": args.quick}
    results["dispatch"] = fig_dispatch(args.quick, args.monarch)
    results["training"] = fig_training(args.quick)
    results["allreduce"] = fig_allreduce(args.quick)
    results["loadavg_after"] = list(os.getloadavg())
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(report(results))
    print(f"\nwrote {args.out} ({results['wall_s']} s)")


if __name__ == "__main__":
    main()
