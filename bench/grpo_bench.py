"""GRPO loop throughput, async vs sync: ``python -m bench.grpo_bench [--steps N] [--out PATH]``.

The demo's loop (examples/grpo.py: tiny Llama, 16 prompts x 8 completions per
step, 2 generator replicas, a reference model, a ``Plan(dp=2)`` trainer) run
for ``--steps`` trainer steps in each mode, one after the other in one run.
Figures: completions trained on per second (over the steps after the first
two, which warm up), the trainer's idle fraction (the share of a step it
waited for samples), and how busy the loop kept the machine's cores: CPU
seconds of this process and every process under it over the same steps,
per wall second and core. Overlapping generation with training can only
help where sync mode leaves cores idle. Goal: async >= 1.5x sync. Writes
bench/results/grpo.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "grpo.json"


def run(mode: str, steps: int) -> dict[str, float]:
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "examples"))
    from grpo import CONFIG, prompts, reward  # the demo's task

    from actormesh.parallel import Plan
    from actormesh.parallel.hf import hf_causal_lm
    from actormesh.rl import GRPOConfig, GRPOLoop

    config = GRPOConfig(group_size=8, prompts_per_step=16, max_tokens=1, kl_coef=0.001, mode=mode, max_policy_lag=1)
    model_fn = partial(hf_causal_lm, transformers.LlamaConfig(**CONFIG), "LlamaForCausalLM")
    with GRPOLoop(model_fn, reward, prompts, config, partial(torch.optim.AdamW, lr=3e-3), trainer_plan=Plan(dp=2),
                  generator_replicas=2) as loop:
        reports, marks = [], []
        for report in loop.run(steps):
            reports.append(report)
            if len(reports) in (2, steps):  # the timed steps: after the first two
                marks.append((time.monotonic(), tree_cpu_s()))
        buffer = loop.buffer.stats.call_one().get(timeout=60)
    timed = reports[2:]
    seconds = sum(r.samples / r.samples_per_s for r in timed)
    (w0, c0), (w1, c1) = marks
    return {"samples_per_s": sum(r.samples for r in timed) / seconds,
            "cores_busy": (c1 - c0) / (w1 - w0) / (os.cpu_count() or 1),
            "trainer_idle": sum(r.trainer_idle * r.samples / r.samples_per_s for r in timed) / seconds,
            "final_reward": sum(r.reward_mean for r in reports[-5:]) / 5, "max_lag": max(r.policy_lag for r in reports),
            "dropped": dict(reports[-1].dropped), "buffer": buffer}


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and all its descendants (procs, host agents) so far."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        total += times.user + times.system
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3: the first two steps warm up and are not timed")
    os.environ["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    result = {mode: run(mode, args.steps) for mode in ("sync", "async")}
    result["async_vs_sync"] = result["async"]["samples_per_s"] / result["sync"]["samples_per_s"]
    result["loadavg"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{args.steps} steps per mode in {time.monotonic() - t0:.0f}s; load {os.getloadavg()}\n")
    print("| mode | completions/s | trainer idle | cores busy | max lag | reward, last 5 steps |\n|---|---|---|---|---|---|")
    for mode in ("sync", "async"):
        r = result[mode]
        print(f"| {mode} | {r['samples_per_s']:,.0f} | {r['trainer_idle']:.0%} | {r['cores_busy']:.0%} | {r['max_lag']} | "
              f"{r['final_reward']:.2f} |")
    print(f"\nasync / sync: {result['async_vs_sync']:.2f}x (goal >= 1.5x)")


if __name__ == "__main__":
    main()
