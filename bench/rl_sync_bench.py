"""Weight sync for post-training: ``python -m bench.rl_sync_bench [--layers N] [--rounds R] [--out PATH]``.

A Llama of about 100M parameters (fp32; hidden 768, 12 layers, vocabulary
16384) is trained under ``Plan(fsdp=2)`` on 2 procs; 2 generator replicas
(``spawn_llm_server``, 1 proc each) hold the same model. One sync moves the
trainer's current weights into both replicas (checked, staged, swapped
between decode steps). Contenders, best of ``--rounds``, in one run:

1. ``rdma``: ``publish_weights(trainer)`` (each trainer rank publishes its
   FSDP shards in place: its parameters' memory, registered once, guarded
   by a change counter; nothing is gathered or copied) and
   ``update_weights(published)``: each replica checks the layout, reads both
   ranks' shards straight into the rows of its spare parameter set (one
   scatter copy per trainer rank) and swaps it in between two steps (no copy);
2. ``controller``: ``gather_state_dict(trainer)`` into the controller, then
   ``update_weights(state_dict)``, which sends the tensors to each replica in
   ordinary messages;
3. ``memcpy``: one ``copy_`` of the same bytes in the controller (the floor a
   sync into one replica could reach, were it free of everything else).

Ratios: rdma / memcpy (goal <= 3x: note rdma moves the bytes twice, into
each of 2 replicas; three times where a trainer rank must copy its pieces
into a buffer first) and controller / rdma (goal >= 5x). Timings are from
the second round on (the first one registers the parameters, collapsing
them into huge pages, and allocates and faults in the replicas' spare sets,
which later rounds reuse; it is reported as ``rdma: first sync``). Writes bench/results/rl_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "rl_sync.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import transformers

    from actormesh.actor import this_host
    from actormesh.parallel import Plan, gather_state_dict, publish_weights, spawn_trainer
    from actormesh.parallel.hf import hf_causal_lm
    from actormesh.parallel.models import lm_loss
    from actormesh.serve import LLMServerClient, spawn_llm_server

    config = transformers.LlamaConfig(vocab_size=16384, hidden_size=768, intermediate_size=2048, num_hidden_layers=args.layers,
                                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    model_fn = partial(hf_causal_lm, config, "LlamaForCausalLM")
    host = this_host()
    trainer_procs = host.spawn_procs(per_host={"gpus": 2})
    gen_procs = host.spawn_procs(per_host={"gpus": 2})
    servers: list[Any] = []
    try:
        trainer = spawn_trainer(trainer_procs, model_fn, lm_loss, partial(torch.optim.AdamW, lr=1e-4), Plan(fsdp=2), timeout=900)
        servers = [spawn_llm_server(gen_procs.slice(gpus=i), model_fn, Plan(), max_slots=2, timeout=900) for i in range(2)]
        clients = [LLMServerClient(s) for s in servers]
        full = gather_state_dict(trainer, timeout=600)
        nbytes = sum(t.numel() * t.element_size() for t in full.values())
        params = sum(t.numel() for t in full.values())
        src = torch.cat([t.reshape(-1) for t in full.values()])
        dst = torch.empty_like(src)
        dst.copy_(src)  # touched
        del full
        best: dict[str, float] = {}

        def record(name: str, seconds: float) -> None:
            best[name] = min(best.get(name, float("inf")), seconds)

        def to_all(weights: Any) -> None:  # both replicas at once, as LLMService.update_weights does
            with ThreadPoolExecutor(len(clients)) as pool:
                list(pool.map(lambda c: c.update_weights(weights, timeout_s=600), clients))

        t0 = time.perf_counter()
        to_all(publish_weights(trainer, 0, timeout=600))
        best["rdma: first sync (allocates, faults pages in)"] = time.perf_counter() - t0
        for version in range(1, args.rounds + 1):
            t0 = time.perf_counter()
            published = publish_weights(trainer, version, timeout=600)
            record("rdma: publish (each rank names its registered shards)", time.perf_counter() - t0)
            t1 = time.perf_counter()
            to_all(published)
            record("rdma: replicas check, read into place, swap", time.perf_counter() - t1)
            record("rdma", time.perf_counter() - t0)
            t0 = time.perf_counter()
            state = gather_state_dict(trainer, timeout=600)
            record("controller: gather", time.perf_counter() - t0)
            t1 = time.perf_counter()
            to_all(state)
            record("controller: send, check, swap", time.perf_counter() - t1)
            record("controller", time.perf_counter() - t0)
            del state
            t0 = time.perf_counter()
            dst.copy_(src)
            record("memcpy", time.perf_counter() - t0)
        for client in clients:
            client.close()
    finally:
        for server in servers:
            server.stop().get(timeout=60)
        gen_procs.stop().get(timeout=60)
        trainer_procs.stop().get(timeout=60)
    result = {
        "model": f"Llama hidden 768, {args.layers} layers, vocab 16384: {params / 1e6:.0f}M parameters, {nbytes / 1e6:.0f} MB fp32",
        "trainer": "Plan(fsdp=2), 2 procs", "generators": "2 replicas x 1 proc", "rounds": args.rounds,
        "loadavg": os.getloadavg(), "seconds": best,
        "MB_per_s_into_each_replica": {k: nbytes / 1e6 / v for k, v in best.items() if k in ("rdma", "controller")},
        "ratios": {"rdma_vs_memcpy": best["rdma"] / best["memcpy"], "controller_vs_rdma": best["controller"] / best["rdma"]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{result['model']}; best of {args.rounds}; load {os.getloadavg()}\n")
    print("| contender | seconds | MB/s per replica |\n|---|---|---|")
    for name, seconds in best.items():
        rate = result["MB_per_s_into_each_replica"].get(name)
        print(f"| {name} | {seconds:.3f} | {'' if rate is None else f'{rate:,.0f}'} |")
    print(f"\nrdma / memcpy: {result['ratios']['rdma_vs_memcpy']:.2f}x (goal <= 3x); "
          f"controller / rdma: {result['ratios']['controller_vs_rdma']:.2f}x (goal >= 5x)")


if __name__ == "__main__":
    main()
