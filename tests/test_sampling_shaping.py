"""Penalties and logit bias (``SamplingParams.presence_penalty``, ``frequency_penalty``,
``logit_bias``) and vLLM's ``repetition_penalty``, ``min_tokens`` and ``min_p``: the
sampler's rules on made-up logits, then an engine over a tiny Llama."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from actormesh.parallel import Sampler, Shaping, StepPlan, sample_token  # noqa: E402
from actormesh.serve import LLMEngine, SamplingParams  # noqa: E402


def greedy_steps(sampler: Sampler, logits: list[float], shaping: Shaping | None, steps: int) -> list[int]:
    """Tokens a one-row greedy request in slot 0 picks from the same ``logits`` each step."""
    out = []
    for step in range(steps):
        plan = StepPlan(slots=[0], tokens=[[1]], starts=[step], sampling=[(0.0, 0, 1.0, 0.0)])
        if step == 0:
            plan.seeds[0] = 7
            if shaping is not None:
                plan.shaping[0] = shaping
        out += sampler.sample(torch.tensor([logits]), plan, [0])
    return out


def test_frequency_penalty_counts_every_time_presence_penalty_once() -> None:
    s = Sampler()
    assert greedy_steps(s, [1.0, 0.9, 0.0], Shaping(frequency_penalty=2.0), 5) == [0, 1, 2, 0, 1]
    # 1.0 vs 0.8: after one 0 the penalty makes 1 win once; then both were seen, and 0 wins again for good
    assert greedy_steps(s, [1.0, 0.8], Shaping(presence_penalty=0.5), 4) == [0, 1, 0, 0]
    assert greedy_steps(s, [1.0, 0.8], Shaping(presence_penalty=-1.0), 3) == [0, 0, 0]  # negative: repeats


def test_logit_bias_and_a_new_request_in_the_slot_starts_clean() -> None:
    s = Sampler()
    assert greedy_steps(s, [1.0, 0.0, 0.5], Shaping(logit_bias=((2, 100.0),)), 2) == [2, 2]
    assert greedy_steps(s, [1.0, 0.0, 0.5], Shaping(logit_bias=((0, -100.0),)), 1) == [2]
    assert greedy_steps(s, [1.0, 0.0, 0.5], None, 2) == [0, 0]  # no shaping left from the last request
    # a row with shaping beside one without: each gets its own
    plan = StepPlan(slots=[0, 1], tokens=[[1], [1]], starts=[0, 0], sampling=[(0.0, 0, 1.0, 0.0)] * 2,
                    seeds={0: 1, 1: 2}, shaping={1: Shaping(logit_bias=((1, 50.0),))})
    assert s.sample(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), plan, [0, 1]) == [0, 1]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    # generated so far: 0 (2.0 -> 1.0) loses to 1 (1.5), then 1 (1.5 -> 0.75) and 2 (0.9) lose to 0 (1.0)
    assert greedy_steps(Sampler(), [2.0, 1.5, 0.9], Shaping(repetition_penalty=2.0), 3) == [0, 1, 0]
    # the prompt counts too, and a negative logit is made more negative
    assert greedy_steps(Sampler(), [2.0, 1.5], Shaping(repetition_penalty=2.0, context=(0,)), 1) == [1]
    assert greedy_steps(Sampler(), [-0.5, -0.6], Shaping(repetition_penalty=2.0, context=(0,)), 1) == [1]


def test_min_tokens_bans_the_stop_ids_until_enough_are_generated() -> None:
    shaping = Shaping(min_tokens=2, stop_ids=(0,))
    assert greedy_steps(Sampler(), [1.0, 0.5], shaping, 4) == [1, 1, 0, 0]


def test_min_p_drops_the_tokens_less_probable_than_its_share_of_the_top_one() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    gen = torch.Generator().manual_seed(0)
    kept = {sample_token(logits, 1.0, 0, 1.0, gen, min_p=0.5) for _ in range(300)}  # 0.2 < 0.5 * 0.5
    assert kept == {0, 1}
    assert {sample_token(logits, 1.0, 0, 1.0, gen) for _ in range(300)} == {0, 1, 2}


@pytest.mark.parametrize("kwargs, says", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"logit_bias": {-1: 1.0}}, "token ids"),
    ({"logit_bias": {3: 200}}, r"\[-100, 100\]"),
    ({"logit_bias": [3]}, "mapping"),
    # each of these, once in a batch, failed the step of every request beside it, or the engine
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"top_k": 1.5}, "top_k must be an int"),
    ({"stop_token_ids": "ab"}, "stop_token_ids must be a sequence"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids entries"),
    ({"max_tokens": True}, "max_tokens must be an int"),
    ({"logprobs": "yes"}, "logprobs must be True or False"),
    ({"seed": 2**64}, "seed must be None or an int"),
    ({"seed": 1.0}, "seed must be None or an int"),
    ({"min_p": 1.5}, "min_p must be a number in"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_tokens": 20}, r"min_tokens must be an int in \[0, 16\]"),
])
def test_bad_values_are_refused(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        SamplingParams(**kwargs)


def test_stop_ids_of_any_sequence_are_kept_as_a_tuple() -> None:
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=range(2)).stop_token_ids == (0, 1)


def test_a_temperature_too_small_to_divide_by_picks_greedily_beside_other_requests() -> None:
    from test_generate import PROMPTS, hf_pair

    _, model = hf_pair()
    greedy = SamplingParams(max_tokens=6)
    tiny = [SamplingParams(max_tokens=6, temperature=t, top_p=0.5, seed=1) for t in (1e-45, 1e-6)]
    with LLMEngine(model, max_slots=4, seed=0) as eng:
        # logits / 1e-45 overflow to inf, and softmax of them is NaN: the step failed for every row
        out = eng.complete([PROMPTS[0]] * 3, [greedy, *tiny])
    assert out[1] == out[2] == out[0]


def test_an_engines_repetition_penalty_is_hf_generates_and_min_tokens_holds_off_a_stop() -> None:
    from test_generate import PROMPTS, hf_pair

    hf, model = hf_pair()
    ids = torch.tensor([PROMPTS[2]])
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10, eos_token_id=None,
                       pad_token_id=0, repetition_penalty=1.8)[0, len(PROMPTS[2]):].tolist()
    with LLMEngine(model, max_slots=4, seed=0) as eng:
        plain = eng.complete([PROMPTS[2]], SamplingParams(max_tokens=10))[0]
        assert eng.complete([PROMPTS[2]], SamplingParams(max_tokens=10, repetition_penalty=1.8)) == [want]
        assert want != plain, "the penalty changed the greedy tokens"
        first = plain[0]  # a stop on the first greedy token ends the request before any token...
        assert eng.complete([PROMPTS[2]], SamplingParams(max_tokens=10, stop_token_ids=[first])) == [[]]
        held = eng.complete([PROMPTS[2]], SamplingParams(max_tokens=10, stop_token_ids=[first], min_tokens=3))[0]
        assert len(held) >= 3 and first not in held[:3]  # ...unless min_tokens holds it off


def test_an_engine_applies_them_and_reports_the_models_own_logprobs() -> None:
    from test_generate import hf_pair

    hf, model = hf_pair()
    prompt = [5, 9, 13, 2]

    async def run(engine: Any, params: SamplingParams) -> list[Any]:
        return [t async for t in engine.generate(prompt, params)]

    with LLMEngine(model, max_slots=2, seed=0) as engine:
        plain = asyncio.run(run(engine, SamplingParams(max_tokens=6)))
        forced = asyncio.run(run(engine, SamplingParams(max_tokens=6, logit_bias={17: 100.0}, logprobs=True)))
        assert [t for t, _ in forced] == [17] * 6
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + [17] * 6])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits.float(), -1)[:, 17]
        assert torch.allclose(torch.tensor([lp for _, lp in forced]), want, atol=1e-4)  # the bias is not in them
        banned = asyncio.run(run(engine, SamplingParams(max_tokens=6, logit_bias={plain[0]: -100.0})))
        assert banned[0] != plain[0]
        looping = asyncio.run(run(engine, SamplingParams(max_tokens=24)))
        spread = asyncio.run(run(engine, SamplingParams(max_tokens=24, frequency_penalty=2.0)))
        assert len(set(spread)) > len(set(looping))  # greedy repeats itself; the penalty moves it on
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            asyncio.run(run(engine, SamplingParams(max_tokens=2, logit_bias={10**6: 1.0})))
