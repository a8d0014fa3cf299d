"""End to end: a tiny Llama directory served by ``serve_openai`` (a Service of
LLMServer replicas on real procs) and queried with the official ``openai`` client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import wait_for

from actormesh.serve import serve_openai
from actormesh.serve.tiny import make_tiny_llama

pytestmark = pytest.mark.timeout(240)
MODEL = "tiny"
MAX_SLOTS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / MODEL)


@pytest.fixture(scope="module")
def deployment(model_dir: Path) -> Iterator[Any]:
    dep = serve_openai(model_dir, replicas=1, tp=1, port=0, max_slots=MAX_SLOTS, block=False, ready_timeout_s=180)
    try:
        yield dep
    finally:
        dep.stop()


@pytest.fixture
def client(deployment: Any) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=deployment.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def engine_stats(deployment: Any) -> dict[str, int]:
    (replica,) = deployment.llm.service.replicas()
    infos = replica.mesh.info.call().get(timeout=60).values()
    return next(i["stats"] for i in infos if i["rank"] == 0)


def test_greedy_completion_is_hf_generate(client: openai.OpenAI, model_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf = LlamaForCausalLM.from_pretrained(str(model_dir)).eval()
    prompt = tok.encode("hello world")
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    want = out[0, len(prompt):].tolist()
    got = client.completions.create(model=MODEL, prompt="hello world", max_tokens=10, temperature=0)
    assert got.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert got.usage is not None and got.usage.completion_tokens == len(want)
    # vLLM's repetition_penalty (in extra_body) is HF's too, through the whole stack
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, repetition_penalty=1.8)
    penalized = out[0, len(prompt):].tolist()
    got = client.completions.create(model=MODEL, prompt="hello world", max_tokens=10, temperature=0,
                                    extra_body={"repetition_penalty": 1.8})
    assert got.choices[0].text == tok.decode(penalized, skip_special_tokens=True) and penalized != want


def test_echo_with_logprobs_scores_the_prompt_as_the_model_does(client: openai.OpenAI, model_dir: Path) -> None:
    """lm-eval's loglikelihood request through the whole stack (HTTP, service, replica proc)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf = LlamaForCausalLM.from_pretrained(str(model_dir)).eval()
    prompt = tok.encode("hello world, actors")
    with torch.no_grad():
        scores = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    want = scores.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = got.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(prompt)] == pytest.approx(want, abs=1e-4)
    assert all(len(top) in (1, 2) for top in lp.top_logprobs[1:])  # the chosen token and the most probable one
    alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    assert alone.choices[0].logprobs is not None and alone.usage is not None and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:len(prompt)], abs=1e-6)


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hello actors"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_errors_through_the_real_stack(client: openai.OpenAI, deployment: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=500)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hello")
    assert httpx.get(deployment.url + "/health", timeout=30).json() == {"status": "ok"}


def test_disconnect_mid_stream_frees_the_slot(client: openai.OpenAI, deployment: Any) -> None:
    n = 100
    full = client.completions.create(model=MODEL, prompt="the quick", max_tokens=n, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length"  # so a whole run is exactly n tokens
    before = engine_stats(deployment)["tokens_generated"]
    body = {"model": MODEL, "prompt": "the quick", "max_tokens": n, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=deployment.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        assert json.loads(next(lines)[6:])["choices"][0]["text"] is not None
    wait_for(lambda: engine_stats(deployment)["free_slots"] == MAX_SLOTS, timeout=60)
    assert engine_stats(deployment)["tokens_generated"] - before < n


@pytest.mark.timeout(300)
def test_command_line(model_dir: Path) -> None:
    cmd = [sys.executable, "-m", "actormesh.serve", "--model", str(model_dir), "--port", "0", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        assert proc.stderr is not None
        for line in proc.stderr:  # ends if the process dies
            if line.startswith("actormesh: serving"):
                url = line.split(" at ")[1].split()[0]
                break
        assert url is not None, f"the server did not come up (exit {proc.poll()})"
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in c.models.list().data] == [MODEL]
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=3).choices[0].text is not None
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) in (0, 130, -signal.SIGINT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_request_larger_than_the_server_is_400(client: openai.OpenAI, deployment: Any) -> None:
    limit = deployment.llm.max_sequences
    assert limit == MAX_SLOTS + 64  # one replica: its batch slots and its queue (Service's default max_queue)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=["a"] * (limit // 16 + 1), n=16, max_tokens=1)
    assert info.value.param == "n" and f"at most {limit}" in info.value.message
