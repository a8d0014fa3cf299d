"""vLLM's offline API (``LLM.generate`` / ``LLM.chat``) over a tiny Llama directory on
real replica procs: HF's greedy text, batches larger than the service, stop strings."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actormesh.serve import LLM, SamplingParams
from actormesh.serve.tiny import make_tiny_llama

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(model_dir, max_slots=4, ready_timeout_s=180) as engine:
        yield engine


def test_greedy_generate_is_hf_generate(llm: LLM, model_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf = LlamaForCausalLM.from_pretrained(str(model_dir)).eval()
    prompts = ["hello world", "the quick brown fox"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10))
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=10, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        want = [t for t in want if t != tok.eos_token_id]
        assert out.prompt == prompt and out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == want
        assert out.outputs[0].text == tok.decode(want, skip_special_tokens=True)
        assert out.outputs[0].finish_reason == ("length" if len(want) == 10 else "stop")


def test_a_batch_larger_than_the_service_runs_whole_and_in_order(llm: LLM) -> None:
    n = llm.service.max_sequences * 3  # every replica slot and queue, three times over
    params = [SamplingParams(max_tokens=2 + i % 3, temperature=1.0, seed=i) for i in range(n)]
    outs = llm.generate([[1 + i % 50, 7] for i in range(n)], params)
    assert [o.prompt_token_ids for o in outs] == [[1 + i % 50, 7] for i in range(n)]
    assert all(len(o.outputs[0].token_ids) <= 2 + i % 3 for i, o in enumerate(outs))
    again = llm.generate([[1 + i % 50, 7] for i in range(10)], params[:10])
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[:10]], "seeded: reproducible"


def test_stop_strings_logprobs_and_chat(llm: LLM) -> None:
    free = llm.generate("hello world", SamplingParams(max_tokens=12, stop_token_ids=[0]))[0].outputs[0]
    cut_at = next(c for c in free.text[2:] if c.strip())  # stop at a character the free text has
    stopped = llm.generate("hello world", SamplingParams(max_tokens=12, stop_token_ids=[0], stop=cut_at))[0].outputs[0]
    assert stopped.finish_reason == "stop" and cut_at not in stopped.text and free.text.startswith(stopped.text)
    scored = llm.generate("hello", SamplingParams(max_tokens=3, logprobs=True))[0].outputs[0]
    assert scored.logprobs is not None and len(scored.logprobs) == len(scored.token_ids)
    assert all(lp is not None and lp <= 0 for lp in scored.logprobs)
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=3))[0]
    rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)


def test_n_sequences_per_prompt_each_with_its_own_seed(llm: LLM) -> None:
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3))
    assert [[c.index for c in o.outputs] for o in outs] == [[0, 1, 2], [0, 1, 2]]
    assert len({c.token_ids for c in outs[0].outputs}) > 1, "three draws, three seeds"
    one = llm.generate("a", SamplingParams(max_tokens=6, temperature=1.0, seed=6))[0].outputs[0]
    assert one.token_ids == outs[0].outputs[1].token_ids, "sequence j draws with seed + j"
    with pytest.raises(ValueError, match="one generation request is one sequence"):
        llm.service.generate([1, 2], SamplingParams(n=2))


def test_bad_input_is_refused_before_anything_runs(llm: LLM) -> Any:
    with pytest.raises(ValueError, match="over the model's context"):
        llm.generate(["fine", "x " * 500], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams()] * 3)
    with pytest.raises(ValueError, match="at least one prompt"):
        llm.generate([])

    async def inside_a_loop() -> None:
        llm.generate("a")

    with pytest.raises(RuntimeError, match="cannot run inside an event loop"):
        asyncio.run(inside_a_loop())
