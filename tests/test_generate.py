"""Generation in one process: KV cache, sampling, continuous batching (actormesh.serve.LLMEngine).

Tiny models with random weights from a fixed seed, nothing downloaded. Greedy
output is compared token for token with Hugging Face ``generate(do_sample=False)``
on the same weights, each prompt alone.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from actormesh.parallel import KVCache, StepPlan, StepRunner, sample_token  # noqa: E402
from actormesh.parallel.hf import from_hf_state_dict, hf_causal_lm  # noqa: E402
from actormesh.parallel.models import gpt  # noqa: E402
from actormesh.serve import EngineClosedError, LLMEngine, SamplingParams, TokenGenerator  # noqa: E402

LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [100, 50, 20, 10, 11, 12, 13], [42]]
GREEDY = SamplingParams(max_tokens=12)


def hf_pair(name: str = "Llama", seed: int = 0, **extra: Any) -> tuple[Any, Any]:
    """A HF model and our adapter of it, same weights."""
    config = getattr(transformers, f"{name}Config")(**LLAMA, **extra)
    torch.manual_seed(seed)
    hf = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    torch.manual_seed(seed)
    return hf, hf_causal_lm(config, f"{name}ForCausalLM")


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def no_cache_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """The reference without a KV cache: the whole sequence through ``forward`` every step."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


async def collect(gen: TokenGenerator, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t async for t in gen.generate(prompt, params)]


@pytest.fixture(scope="module")
def llama() -> tuple[Any, Any]:
    return hf_pair()


@pytest.fixture
def engine(llama: tuple[Any, Any]) -> Any:
    with LLMEngine(llama[1], max_slots=4, seed=0) as eng:
        yield eng


# ------------------------------------------------------------------ greedy = HF


@pytest.mark.parametrize("name, extra", [("Llama", {}), ("Qwen2", {}), ("Qwen3", {"head_dim": 16}),
                                         ("Mistral", {"sliding_window": 4})])
def test_greedy_equals_hf_generate_token_for_token(name: str, extra: dict[str, Any]) -> None:
    hf, model = hf_pair(name, **extra)
    refs = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    with LLMEngine(model, max_slots=4) as engine:
        assert isinstance(engine, TokenGenerator)
        # all four prompts in one batch: different lengths, one padded prefill, then batched decode
        assert engine.complete(PROMPTS, GREEDY) == refs


@pytest.mark.parametrize("name, extra", [("Llama", {}), ("Qwen2", {}), ("Qwen3", {"head_dim": 16}),
                                         ("Mistral", {"sliding_window": 4})])
def test_fused_layers_give_the_hf_layers_values_bit_for_bit(name: str, extra: dict[str, Any]) -> None:
    """The direct path (fused projections, one rotary pass) computes exactly what each HF layer computes."""
    from actormesh.parallel._fused import FusedDecoder, can_fuse

    model = hf_pair(name, **extra)[1].eval()
    fused = FusedDecoder()
    torch.manual_seed(1)
    cases = [(torch.arange(3), torch.tensor([[0, 1, 2, 3, 4]] * 3), False),  # a prefill, masked
             (torch.arange(4), torch.tensor([[7], [3], [9], [5]]), False),  # ragged decode
             (torch.tensor([1, 3]), torch.tensor([[6], [6]]), True)]  # uniform decode, no mask
    with torch.no_grad():
        for block in model.blocks:
            assert can_fuse(block)
            for slots, positions, uniform in cases:
                x = torch.randn(*positions.shape, LLAMA["hidden_size"])
                ours, theirs = KVCache(4, 16, model.sliding_window), KVCache(4, 16, model.sliding_window)
                pe = model.rotary_emb(x, positions)
                kind = model.layer_types[block.self_attn.layer_idx]
                out = []
                for cache in (ours, theirs):
                    cache.bind(slots, positions, uniform)
                mask = model._cache_mask(ours, kind)
                got = fused.block(block, x, FusedDecoder.rotary(pe), mask, ours)
                want = block(x, attention_mask=mask, position_ids=positions, past_key_values=theirs, position_embeddings=pe)
                assert torch.equal(got, want)
                out.append(got)
                idx = block.self_attn.layer_idx
                assert torch.equal(ours.keys[idx], theirs.keys[idx]) and torch.equal(ours.values[idx], theirs.values[idx])
            # weights written in place (a swap) reach the fused projections
            block.self_attn.k_proj.weight.data.mul_(1.5)
            block.mlp.up_proj.weight.data.add_(0.01)
            x = torch.randn(2, 1, LLAMA["hidden_size"])
            positions = torch.tensor([[2], [2]])
            caches = [KVCache(2, 8), KVCache(2, 8)]
            for cache in caches:
                cache.bind(torch.arange(2), positions, True)
            pe = model.rotary_emb(x, positions)
            assert torch.equal(fused.block(block, x, FusedDecoder.rotary(pe), None, caches[0]),
                               block(x, attention_mask=None, position_ids=positions, past_key_values=caches[1],
                                     position_embeddings=pe))


def test_layers_with_hooks_or_other_attention_are_not_fused() -> None:
    from actormesh.parallel._fused import can_fuse

    model = hf_pair()[1].eval()
    block = model.blocks[0]
    handle = block.mlp.register_forward_hook(lambda *a: None)
    assert not can_fuse(block)  # the hook must run: HF's own forward does
    handle.remove()
    assert can_fuse(block)
    eager = hf_causal_lm(transformers.LlamaConfig(**LLAMA), "LlamaForCausalLM", attn_implementation="eager").eval()
    assert not can_fuse(eager.blocks[0])
    model.train()
    assert not can_fuse(block)  # dropout and the like are the layer's business
    assert not can_fuse(gpt().blocks[0])


def test_kv_cache_matches_full_recompute_for_the_builtin_gpt() -> None:
    torch.manual_seed(3)
    model = gpt(vocab_size=64, d_model=32, n_heads=4, n_blocks=2, seq_len=32).eval()
    prompts = [[1, 2, 3, 4], [9], [60, 61, 62]]
    with LLMEngine(model, max_slots=2) as engine:
        assert engine.complete(prompts, SamplingParams(max_tokens=10)) == [no_cache_greedy(model, p, 10) for p in prompts]


def test_step_runner_writes_each_slot_at_its_own_positions(llama: tuple[Any, Any]) -> None:
    hf, model = llama
    runner = StepRunner(model, KVCache(max_slots=3, max_len=32), torch.device("cpu"))
    greedy = (0.0, 0, 1.0, 0.0)
    # slot 2 prefills while slot 0 (prefilled one step earlier) decodes
    first = runner.run(StepPlan(slots=[0], tokens=[PROMPTS[0]], starts=[0], sampling=[greedy]))
    both = runner.run(StepPlan(slots=[0, 2], tokens=[first, PROMPTS[1]], starts=[5, 0], sampling=[greedy, greedy]))
    assert [first[0], both[0]] == hf_greedy(hf, PROMPTS[0], 2)
    assert both[1] == hf_greedy(hf, PROMPTS[1], 1)[0]


# --------------------------------------------------------- batching and limits


def test_requests_joining_mid_run_get_the_same_tokens_as_alone(llama: tuple[Any, Any], engine: LLMEngine) -> None:
    hf = llama[0]
    long = SamplingParams(max_tokens=30)
    refs = [hf_greedy(hf, PROMPTS[0], 30)] + [hf_greedy(hf, p, 12) for p in PROMPTS[1:]]

    async def main() -> list[list[int]]:
        first = engine.generate(PROMPTS[0], long)
        got = [await first.__anext__() for _ in range(5)]  # running alone for 5 steps
        later = [asyncio.ensure_future(collect(engine, p, GREEDY)) for p in PROMPTS[1:]]
        got += [t async for t in first]
        return [got] + list(await asyncio.gather(*later))

    assert asyncio.run(asyncio.wait_for(main(), 60)) == refs


def test_more_requests_than_slots_wait_for_a_free_slot(llama: tuple[Any, Any]) -> None:
    hf, model = llama
    prompts = [[i + 1, i + 2] for i in range(7)]
    with LLMEngine(model, max_slots=2) as engine:
        assert engine.complete(prompts, SamplingParams(max_tokens=4)) == [hf_greedy(hf, p, 4) for p in prompts]
        assert engine.stats()["free_slots"] == 2


def test_stop_tokens_end_the_request_and_are_not_emitted(llama: tuple[Any, Any], engine: LLMEngine) -> None:
    ref = hf_greedy(llama[0], PROMPTS[2], 12)
    stop = ref[4]
    expect = ref[: ref.index(stop)]
    assert engine.complete([PROMPTS[2]], SamplingParams(max_tokens=12, stop_token_ids=(stop,))) == [expect]


def test_max_tokens_is_exact(engine: LLMEngine) -> None:
    out = engine.complete(PROMPTS, [SamplingParams(max_tokens=n) for n in (1, 2, 7, 13)])
    assert [len(o) for o in out] == [1, 2, 7, 13]


def test_prompt_over_the_context_is_refused_at_the_call(engine: LLMEngine) -> None:
    assert engine.max_context == 64
    with pytest.raises(ValueError, match="over the model's context of 64 tokens"):
        engine.generate(list(range(60)), SamplingParams(max_tokens=5))  # raises before any await
    with pytest.raises(ValueError, match="over the model's context"):
        engine.complete([[1] * 70], GREEDY)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([], GREEDY)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.generate([1, 500], GREEDY)
    assert engine.complete([list(range(52))], GREEDY)[0]  # exactly at the limit is fine


def test_cancelling_frees_the_slot(llama: tuple[Any, Any]) -> None:
    async def main(eng: LLMEngine) -> list[int]:
        stream = eng.generate(PROMPTS[0], SamplingParams(max_tokens=50))
        assert [await stream.__anext__() for _ in range(2)]
        await stream.aclose()  # cancel: the only slot must be free for the next request
        return await collect(eng, PROMPTS[1], SamplingParams(max_tokens=5))

    with LLMEngine(llama[1], max_slots=1) as eng:
        assert len(asyncio.run(asyncio.wait_for(main(eng), 60))) == 5
        stats = eng.stats()
        assert stats["free_slots"] == 1 and stats["running"] == 0
        assert stats["tokens_generated"] < 50  # the cancelled request did not run to its end


def test_closing_the_engine_fails_waiting_requests() -> None:
    torch.manual_seed(0)
    engine = LLMEngine(gpt(), max_slots=1)
    engine.close()
    with pytest.raises(EngineClosedError):
        engine.complete([[1, 2]], SamplingParams(max_tokens=2))


# ------------------------------------------------------------------- sampling


def test_sampling_is_reproducible_with_a_seed(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7)
    a = engine.complete([PROMPTS[0]], params)[0]
    # the same seed in a different batch (other requests beside it) gives the same tokens
    b = engine.complete([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [GREEDY, params, SamplingParams(max_tokens=5, temperature=2.0)])[1]
    c = engine.complete([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=1.0, seed=8))[0]
    assert a == b and a != c


def test_top_k_one_is_greedy(llama: tuple[Any, Any], engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=1)
    assert engine.complete([PROMPTS[2]], params) == [hf_greedy(llama[0], PROMPTS[2], 12)]


def test_top_k_and_top_p_filter_the_distribution() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.1, 0.05]))
    draw = lambda **kw: {sample_token(logits, 1.0, generator=gen, **kw) for _ in range(300)}  # noqa: E731
    assert draw(top_k=0, top_p=1.0) == {0, 1, 2, 3, 4}
    assert draw(top_k=2, top_p=1.0) == {1, 2}
    assert draw(top_k=0, top_p=0.75) == {1, 2}   # 0.5 < 0.75: the 0.3 token is needed too
    assert draw(top_k=0, top_p=0.5) == {1}
    assert draw(top_k=3, top_p=0.95) == {1, 2, 3}
    assert sample_token(logits, 0.0, 0, 1.0, gen) == 1


# -------------------------------------------------------------------- weights


def test_weight_swap_keeps_every_request(llama: tuple[Any, Any]) -> None:
    hf_old, model = llama
    hf_new, _ = hf_pair(seed=1)
    new = from_hf_state_dict(hf_new.state_dict())
    prompt = PROMPTS[3]
    with LLMEngine(hf_pair()[1], max_slots=4) as engine:

        async def main() -> tuple[list[int], list[int]]:
            stream = engine.generate(prompt, SamplingParams(max_tokens=20))
            head = [await stream.__anext__() for _ in range(3)]
            await asyncio.to_thread(engine.update_weights, new)  # double buffer: swapped at the next step
            rest = [t async for t in stream]
            return head, rest

        head, rest = asyncio.run(asyncio.wait_for(main(), 60))
        assert len(head + rest) == 20  # not lost, not cut short
        assert head == hf_greedy(hf_old, prompt, 3)
        assert engine.complete(PROMPTS, GREEDY) == [hf_greedy(hf_new, p, GREEDY.max_tokens) for p in PROMPTS]
        with pytest.raises(ValueError, match="lack"):
            engine.update_weights({"embed_tokens.weight": torch.zeros(128, 64)})
        assert engine.complete([prompt], GREEDY) == [hf_greedy(hf_new, prompt, GREEDY.max_tokens)]  # still serving


def test_draining_swap_finishes_running_requests_on_the_old_weights(llama: tuple[Any, Any]) -> None:
    hf_old, _ = llama
    hf_new, _ = hf_pair(seed=2)
    prompt = PROMPTS[0]
    with LLMEngine(hf_pair()[1], max_slots=4) as engine:

        async def main() -> list[int]:
            stream = engine.generate(prompt, SamplingParams(max_tokens=20))
            head = [await stream.__anext__() for _ in range(2)]
            swap = asyncio.ensure_future(asyncio.to_thread(engine.update_weights, hf_new.state_dict(), True))
            rest = [t async for t in stream]
            await swap
            return head + rest

        assert asyncio.run(asyncio.wait_for(main(), 60)) == hf_greedy(hf_old, prompt, 20)
        assert engine.complete([prompt], GREEDY) == [hf_greedy(hf_new, prompt, GREEDY.max_tokens)]


# ------------------------------------------------------------- replica layout


def test_replica_stages_equal_given_or_chosen_for_memory() -> None:
    from actormesh.parallel import Plan, PlanError, replica_stages

    with torch.device("meta"):
        model = gpt(n_blocks=4)
    block_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert replica_stages(model, Plan()) is None
    assert replica_stages(model, Plan(pp=2)) == [range(0, 2), range(2, 4)]
    assert replica_stages(model, Plan(pp=2), [range(0, 3), range(3, 4)]) == [range(0, 3), range(3, 4)]
    assert replica_stages(model, Plan(pp=2), "memory") == [range(0, 2), range(2, 4)]  # equal blocks: balanced
    # a per-stage memory limit of one block leaves three for the second stage
    assert replica_stages(model, Plan(pp=2), "memory", memory_limit_bytes=[block_bytes, 3 * block_bytes]) == \
        [range(0, 1), range(1, 4)]
    with pytest.raises(PlanError, match="'memory'"):
        replica_stages(model, Plan(pp=2), "fastest")
    with pytest.raises(PlanError, match="contiguous"):
        replica_stages(model, Plan(pp=2), [range(0, 1), range(2, 4)])


def test_compiled_engine_equals_hf_generate() -> None:
    """``compile=`` traces the fused decoder path (aot_eager: dynamo's graphs without inductor's slow codegen)."""
    hf, model = hf_pair()
    prompts = PROMPTS[:2]  # ragged: a padded prefill, then decode
    refs = [hf_greedy(hf, p, 4) for p in prompts]
    with LLMEngine(model, max_slots=3, compile="aot_eager") as engine:
        assert engine.complete(prompts, SamplingParams(max_tokens=4)) == refs
        # the short one ends first and leaves a gap between the others' slots: they are read through a copy
        lengths = [2, 6, 6]
        refs = [hf_greedy(hf, p, n) for p, n in zip(PROMPTS[:3], lengths)]

        async def all_three() -> list[list[int]]:
            return list(await asyncio.gather(*[collect(engine, p, SamplingParams(max_tokens=n))
                                               for p, n in zip(PROMPTS[:3], lengths)]))

        assert asyncio.run(all_three()) == refs


def test_logprobs_are_the_models_log_softmax_of_each_sampled_token(llama: tuple[Any, Any], engine: LLMEngine) -> None:
    hf, _ = llama
    prompt = PROMPTS[2]
    for params in (SamplingParams(max_tokens=5, logprobs=True), SamplingParams(max_tokens=5, logprobs=True, temperature=1.0, seed=3)):
        pairs = asyncio.run(collect(engine, prompt, params))
        tokens = [t for t, _ in pairs]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([lp for _, lp in pairs]), want, atol=1e-4)
    # with top_logprobs, each position's most probable tokens too, as the model ranks them
    triples = asyncio.run(collect(engine, prompt, SamplingParams(max_tokens=5, logprobs=True, top_logprobs=3)))
    tokens = [t for t, _, _ in triples]
    with torch.no_grad():
        scores = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float(), -1)
    values, ids = scores.topk(3, -1)
    assert [[i for i, _ in top] for _, _, top in triples] == ids.tolist()
    assert torch.allclose(torch.tensor([[lp for _, lp in top] for _, _, top in triples], dtype=torch.float64), values.double(), atol=1e-4)
    assert [t for t, _, _ in triples] == [top[0][0] for _, _, top in triples]  # greedy: the most probable one
    # a request without logprobs beside one with them streams plain token ids
    plain = asyncio.run(collect(engine, prompt, SamplingParams(max_tokens=5)))
    assert plain == [t for t, _ in asyncio.run(collect(engine, prompt, SamplingParams(max_tokens=5, logprobs=True)))]
