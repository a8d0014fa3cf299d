"""Train a tiny Hugging Face Llama on 4 local procs under any plan, from one controller.

The model is built from a config in code (nothing is downloaded), made of HF's
own decoder layers adapted by ``actormesh.parallel.hf``. The data is synthetic
(runs of consecutive token ids), so the loss falls within a few steps.

Run:
    python examples/hf_train.py --plan fsdp=2,tp=2
    python examples/hf_train.py --plan pp=2,dp=2 --steps 5
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from actormesh.actor import this_host  # noqa: E402
from actormesh.parallel import Plan, spawn_trainer  # noqa: E402
from actormesh.parallel.hf import hf_causal_lm  # noqa: E402
from actormesh.parallel.models import lm_loss  # noqa: E402

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=4, max_position_embeddings=64)


def parse_plan(text: str) -> Plan:
    """``"fsdp=2,tp=2"`` -> ``Plan(fsdp=2, tp=2)`` (integer fields; ``pp_schedule=GPipe`` too)."""
    fields: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        fields[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return Plan(**fields)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", default="fsdp=2,tp=2", help="Plan fields, e.g. dp=4 | fsdp=4 | dp=2,tp=2 | pp=2,fsdp=2")
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    plan = parse_plan(args.plan)
    gen = torch.Generator().manual_seed(0)
    procs = this_host().spawn_procs(per_host={"gpus": args.procs})
    try:
        start = time.monotonic()
        trainer = spawn_trainer(procs, partial(hf_causal_lm, CONFIG), lm_loss, partial(torch.optim.AdamW, lr=1e-2), plan)
        print(f"{plan.describe()}: set up in {time.monotonic() - start:.1f}s")
        try:
            for step in range(args.steps):
                # Learnable synthetic data: runs of consecutive token ids from random starts.
                starts = torch.randint(0, CONFIG.vocab_size, (args.batch, 1), generator=gen)
                seq = (starts + torch.arange(args.seq + 1)) % CONFIG.vocab_size
                loss = trainer.step.call((seq[:, :-1], seq[:, 1:])).get(timeout=120).values()[0]
                print(f"step {step}: loss {loss:.4f}")
        finally:
            trainer.stop().get(timeout=60)
    finally:
        procs.stop().get(timeout=30)


if __name__ == "__main__":
    main()
