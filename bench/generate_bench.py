"""Generation throughput: ``python -m bench.generate_bench [--quick] [--out PATH]``.

The issue's workload: 32 concurrent requests, 64 new tokens each (greedy),
prompts of 16 tokens, a tiny Llama (hidden 64, 2 layers, vocab 256, random
weights from seed 0) on CPU. Figures, each against a baseline measured in the
same run (best of ``--rounds`` rounds, the contenders taking turns):

1. one replica (``spawn_llm_server`` on 1 proc, ``LLMServerClient``, tokens
   streamed back per request through ports) with continuous batching, vs
   Hugging Face ``model.generate`` on the same batch of 32 in this process:
   decode tokens/s ratio (goal >= 1.5x);
2. the same engine in this process (``LLMEngine.complete``), vs HF generate;
   both 1 and 2 also with ``torch.compile`` (``Plan(compile=True)``,
   ``LLMEngine(compile=True)``), warmed up on every batch shape first;
3. KV cache vs none: the engine in this process vs the same greedy decoding
   recomputing the whole batch's sequences every step (``model.forward``),
   and HF generate with ``use_cache=True`` vs ``use_cache=False``.

Each figure is also given per CPU second of the process that generates
(this one, or the replica's proc; the mean over the rounds, as another
process's CPU clock ticks only every 10 ms): wall time on a shared 2-core
machine moves 2-3x with other load, CPU time much less. The greedy tokens of every
contender are checked against HF's. torch runs
one thread in this process and in the replica's proc (``OMP_NUM_THREADS=1``,
inherited): on a shared 2-core machine a multi-threaded torch loses 10-20x
whenever another process takes a core, which swamps every figure. Writes
bench/results/generate.json and prints a markdown table; 3 to 5 minutes (compiling).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "generate.json"
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False)
N_REQUESTS, NEW_TOKENS, PROMPT_LEN = 32, 64, 16


def prompts() -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, CONFIG["vocab_size"], (N_REQUESTS, PROMPT_LEN), generator=gen).tolist()


def hf_generate(hf: Any, batch: list[list[int]], use_cache: bool = True) -> list[list[int]]:
    import torch

    ids = torch.tensor(batch)
    with torch.no_grad():  # an explicit mask: HF would otherwise mask prompt tokens equal to pad_token_id
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          eos_token_id=None, pad_token_id=0, use_cache=use_cache)
    return out[:, PROMPT_LEN:].tolist()


def no_cache_generate(model: Any, batch: list[list[int]]) -> list[list[int]]:
    """Greedy decoding of the whole batch without a KV cache: every step runs the full sequences."""
    import torch

    seq = torch.tensor(batch)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, PROMPT_LEN:].tolist()


def warm_up(complete: Any, batch: list[list[int]]) -> None:
    """Run every graph shape a compiled model meets: 1 and several rows, prefill and decode, ragged batches."""
    from actormesh.serve import SamplingParams

    short = SamplingParams(max_tokens=3)
    complete([batch[0]], short)
    complete([batch[0], batch[1][:5]], short)
    complete(batch, SamplingParams(max_tokens=NEW_TOKENS))


async def _replica_round(client: Any, batch: list[list[int]], params: Any) -> list[list[int]]:
    async def one(p: list[int]) -> list[int]:
        return [t async for t in client.generate(p, params)]

    return list(await asyncio.gather(*[one(p) for p in batch]))


def timed(fn: Any, pid: int | None = None) -> tuple[float, float, Any]:
    """Wall seconds, CPU seconds (this process, or process ``pid`` where the work runs) and the result."""
    import psutil

    proc = psutil.Process(pid) if pid is not None else None

    def cpu() -> float:
        if proc is None:
            return time.process_time()
        times = proc.cpu_times()
        return times.user + times.system

    t0, c0 = time.perf_counter(), cpu()
    out = fn()
    return time.perf_counter() - t0, cpu() - c0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 5")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported here and before the proc is spawned
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no pool of compile workers left competing for the cores
    import torch
    import transformers

    from actormesh.actor import this_host
    from actormesh.parallel import Plan
    from actormesh.parallel.hf import hf_causal_lm
    from actormesh.serve import LLMEngine, LLMServerClient, SamplingParams, spawn_llm_server

    config = transformers.LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    torch.manual_seed(0)
    model = hf_causal_lm(config, "LlamaForCausalLM")
    batch = prompts()
    params = SamplingParams(max_tokens=NEW_TOKENS)
    tokens = N_REQUESTS * NEW_TOKENS
    best: dict[str, float] = {}
    checks: dict[str, bool] = {}

    cpu_total: dict[str, float] = {}  # summed over rounds: a proc's CPU clock ticks every 10 ms, a round is ~70 ms
    rounds_seen: dict[str, int] = {}

    def record(name: str, seconds: float, cpu_s: float, out: list[list[int]], ref: list[list[int]]) -> None:
        best[name] = min(best.get(name, float("inf")), seconds)
        cpu_total[name] = cpu_total.get(name, 0.0) + cpu_s
        rounds_seen[name] = rounds_seen.get(name, 0) + 1
        checks[name] = checks.get(name, True) and out == ref

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    servers: list[Any] = []
    try:
        model_fn = partial(hf_causal_lm, config, "LlamaForCausalLM")
        clients = {}
        for name, plan in (("replica", Plan()), ("replica_compiled", Plan(compile=True))):
            servers.append(spawn_llm_server(procs.slice(gpus=len(servers)), model_fn, plan, max_slots=N_REQUESTS,
                                            name=name, timeout=900))
            clients[name] = LLMServerClient(servers[-1])
        infos = {name: client.driver.info.call_one().get(timeout=60) for name, client in clients.items()}
        replica_threads = infos["replica"]["torch_threads"]
        with LLMEngine(model, max_slots=N_REQUESTS) as engine, \
                LLMEngine(hf_causal_lm(config, "LlamaForCausalLM"), max_slots=N_REQUESTS, compile=True) as compiled:
            compiled.backend.swap(model.state_dict())  # type: ignore[attr-defined]
            for client in clients.values():
                warm_up(lambda ps, p, c=client: asyncio.run(_replica_round(c, ps, p)), batch)
            for eng in (engine, compiled):
                warm_up(eng.complete, batch)
            ref = hf_generate(hf, batch)
            for _ in range(rounds):
                record("hf_generate", *timed(lambda: hf_generate(hf, batch)), ref)
                for name, client in clients.items():  # CPU: the replica's proc, where the generation runs
                    record(name, *timed(lambda: asyncio.run(_replica_round(client, batch, params)), infos[name]["pid"]), ref)
                record("engine", *timed(lambda: engine.complete(batch, params)), ref)
                record("engine_compiled", *timed(lambda: compiled.complete(batch, params)), ref)
                record("no_cache", *timed(lambda: no_cache_generate(model, batch)), ref)
                record("hf_no_cache", *timed(lambda: hf_generate(hf, batch, use_cache=False)), ref)
        for client in clients.values():
            client.close()
    finally:
        for server in servers:
            server.stop().get(timeout=60)
        procs.stop().get(timeout=60)

    rate = {k: tokens / v for k, v in best.items()}
    cpu_mean = {k: v / rounds_seen[k] for k, v in cpu_total.items()}  # mean CPU seconds per round
    cpu_rate = {k: tokens / v for k, v in cpu_mean.items()}
    result = {
        "workload": f"{N_REQUESTS} requests x {NEW_TOKENS} new tokens, prompt {PROMPT_LEN}, Llama hidden 64 x 2 layers, vocab 256, CPU",
        "rounds": rounds, "torch_threads": torch.get_num_threads(), "replica_torch_threads": replica_threads, "loadavg": os.getloadavg(),
        "seconds": best, "tokens_per_s": rate, "cpu_seconds": cpu_mean, "tokens_per_cpu_s": cpu_rate,
        "greedy_equals_hf": checks,
        "ratios": {
            "replica_vs_hf_generate": rate["replica"] / rate["hf_generate"],
            "replica_compiled_vs_hf_generate": rate["replica_compiled"] / rate["hf_generate"],
            "engine_vs_hf_generate": rate["engine"] / rate["hf_generate"],
            "engine_compiled_vs_hf_generate": rate["engine_compiled"] / rate["hf_generate"],
            "engine_kv_cache_vs_no_cache": rate["engine"] / rate["no_cache"],
            "hf_cache_vs_no_cache": rate["hf_generate"] / rate["hf_no_cache"],
        },
    }
    # Per CPU second: what the generating process spends, which other load on a shared machine does not
    # change (wall time does); the replica's figure leaves out the controller, which has a core of its own.
    result["cpu_ratios"] = {f"{name}_vs_hf_generate": cpu_rate[name] / cpu_rate["hf_generate"]
                            for name in ("replica", "replica_compiled", "engine", "engine_compiled")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{result['workload']}; best of {rounds}; torch threads {result['torch_threads']}; load {result['loadavg']}\n")
    print("| contender | tokens/s | greedy = HF |\n|---|---|---|")
    for name in best:
        print(f"| {name} | {rate[name]:,.0f} | {checks[name]} |")
    print("\n| ratio | wall | CPU |\n|---|---|---|")
    for name, value in result["ratios"].items():
        print(f"| {name} | {value:.2f}x | {result['cpu_ratios'].get(name, float('nan')):.2f}x |")


if __name__ == "__main__":
    main()
