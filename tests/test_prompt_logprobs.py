"""Scoring a prompt (``SamplingParams.prompt_logprobs``): each prompt token's log-probability
given the tokens before it, and each position's most probable tokens, checked against the
model's own full forward. One process; tensor and pipeline parallel replicas are checked in
tests/test_generate_procs.py, the HTTP shape (``echo`` with ``logprobs``) in
tests/test_serve_openai_options.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from actormesh.serve import LLMEngine, PromptLogprobs, SamplingParams  # noqa: E402
from test_generate import hf_pair  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [100, 50, 20, 10, 11, 12, 13], [42]]


@pytest.fixture(scope="module")
def llama() -> tuple[Any, Any]:
    return hf_pair()


def want_scores(hf: Any, prompt: list[int], k: int) -> tuple[Any, Any, Any]:
    """The reference: log-softmax of the model's logits over the whole prompt, no cache."""
    with torch.no_grad():
        scores = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    chosen = scores.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    values, ids = scores.topk(k, -1) if k else (None, None)
    return chosen, ids, values


def check(hf: Any, prompt: list[int], k: int, scored: PromptLogprobs) -> None:
    tokens = scored.tokens
    assert [t for t, _, _ in tokens] == prompt
    assert tokens[0] == (prompt[0], None, ())  # nothing predicts the first token
    chosen, ids, values = want_scores(hf, prompt, k)
    assert torch.allclose(torch.tensor([lp for _, lp, _ in tokens[1:]], dtype=torch.float64), chosen.double(), atol=1e-4)
    if not k:
        assert all(top == () for _, _, top in tokens)
        return
    assert [[i for i, _ in top] for _, _, top in tokens[1:]] == ids.tolist()
    assert torch.allclose(torch.tensor([[lp for _, lp in top] for _, _, top in tokens[1:]], dtype=torch.float64),
                          values.double(), atol=1e-4)


async def stream(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[Any]:
    return [item async for item in engine.generate(prompt, params)]


def test_prompt_scores_are_the_models_log_softmax_beside_requests_that_ask_none(llama: tuple[Any, Any]) -> None:
    hf, model = llama
    with LLMEngine(model, max_slots=4, seed=0) as engine:
        plain = [asyncio.run(stream(engine, p, SamplingParams(max_tokens=4))) for p in PROMPTS]

        async def together() -> list[list[Any]]:  # one step: scored and plain prefills, one decode pass
            params = [SamplingParams(max_tokens=4, prompt_logprobs=3), SamplingParams(max_tokens=4),
                      SamplingParams(max_tokens=4, prompt_logprobs=0), SamplingParams(max_tokens=4, prompt_logprobs=2)]
            return list(await asyncio.gather(*(stream(engine, p, q) for p, q in zip(PROMPTS, params))))

        outs = asyncio.run(together())
    check(hf, PROMPTS[0], 3, outs[0][0])
    check(hf, PROMPTS[2], 0, outs[2][0])
    assert outs[3][0] == PromptLogprobs(((42, None, ()),))  # a one-token prompt: nothing to score
    assert not any(isinstance(item, PromptLogprobs) for item in outs[1])
    # the prompt's scores come first, once; the new tokens are those of the same request unscored
    assert [o[1:] if isinstance(o[0], PromptLogprobs) else o for o in outs] == plain


def test_prompt_scores_come_before_scored_tokens_and_complete_skips_them(llama: tuple[Any, Any]) -> None:
    hf, model = llama
    with LLMEngine(model, max_slots=2, seed=0) as engine:
        items = asyncio.run(stream(engine, PROMPTS[2], SamplingParams(max_tokens=3, logprobs=True, top_logprobs=2,
                                                                      prompt_logprobs=1)))
        done = engine.complete([PROMPTS[1]], SamplingParams(max_tokens=3, prompt_logprobs=1))
    check(hf, PROMPTS[2], 1, items[0])
    assert [len(item) for item in items[1:]] == [3, 3, 3]  # (token, logprob, top) triples follow
    assert len(done[0]) == 3  # complete() gives the new tokens only


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


class NoScores:
    """A backend that samples but cannot score prompts (a user's own EngineBackend)."""

    max_context = 64
    vocab_size = 128

    def run(self, plan: Any) -> list[int]:
        return [7] * len(plan.slots)

    def idle(self) -> None:
        pass

    def swap(self, weights: Any) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_backend_that_cannot_score_refuses_at_the_call_and_serves_on() -> None:
    with LLMEngine(backend=NoScores(), max_slots=2) as engine:
        with pytest.raises(ValueError, match="does not score prompts"):
            engine.generate([1, 2, 3], SamplingParams(max_tokens=2, prompt_logprobs=1))
        assert asyncio.run(stream(engine, [1, 2, 3], SamplingParams(max_tokens=2))) == [7, 7]


def test_a_prompt_whose_logits_would_not_fit_is_refused_at_the_call(monkeypatch: pytest.MonkeyPatch,
                                                                     llama: tuple[Any, Any]) -> None:
    from actormesh.serve import _engine

    monkeypatch.setattr(_engine, "MAX_PROMPT_SCORE_BYTES", 4 * 128 * 6)  # 6 positions of a 128-token vocabulary
    with LLMEngine(llama[1], max_slots=1) as engine:
        with pytest.raises(ValueError, match="7 tokens over a vocabulary of 128"):
            engine.generate(PROMPTS[2], SamplingParams(prompt_logprobs=0))
        assert isinstance(asyncio.run(stream(engine, PROMPTS[0], SamplingParams(max_tokens=1, prompt_logprobs=0)))[0],
                          PromptLogprobs)


def test_a_step_without_the_scores_it_asked_for_fails_that_request_only() -> None:
    from actormesh.serve._scheduler import Request, Scheduler

    sched = Scheduler(max_slots=2, max_context=64, seed=0)
    got: dict[str, list[Any]] = {"a": [], "b": []}
    sched.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=2, prompt_logprobs=0), got["a"].append))
    sched.add(Request("b", [4, 5], SamplingParams(max_tokens=2), got["b"].append))
    plan = sched.plan()
    assert plan is not None and plan.prompt_logprobs == {0: 0}
    events = sched.commit(plan, [9, 9], prompts=None)
    assert [(r.id, type(e.error).__name__ if e.error else e.token) for r, e in events] == [("a", "RuntimeError"), ("b", 9)]
    assert list(sched.running) != [] and all(r.id == "b" for r in sched.running.values())
