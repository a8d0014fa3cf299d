"""The OpenAI-compatible HTTP front door, through the official ``openai`` client,
against a scripted TokenGenerator (the engine is tested end to end elsewhere)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import wait_for

from actormesh.errors import SupervisionError
from actormesh.serve import OpenAIServer, SamplingParams, ServiceOverloaded, create_openai_app
from actormesh.serve.tiny import make_tokenizer

MODEL = "tiny-test"
SCRIPT_TEXT = " hello world hello actors hello meshes the quick brown fox"


class ScriptedGenerator:
    """A TokenGenerator that yields a fixed script, and records what it was asked.

    ``mode`` switches behaviour for one test: ``"stall"`` yields two tokens then
    waits forever (until cancelled); ``"eos"`` yields three tokens then EOS;
    ``"fail_first"`` / ``"fail_later"`` raise a SupervisionError before the first
    token / after two.
    """

    max_context = 64

    def __init__(self, script: list[int], eos: int) -> None:
        self.script = script
        self.eos = eos
        self.mode = "normal"
        self.active = 0
        self.closed = 0
        self.calls: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[int]:
        self.calls.append((list(prompt_ids), params))
        self.active += 1
        try:
            if self.mode == "fail_first":
                raise SupervisionError("replica 0 died (test)")
            if self.mode == "overloaded":
                raise ServiceOverloaded("every replica of llm is full (test)")
            for i in range(params.max_tokens):
                if self.mode == "stall" and i == 2:
                    await asyncio.Event().wait()
                if self.mode == "fail_later" and i == 2:
                    raise SupervisionError("replica 0 died (test)")
                if self.mode == "eos" and i == 3:
                    yield self.eos
                    return
                await asyncio.sleep(0)
                yield self.script[i % len(self.script)]
        finally:
            self.active -= 1
            self.closed += 1


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def server(tokenizer: Any) -> Iterator[tuple[OpenAIServer, ScriptedGenerator]]:
    gen = ScriptedGenerator(tokenizer.encode(SCRIPT_TEXT), tokenizer.eos_token_id)
    health = {"ok": True}
    app = create_openai_app(gen, tokenizer, model_name=MODEL, health=lambda: health["ok"])
    app.state.test_health = health
    with OpenAIServer(app, "127.0.0.1", 0) as srv:
        yield srv, gen


@pytest.fixture
def gen(server: tuple[OpenAIServer, ScriptedGenerator]) -> Iterator[ScriptedGenerator]:
    g = server[1]
    g.mode = "normal"
    g.calls.clear()
    yield g
    g.mode = "normal"
    wait_for(lambda: g.active == 0, timeout=20)


@pytest.fixture
def client(server: tuple[OpenAIServer, ScriptedGenerator]) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0, timeout=30)
    yield c
    c.close()


@pytest.fixture
def http(server: tuple[OpenAIServer, ScriptedGenerator]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0].url, timeout=30) as c:
        yield c


def expected(tokenizer: Any, n: int) -> str:
    ids = tokenizer.encode(SCRIPT_TEXT)
    return tokenizer.decode([ids[i % len(ids)] for i in range(n)])


def test_models_list(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_completion(client: openai.OpenAI, gen: ScriptedGenerator, tokenizer: Any) -> None:
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5, temperature=0)
    assert out.choices[0].text == expected(tokenizer, 5)
    assert out.choices[0].finish_reason == "length"
    prompt_ids, params = gen.calls[0]
    assert prompt_ids == tokenizer.encode("hello world")
    assert params.max_tokens == 5 and params.temperature == 0.0
    assert params.stop_token_ids == (tokenizer.eos_token_id,)
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), 5)


def test_completion_defaults_follow_openai(client: openai.OpenAI, gen: ScriptedGenerator) -> None:
    client.completions.create(model=MODEL, prompt="hello")
    params = gen.calls[0][1]
    assert params.max_tokens == 16 and params.temperature == 1.0 and params.top_p == 1.0
    client.completions.create(model=MODEL, prompt="hello", extra_body={"ignore_eos": True, "top_k": 5})
    assert gen.calls[1][1].stop_token_ids == () and gen.calls[1][1].top_k == 5


def test_completion_stream(client: openai.OpenAI, gen: ScriptedGenerator, tokenizer: Any) -> None:
    stream = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=7, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected(tokenizer, 7)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    assert len([c for c in chunks if c.choices]) > 2  # really streamed, not one blob


def test_chat(client: openai.OpenAI, gen: ScriptedGenerator, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, seed=3)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected(tokenizer, 4)
    prompt_ids, params = gen.calls[0]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert params.seed == 3


def test_vllm_sampling_extensions_reach_the_generator(client: openai.OpenAI, gen: ScriptedGenerator,
                                                      tokenizer: Any, http: httpx.Client) -> None:
    extra = {"min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2, "stop_token_ids": [7, 9], "top_k": 5}
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=extra)
    client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={**extra, "ignore_eos": True})
    (_, chat), (_, completion) = gen.calls
    assert (chat.min_p, chat.repetition_penalty, chat.min_tokens, chat.top_k) == (0.1, 1.2, 2, 5)
    assert chat.stop_token_ids == (tokenizer.eos_token_id, 7, 9)  # beside EOS, as in vLLM
    assert completion.stop_token_ids == (7, 9)  # ignore_eos drops EOS only
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "min_tokens": 3})
    assert resp.status_code == 400 and error_of(resp)["param"] == "min_tokens"
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "repetition_penalty": 0})
    assert resp.status_code == 400 and error_of(resp)["param"] == "repetition_penalty"
    assert len(gen.calls) == 2


def test_chat_stream(client: openai.OpenAI, gen: ScriptedGenerator, tokenizer: Any) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=6, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected(tokenizer, 6)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_eos_stops_and_is_not_text(client: openai.OpenAI, gen: ScriptedGenerator, tokenizer: Any) -> None:
    gen.mode = "eos"
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=10)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == expected(tokenizer, 3)


def test_stop_string(client: openai.OpenAI, gen: ScriptedGenerator, tokenizer: Any) -> None:
    full = expected(tokenizer, 12)
    cut = full.index(" actors")
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=12, stop=[" actors", "zzz"])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (full[:cut], "stop")
    stream = client.completions.create(model=MODEL, prompt="x", max_tokens=12, stop=" actors", stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_and_prompt_lists(client: openai.OpenAI, gen: ScriptedGenerator, tokenizer: Any) -> None:
    out = client.completions.create(model=MODEL, prompt=["a", "b c"], n=2, max_tokens=3, seed=10)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.text == expected(tokenizer, 3) for c in out.choices)
    assert sorted(p.seed for _, p in gen.calls) == [10, 10, 11, 11]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=4, stream=True
    )
    texts: dict[int, str] = {}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert texts == {i: expected(tokenizer, 4) for i in range(3)}


def error_of(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def test_bad_json_is_400(http: httpx.Client, gen: ScriptedGenerator) -> None:
    resp = http.post("/v1/completions", content=b'{"model": "tiny-test", "prompt": ', headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert "JSON" in error_of(resp)["message"]
    assert error_of(resp)["type"] == "invalid_request_error"
    resp = http.post("/v1/chat/completions", json={"model": MODEL})
    assert resp.status_code == 400 and error_of(resp)["param"] == "messages"
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_token": 3})
    assert resp.status_code == 400 and "max_token" in error_of(resp)["message"]
    assert gen.calls == []


def test_context_overflow_is_400(client: openai.OpenAI, gen: ScriptedGenerator) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=ScriptedGenerator.max_context)
    assert info.value.code == "context_length_exceeded"
    assert "maximum context length is 64" in info.value.message
    long = " ".join(["hello"] * 80)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}])
    assert gen.calls == []


def test_input_no_engine_could_take_is_400_before_it_runs(http: httpx.Client, gen: ScriptedGenerator) -> None:
    # JSON's "\ud800" escape is a lone surrogate: no tokenizer takes it (it was a 500).
    raw = json.dumps({"model": MODEL, "prompt": ["ok", "\ud800"]})
    resp = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and error_of(resp)["param"] == "prompt" and "Unicode" in error_of(resp)["message"]
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a\udfff"}]})
    resp = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and error_of(resp)["param"] == "messages.0.content"
    # A seed past a 64-bit generator's range (it failed the engine's step: a 500).
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "seed": 2**70})
    assert resp.status_code == 400 and error_of(resp)["param"] == "seed"
    with pytest.raises(ValueError, match="seed must be None or an int"):
        SamplingParams(seed=2**64)
    # More sequences than the generator ever holds at once: a 400, not a 429 no retry could cure.
    gen.max_sequences = 4  # type: ignore[attr-defined]
    try:
        resp = http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
        assert resp.status_code == 400 and error_of(resp)["param"] == "n"
        assert "6 sequences" in error_of(resp)["message"] and "at most 4" in error_of(resp)["message"]
        assert "retry-after" not in resp.headers
        assert gen.calls == []
        resp = http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 2})
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 4
    finally:
        del gen.max_sequences  # type: ignore[attr-defined]


def test_unknown_model_is_404(client: openai.OpenAI, gen: ScriptedGenerator) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-5", prompt="hello")
    assert info.value.code == "model_not_found" and "gpt-5" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}], stream=True)


def test_unsupported_and_unknown_routes(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello", suffix="!")
    assert info.value.code == "unsupported_parameter" and "suffix" in info.value.message
    resp = http.post("/v1/embeddings", json={})
    assert resp.status_code == 404 and "/v1/embeddings" in error_of(resp)["message"]


def test_replica_failure_before_first_token_is_503(client: openai.OpenAI, gen: ScriptedGenerator) -> None:
    gen.mode = "fail_first"
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    assert info.value.status_code == 503 and "may or may not have run" in info.value.message
    assert "retry-after" not in info.value.response.headers  # it may have run: no invitation to retry


def test_overload_is_429(client: openai.OpenAI, gen: ScriptedGenerator) -> None:
    gen.mode = "overloaded"
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)
    assert info.value.code == "overloaded" and "did not run" in info.value.message
    assert info.value.response.headers.get("retry-after") == "1"  # it did not run: a client may come back


def test_chat_without_a_template_uses_the_plain_rendering(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    make_tokenizer(tmp_path, chat_template=None)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert not getattr(tok, "chat_template", None)
    gen = ScriptedGenerator(tok.encode(SCRIPT_TEXT), tok.eos_token_id)
    with OpenAIServer(create_openai_app(gen, tok, model_name=MODEL)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        out = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        c.close()
    assert out.choices[0].message.content == expected(tok, 3)
    assert gen.calls[0][0] == tok.encode("system: be brief\nuser: hi\nassistant:")


def test_replica_failure_mid_stream_is_an_error_event(client: openai.OpenAI, gen: ScriptedGenerator) -> None:
    gen.mode = "fail_later"
    stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, stream=True)
    with pytest.raises(openai.APIError, match="may or may not have run"):
        for _ in stream:
            pass


def _scrape(http: httpx.Client, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_disconnect_mid_stream_cancels(server: Any, gen: ScriptedGenerator, http: httpx.Client) -> None:
    gen.mode = "stall"
    before = _scrape(http, "actormesh_requests_cancelled_total", endpoint="completions")
    closed = gen.closed
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 20, "stream": True}
    with httpx.Client(base_url=server[0].url, timeout=30) as c, c.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # kept referenced: dropping it would close the connection early
        first = next(lines)
        assert first.startswith("data: ") and json.loads(first[6:])["choices"][0]["text"]
        assert gen.active == 1
    # the client is gone: the token iterator is closed, freeing the slot
    wait_for(lambda: gen.active == 0 and gen.closed == closed + 1, timeout=20)
    wait_for(lambda: _scrape(http, "actormesh_requests_cancelled_total", endpoint="completions") == before + 1)


def test_disconnect_while_waiting_cancels(server: Any, gen: ScriptedGenerator) -> None:
    gen.mode = "stall"
    closed = gen.closed
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 20}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server[0].port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        wait_for(lambda: gen.active == 1, timeout=20)
    wait_for(lambda: gen.active == 0 and gen.closed == closed + 1, timeout=20)
    assert gen.active == 0 and gen.closed == closed + 1  # the stalled request was cancelled, its slot freed


def test_health_and_metrics(server: Any, client: openai.OpenAI, http: httpx.Client, gen: ScriptedGenerator) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    health = server[0].app.state.test_health
    health["ok"] = False
    try:
        assert http.get("/health").status_code == 503
    finally:
        health["ok"] = True
    done = _scrape(http, "actormesh_http_requests_total", path="/v1/completions", status="200")
    tokens = _scrape(http, "actormesh_completion_tokens_total", endpoint="completions")
    client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert _scrape(http, "actormesh_http_requests_total", path="/v1/completions", status="200") == done + 1
    assert _scrape(http, "actormesh_completion_tokens_total", endpoint="completions") == tokens + 3
    assert _scrape(http, "actormesh_time_to_first_token_seconds_count", endpoint="completions") >= 1
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")


def test_import_is_light() -> None:
    import subprocess
    import sys

    code = "import sys, actormesh.serve; print(sorted(m for m in ('torch', 'fastapi', 'uvicorn', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_the_port_listens_before_the_server_serves() -> None:
    """`python -m actormesh.serve` prints its URL and then starts serving: a client that
    dials at once must wait in the backlog, not be refused."""
    srv = OpenAIServer(None, "127.0.0.1", 0)
    try:
        with socket.socket() as sock:
            sock.settimeout(5)
            assert sock.connect_ex(("127.0.0.1", srv.port)) == 0  # refused (ECONNREFUSED) before the fix
    finally:
        srv.close()
