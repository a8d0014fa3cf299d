"""Generation replicas on real procs (actormesh.serve.spawn_llm_server / LLMServerClient).

Greedy output under ``Plan(tp=2)`` and ``Plan(pp=2)`` equals Hugging Face
``generate(do_sample=False)`` token for token, with requests joining the
running batch; errors reach the caller; cancelling frees the slot; weights
swap in a running replica (state dict to every rank, or a path each rank
reads) with no request lost; a dead replica fails its streams at once.
The module shares one mesh of 2 procs.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import module_procs  # noqa: E402

from actormesh.parallel import Plan, PlanError  # noqa: E402
from actormesh.parallel.hf import from_hf_state_dict, hf_causal_lm  # noqa: E402
from actormesh.serve import LLMServerClient, SamplingParams, spawn_llm_server  # noqa: E402
from test_prompt_logprobs import check as check_prompt_scores  # noqa: E402

LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
CONFIG = transformers.LlamaConfig(**LLAMA)
MODEL = partial(hf_causal_lm, CONFIG, "LlamaForCausalLM")
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [100, 50, 20, 10, 11, 12, 13]]
T = 60  # bound of every wait


def hf_model(seed: int) -> Any:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(CONFIG).eval()


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, T))


async def collect(client: LLMServerClient, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t async for t in client.generate(prompt, params)]


async def joining(client: LLMServerClient, n_long: int, n: int) -> list[list[int]]:
    """PROMPTS[0] runs alone for 3 tokens, then the others join the running batch."""
    first = client.generate(PROMPTS[0], SamplingParams(max_tokens=n_long))
    got = [await first.__anext__() for _ in range(3)]
    later = [asyncio.ensure_future(collect(client, p, SamplingParams(max_tokens=n))) for p in PROMPTS[1:]]
    got += [t async for t in first]
    return [got] + list(await asyncio.gather(*later))


@pytest.fixture(scope="module")
def procs() -> Iterator[Any]:
    yield from module_procs({"gpus": 2})


@contextmanager
def replica(procs: Any, plan: Plan, **kw: Any) -> Iterator[LLMServerClient]:
    server = spawn_llm_server(procs, MODEL, plan, timeout=120, **kw)
    try:
        with LLMServerClient(server) as client:
            yield client
    finally:
        server.stop().get(timeout=T)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("plan", [Plan(tp=2), Plan(pp=2)], ids=["tp2", "pp2"])
def test_greedy_equals_hf_generate_under_the_plan(procs: Any, plan: Plan) -> None:
    old, new = hf_model(0), hf_model(1)
    with replica(procs, plan, max_slots=4) as client:
        info = client.server.info.call().get(timeout=T).values()
        assert [i["stages"] for i in info] == [[[0, 1], [2, 3]] if plan.pp == 2 else None] * 2
        assert run(joining(client, 16, 8)) == [hf_greedy(old, PROMPTS[0], 16)] + [hf_greedy(old, p, 8) for p in PROMPTS[1:]]
        sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
        assert run(collect(client, PROMPTS[1], sampled)) == run(collect(client, PROMPTS[1], sampled))
        # log-probabilities come from the rank that samples (under pp=2 the last stage) to rank 0
        pairs = run(collect(client, PROMPTS[1], SamplingParams(max_tokens=4, logprobs=True)))
        tokens = [t for t, _ in pairs]
        assert tokens == hf_greedy(old, PROMPTS[1], 4)
        with torch.no_grad():
            logits = old(torch.tensor([PROMPTS[1] + tokens])).logits[0, len(PROMPTS[1]) - 1:-1]
        want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([lp for _, lp in pairs]), want, atol=1e-4)
        triples = run(collect(client, PROMPTS[1], SamplingParams(max_tokens=4, logprobs=True, top_logprobs=2)))
        assert [t for t, _, _ in triples] == tokens and [top[0][0] for _, _, top in triples] == tokens
        assert torch.allclose(torch.tensor([top[0][1] for _, _, top in triples], dtype=torch.float64), want.double(), atol=1e-4)
        # a scored prompt: every position's logits on the head's rank (under pp=2 the last stage), sent to rank 0
        scored = run(collect(client, PROMPTS[2], SamplingParams(max_tokens=2, prompt_logprobs=2)))
        check_prompt_scores(old, PROMPTS[2], 2, scored[0])
        assert scored[1:] == hf_greedy(old, PROMPTS[2], 2)
        # weights that do not fit are refused by the rank that checks them; nothing is swapped anywhere
        partial_state = {k: v for k, v in from_hf_state_dict(new.state_dict()).items() if not k.startswith("blocks.3.")}
        with pytest.raises(ValueError, match="lack"):
            client.update_weights(partial_state)
        assert run(collect(client, PROMPTS[2], SamplingParams(max_tokens=8))) == hf_greedy(old, PROMPTS[2], 8)
        # swap on every rank (each keeps its own shard), between two steps
        client.update_weights(from_hf_state_dict(new.state_dict()))
        assert run(collect(client, PROMPTS[2], SamplingParams(max_tokens=8))) == hf_greedy(new, PROMPTS[2], 8)


@pytest.mark.timeout(180)
def test_builtin_gpt_under_tensor_parallel(procs: Any) -> None:
    from actormesh.parallel.models import gpt

    model_fn = partial(gpt, vocab_size=64, d_model=32, n_heads=4, n_blocks=2, seq_len=32)
    torch.manual_seed(0)
    model = model_fn().eval()
    expect = []
    for prompt in PROMPTS:  # greedy without a cache, in this process
        seq = [t % 64 for t in prompt]
        with torch.no_grad():
            for _ in range(10):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        expect.append(seq[len(prompt):])
    server = spawn_llm_server(procs, model_fn, Plan(tp=2), timeout=120)
    try:
        with LLMServerClient(server) as client:
            assert client.max_context == 32
            async def all_at_once() -> list[list[int]]:
                params = SamplingParams(max_tokens=10)
                return list(await asyncio.gather(*[collect(client, [t % 64 for t in p], params) for p in PROMPTS]))

            assert run(all_at_once()) == expect
    finally:
        server.stop().get(timeout=T)


@pytest.mark.timeout(120)
def test_one_proc_replica_errors_cancellation_and_swap_from_a_path(procs: Any, tmp_path: Any) -> None:
    old, new = hf_model(0), hf_model(1)
    path = tmp_path / "weights.pt"
    torch.save(new.state_dict(), path)  # HF names: converted on load
    with replica(procs.slice(gpus=0), Plan(), max_slots=1) as client:
        assert client.max_context == 64
        with pytest.raises(ValueError, match="over the model's context of 64"):
            client.generate(list(range(60)), SamplingParams(max_tokens=8))
        with pytest.raises(ValueError, match="over the model's context"):  # the replica checks too
            client.driver.generate.call_one("x", list(range(70)), SamplingParams(), None).get(timeout=T)

        async def cancel_then_next() -> list[int]:
            stream = client.generate(PROMPTS[0], SamplingParams(max_tokens=50))
            assert [await stream.__anext__() for _ in range(2)]
            await stream.aclose()  # frees the only slot
            return await collect(client, PROMPTS[1], SamplingParams(max_tokens=5))

        assert run(cancel_then_next()) == hf_greedy(old, PROMPTS[1], 5)
        stats = client.stats()
        assert stats["free_slots"] == 1 and stats["tokens_generated"] < 50

        async def swap_while_streaming() -> list[int]:
            stream = client.generate(PROMPTS[2], SamplingParams(max_tokens=30))
            got = [await stream.__anext__()]
            await asyncio.to_thread(client.update_weights, str(path))
            return got + [t async for t in stream]

        assert len(run(swap_while_streaming())) == 30  # the request in flight is not lost
        assert run(collect(client, PROMPTS[0], SamplingParams(max_tokens=8))) == hf_greedy(new, PROMPTS[0], 8)


def test_plans_that_do_not_fit_a_replica_are_refused(procs: Any) -> None:
    with pytest.raises(PlanError, match="several replicas"):
        spawn_llm_server(procs, MODEL, Plan(dp=2), timeout=T)
    with pytest.raises(PlanError, match="needs dp\\*fsdp\\*tp\\*pp"):
        spawn_llm_server(procs, MODEL, Plan(tp=4), timeout=T)


@pytest.mark.timeout(120)
def test_a_dead_replica_fails_its_streams_at_once(spawn_procs: Any) -> None:
    procs = spawn_procs(per_host={"gpus": 1})
    server = spawn_llm_server(procs, MODEL, Plan(), timeout=120)
    client = LLMServerClient(server, token_timeout_s=T)
    pid = client.driver.info.call_one().get(timeout=T)["pid"]

    async def main() -> None:
        stream = client.generate(PROMPTS[0], SamplingParams(max_tokens=60 - len(PROMPTS[0])))
        await stream.__anext__()
        os.kill(pid, signal.SIGKILL)
        async for _ in stream:
            pass

    with pytest.raises(Exception) as info:
        run(main())
    client.close()
    assert not isinstance(info.value, (TimeoutError, asyncio.TimeoutError)), info.value


@pytest.mark.timeout(120)
def test_requests_started_together_join_one_step_and_fail_alone(procs: Any) -> None:
    from actormesh.runtime import Channel

    old = hf_model(0)
    with replica(procs.slice(gpus=0), Plan(), max_slots=4) as client:
        async def together() -> list[list[int]]:
            return list(await asyncio.gather(*[collect(client, p, SamplingParams(max_tokens=6)) for p in PROMPTS]))

        before = client.stats()["steps"]
        assert run(together()) == [hf_greedy(old, p, 6) for p in PROMPTS]
        assert client.stats()["steps"] - before == 6  # one message: all four joined the first step
        # a bad prompt among requests sent together fails that request only
        port, receiver = Channel.open()
        params = SamplingParams(max_tokens=3)
        call = client.driver.generate_many.call_one([("good", PROMPTS[0], params), ("bad", list(range(70)), params)], port)
        items: list[Any] = []
        while not any(rid == "good" and kind == "end" for rid, kind, _ in items):
            items += receiver.recv().get(timeout=T)
        call.get(timeout=T)
        receiver.close()
        [(kind, error)] = [(kind, value) for rid, kind, value in items if rid == "bad"]
        assert kind == "failed" and isinstance(error, ValueError) and "context" in str(error)
        assert [v for rid, kind, v in items if rid == "good" and kind == "token"] == hf_greedy(old, PROMPTS[0], 3)
