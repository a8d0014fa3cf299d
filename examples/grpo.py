"""Post-training by reinforcement alone: a tiny Llama learns which letter follows a given letter (GRPO).

    python examples/grpo.py

Everything is made here, nothing downloaded: a random Llama policy (vocabulary:
the 26 letters and a prompt marker), 2 generator replicas sampling with
log-probabilities (continuous batching), a frozen reference model for the KL
term, a trainer under ``Plan(dp=2)``, and a replay buffer. The task: the
prompt is ``[marker, letter]``, the answer one token; the reward is 1 for the
next letter (z wraps to a), else 0. A random policy is right about 1 time in
27, enough for GRPO's group-relative signal. Halfway, one generator replica is
killed: the service rebuilds it with the current weights and the loop goes
on. The reward curve is saved as grpo_reward.png (with matplotlib); the last
line is ``final reward: X``, the mean reward of the last 10 steps.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import time
from functools import partial

os.environ.setdefault("OMP_NUM_THREADS", "1")  # a 2-core machine: one thread per process

import torch
import transformers
from rich.console import Console

from actormesh.parallel import Plan
from actormesh.parallel.hf import hf_causal_lm
from actormesh.rl import GRPOConfig, GRPOLoop

LETTERS, MARKER = 26, 26
CONFIG = dict(vocab_size=27, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=8, tie_word_embeddings=False)


def reward(prompt: list[int], completion: list[int]) -> float:
    """1 for the letter after the prompt's letter."""
    return 1.0 if completion[:1] == [(prompt[-1] + 1) % LETTERS] else 0.0


def prompts(step: int, n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed * 100_003 + step)
    return [[MARKER, rng.randrange(LETTERS)] for _ in range(n)]


def kill_one_generator(loop: GRPOLoop) -> int:
    replica = next(r for r in loop.generator.service.replicas() if r.state == "healthy")
    info = next(i for i in replica.mesh.info.call().get(timeout=60).values() if i["rank"] == 0)
    os.kill(info["pid"], signal.SIGKILL)
    return replica.slot


def save_curve(rewards: list[float], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(rewards) + 1), rewards)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean reward")
    ax.set_title("GRPO: the letter after a letter")
    ax.set_ylim(0, 1.05)
    fig.tight_layout()
    fig.savefig(path)
    return f"reward curve saved to {path}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--png", default="grpo_reward.png")
    args = parser.parse_args()
    console = Console(soft_wrap=True)
    config = GRPOConfig(group_size=8, prompts_per_step=16, max_tokens=1, temperature=1.0, kl_coef=0.001, mode=args.mode)
    model_fn = partial(hf_causal_lm, transformers.LlamaConfig(**CONFIG), "LlamaForCausalLM")
    t0 = time.monotonic()
    with GRPOLoop(model_fn, reward, partial(prompts, seed=args.seed), config, partial(torch.optim.AdamW, lr=3e-3),
                  trainer_plan=Plan(dp=2), generator_replicas=2, seed=args.seed) as loop:
        console.print(f"2 generator replicas, a reference model and a dp=2 trainer up in {time.monotonic() - t0:.1f}s")
        rewards: list[float] = []
        for report in loop.run(args.steps):
            rewards.append(report.reward_mean)
            console.print(f"step {report.step:3d}  reward {report.reward_mean:.2f} (max {report.reward_max:.0f})  "
                          f"kl {report.kl:.4f}  {report.samples_per_s:5.0f} samples/s  lag {report.policy_lag}  "
                          f"sync {report.sync_s * 1e3:4.0f} ms  v{report.version}", highlight=False)
            if report.step == args.steps // 2:
                slot = kill_one_generator(loop)
                console.print(f"[bold red]killed generator replica {slot}[/] (SIGKILL): the service rebuilds it "
                              "with the current weights; its completions in flight are drawn again")
        retried = {k: v for k, v in loop.dropped.items()}
        console.print(f"done in {time.monotonic() - t0:.0f}s; retried or dropped: {retried or 'none'}")
    console.print(save_curve(rewards, args.png))
    print(f"final reward: {sum(rewards[-10:]) / len(rewards[-10:]):.2f}")


if __name__ == "__main__":
    main()
