"""OpenAI's sampling options over the HTTP API: log-probabilities (``logprobs`` /
``top_logprobs``), penalties and ``logit_bias``, through the official client, against
a scripted TokenGenerator that yields ``(token, log-probability[, top])`` as engines do
(what the engine does with them: tests/test_sampling_shaping.py, tests/test_generate.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest

from actormesh.serve import OpenAIServer, PromptLogprobs, SamplingParams, create_openai_app
from test_serve_http import tokenizer  # noqa: F401  (the tiny tokenizer fixture)

MODEL = "tiny-lp"
SCRIPT_TEXT = " hello world, caf\u00e9 \u65e5\u672c\u8a9e actors"


#: the alternatives the generator lists at every position: plain ASCII tokens of the tiny tokenizer
TOP = [70, 71, 72]


def logprob_of(i: int) -> float:
    return -0.25 * (i + 1)


def prompt_score(i: int) -> float:
    return -0.5 * i


class ScoredGenerator:
    """Yields a fixed script; with ``params.logprobs``, ``(token, logprob_of(i))`` pairs.
    ``eos_at``: yield the EOS token at that step instead (a stop token)."""

    max_context = 64

    def __init__(self, script: list[int], eos: int) -> None:
        self.script, self.eos = script, eos
        self.eos_at: int | None = None
        self.asked: list[SamplingParams] = []
        self.scores_prompts = True

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Any]:
        self.asked.append(params)
        k = params.prompt_logprobs
        if k is not None and self.scores_prompts:  # as engines do: the scored prompt first
            yield PromptLogprobs(tuple((t, None, ()) if i == 0 else (t, prompt_score(i), tuple(
                (a, prompt_score(i) - 1 - j) for j, a in enumerate(TOP[:k]))) for i, t in enumerate(prompt_ids)))
        for i in range(params.max_tokens):
            await asyncio.sleep(0)
            tid = self.eos if i == self.eos_at else self.script[i % len(self.script)]
            if params.top_logprobs:
                yield (tid, logprob_of(i), tuple((t, logprob_of(i) - j) for j, t in enumerate(TOP[:params.top_logprobs])))
            else:
                yield (tid, logprob_of(i)) if params.logprobs else tid
            if i == self.eos_at:
                return


@pytest.fixture(scope="module")
def served(tokenizer: Any) -> Iterator[tuple[openai.OpenAI, ScoredGenerator]]:
    gen = ScoredGenerator(tokenizer.encode(SCRIPT_TEXT), tokenizer.eos_token_id)
    with OpenAIServer(create_openai_app(gen, tokenizer, model_name=MODEL), "127.0.0.1", 0) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        yield client, gen
        client.close()


@pytest.fixture
def client(served: tuple[openai.OpenAI, ScoredGenerator]) -> openai.OpenAI:
    served[1].eos_at = None
    served[1].asked.clear()
    served[1].scores_prompts = True
    return served[0]


def raw_of(token: str) -> bytes:
    """A completions token back to its bytes (``bytes:\\xe6\\x97`` for part of a character)."""
    return bytes.fromhex(token[6:].replace("\\x", "")) if token.startswith("bytes:") else token.encode()


def test_chat_reports_each_chosen_token(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, logprobs=True)
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert [e.logprob for e in entries] == [logprob_of(i) for i in range(8)]
    assert all(e.bytes is not None and e.token == bytes(e.bytes).decode("utf-8", "replace") and e.top_logprobs == []
               for e in entries)
    assert b"".join(bytes(e.bytes or []) for e in entries) == (choice.message.content or "").encode()
    assert any("\ufffd" in e.token for e in entries)  # the script cuts a character in two: its bytes still add up


def check_completion_entries(text: str, tokens: list[str], offsets: list[int], n: int) -> None:
    assert len(tokens) == len(offsets) == n
    assert b"".join(raw_of(t) for t in tokens) == text.encode()
    assert offsets == sorted(offsets) and any(t.startswith("bytes:") for t in tokens)
    for t, o in zip(tokens, offsets):
        if not t.startswith("bytes:"):
            assert text[o:o + len(t)] == t


def test_completion_lists_tokens_offsets_and_logprobs_per_choice(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=9, logprobs=0, n=2)
    assert len(out.choices) == 2
    for choice in out.choices:
        lp = choice.logprobs
        assert lp is not None and lp.tokens is not None and lp.text_offset is not None
        check_completion_entries(choice.text, lp.tokens, lp.text_offset, 9)
        assert lp.token_logprobs == [logprob_of(i) for i in range(9)]
        assert lp.top_logprobs == [{t: logprob_of(i)} for i, t in enumerate(lp.tokens)]


def test_streams_carry_the_same_entries(client: openai.OpenAI) -> None:
    tokens, offsets, values = [], [], []
    text = ""
    for chunk in client.completions.create(model=MODEL, prompt="hello", max_tokens=9, logprobs=0, stream=True):
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens or []
            offsets += choice.logprobs.text_offset or []
            values += choice.logprobs.token_logprobs or []
    check_completion_entries(text, tokens, offsets, 9)
    assert values == [logprob_of(i) for i in range(9)]
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=9, logprobs=True)
    streamed = [e for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                               max_tokens=9, logprobs=True, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content or []]
    assert whole.choices[0].logprobs is not None
    assert [(e.bytes, e.logprob) for e in streamed] == [(e.bytes, e.logprob) for e in whole.choices[0].logprobs.content or []]


def test_a_stop_token_is_not_listed_and_unasked_means_none(served: tuple[openai.OpenAI, ScoredGenerator],
                                                            client: openai.OpenAI) -> None:
    served[1].eos_at = 3
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, logprobs=0)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].logprobs is not None
    assert out.choices[0].logprobs.token_logprobs == [logprob_of(i) for i in range(3)]
    served[1].eos_at = None
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert plain.choices[0].logprobs is None and served[1].asked[-1].logprobs is False


def test_the_most_probable_tokens_per_position(served: tuple[openai.OpenAI, ScoredGenerator], client: openai.OpenAI,
                                                tokenizer: Any) -> None:
    alternatives = [tokenizer.decode([t]) for t in TOP]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          logprobs=True, top_logprobs=2)
    assert served[1].asked[-1].top_logprobs == 2 and chat.choices[0].logprobs is not None
    for i, e in enumerate(chat.choices[0].logprobs.content or []):
        assert [(t.token, t.logprob, t.bytes) for t in e.top_logprobs] == [
            (a, logprob_of(i) - j, list(a.encode())) for j, a in enumerate(alternatives[:2])]
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.tokens is not None
    for i, (chosen, top) in enumerate(zip(lp.tokens, lp.top_logprobs)):
        assert top == {chosen: logprob_of(i), **{a: logprob_of(i) - j for j, a in enumerate(alternatives)}}


@pytest.mark.parametrize("kind, extra, field, says", [
    ("completions", {"logprobs": 6}, "logprobs", "less than or equal to 5"),
    ("chat", {"top_logprobs": 3}, "top_logprobs", "needs logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
])
def test_what_cannot_be_answered_is_refused_by_name(client: openai.OpenAI, kind: str, extra: dict[str, Any], field: str,
                                                    says: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        if kind == "completions":
            client.completions.create(model=MODEL, prompt="hello", max_tokens=2, **extra)
        else:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra)
    assert info.value.param == field and says in info.value.message


def test_token_bytes_of_byte_fallback_and_plain_pieces() -> None:
    """SentencePiece's byte fallback names a lone byte ``<0xE6>``; other pieces give their text."""
    from actormesh.serve._token_bytes import token_bytes

    class Piecewise:
        pieces = {1: "<0xE6>", 2: "\u2581hello", 3: "<s>"}

        def convert_ids_to_tokens(self, i: int) -> str:
            return self.pieces[i]

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return {2: " hello", 3: "<s>"}[ids[0]]

    tok = Piecewise()
    assert [token_bytes(tok, i) for i in (1, 2, 3)] == [b"\xe6", b" hello", b"<s>"]


def test_penalties_and_logit_bias_reach_the_generator(served: tuple[openai.OpenAI, ScoredGenerator], client: openai.OpenAI) -> None:
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   presence_penalty=0.5, frequency_penalty=-1.5, logit_bias={"70": 100, "71": -100})
    params = served[1].asked[-1]
    assert (params.presence_penalty, params.frequency_penalty, dict(params.logit_bias or {})) == (0.5, -1.5, {70: 100.0, 71: -100.0})
    client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    params = served[1].asked[-1]
    assert (params.presence_penalty, params.frequency_penalty, params.logit_bias) == (0.0, 0.0, None)


@pytest.mark.parametrize("extra, field, says", [
    ({"logit_bias": {"seventy": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"70": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"400": 1}}, "logit_bias", "outside the vocabulary"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "less than or equal to 2"),
])
def test_bad_sampling_options_are_400s_naming_them(client: openai.OpenAI, extra: dict[str, Any], field: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2, **extra)
    assert info.value.param == field and says in info.value.message


def test_a_message_without_content_is_refused_unless_the_assistants(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}], max_tokens=2)  # type: ignore[typeddict-item]
    assert "user message needs content" in info.value.message and (info.value.param or "").startswith("messages.0")
    ok = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "again"}])
    assert ok.choices[0].finish_reason == "length"


def test_echo_streams_the_prompt_first(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=["hello there", "actors"], max_tokens=5, echo=True, n=2)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=["hello there", "actors"], max_tokens=5, echo=True, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == [c.text for c in whole.choices]
    assert whole.choices[0].text.startswith("hello there") and whole.choices[2].text.startswith("actors")


def test_echo_with_logprobs_scores_the_prompt_first(tokenizer: Any, client: openai.OpenAI) -> None:
    """lm-eval's loglikelihood request: the prompt's tokens lead every list, the first unscored."""
    prompt = "hello there"
    ids = tokenizer.encode(prompt)
    assert tokenizer.decode(ids, skip_special_tokens=True) == prompt
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=2, echo=True, temperature=0)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    n = len(ids)
    assert out.choices[0].text.startswith(prompt) and len(lp.tokens) == n + 3
    assert b"".join(raw_of(t) for t in lp.tokens[:n]) == prompt.encode()
    assert lp.token_logprobs == [None] + [prompt_score(i) for i in range(1, n)] + [logprob_of(i) for i in range(3)]
    assert lp.top_logprobs[0] is None
    alts = [tokenizer.decode([a]) for a in TOP[:2]]
    assert lp.top_logprobs[1] == {lp.tokens[1]: prompt_score(1), **{a: prompt_score(1) - 1 - j for j, a in enumerate(alts)}}
    assert lp.text_offset is not None and lp.text_offset[0] == 0 and lp.text_offset[n] == len(prompt)
    # streamed: the first chunk carries the prompt's entries, the rest the new tokens'
    entries: list[Any] = []
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=2, echo=True,
                                           temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            entries += chunk.choices[0].logprobs.token_logprobs or []
    assert entries == lp.token_logprobs


def test_echo_with_logprobs_from_a_generator_that_cannot_score_is_refused(served: tuple[openai.OpenAI, ScoredGenerator],
                                                                         client: openai.OpenAI) -> None:
    served[1].scores_prompts = False
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2, logprobs=0, echo=True)
    assert info.value.param == "echo" and "no prompt log-probabilities" in info.value.message
    assert served[1].asked[-1].prompt_logprobs == 0


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(tokenizer: Any, client: openai.OpenAI) -> None:
    """The legacy way to score a prompt (older lm-eval): nothing generated, the prompt back with its scores."""
    prompt = "hello there"
    n = len(tokenizer.encode(prompt))
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.token_logprobs == [None] + [prompt_score(i) for i in range(1, n)]
    assert out.usage is not None and out.usage.completion_tokens == 0
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=0,
                                                                              echo=True, stream=True) if c.choices)
    assert streamed == prompt
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert info.value.param == "max_tokens" and "echo" in info.value.message
