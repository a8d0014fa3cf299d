"""TextDecoder: incremental detokenizing and stop strings, without I/O."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actormesh.serve import SamplingParams
from actormesh.serve._text_stream import Piece, TextDecoder, run_sequence
from actormesh.serve.tiny import make_tokenizer

ALPHABET = "abc hello world\u00e9\u65e5\U0001f600\n,"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path: Path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def run(dec: TextDecoder, ids: list[int]) -> tuple[list[str], str]:
    pieces = [dec.feed(t) for t in ids]
    return pieces, "".join(pieces) + dec.finish()


def test_split_characters_are_held_until_whole(tok: Any) -> None:
    ids = tok.encode("\U0001f600")
    assert len(ids) > 1  # the emoji is several byte tokens in this vocabulary
    pieces, text = run(TextDecoder(tok), ids)
    assert text == "\U0001f600"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[:-1] == [""] * (len(ids) - 1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=ALPHABET, max_size=40))
def test_incremental_text_equals_full_decode(tok: Any, text: str) -> None:
    ids = tok.encode(text)
    pieces, joined = run(TextDecoder(tok), ids)
    assert joined == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=ALPHABET, max_size=40), stop=st.text(alphabet=ALPHABET, min_size=1, max_size=4))
def test_stop_string_cuts_exactly(tok: Any, text: str, stop: str) -> None:
    dec = TextDecoder(tok, [stop])
    _, joined = run(dec, tok.encode(text))
    full = tok.decode(tok.encode(text), skip_special_tokens=True)
    if stop in full:
        assert dec.stopped and joined == full[: full.index(stop)]
    else:
        assert not dec.stopped and joined == full


def test_text_that_may_start_a_stop_is_held(tok: Any) -> None:
    dec = TextDecoder(tok, ["hello world"])
    emitted = "".join(dec.feed(t) for t in tok.encode("abc hello"))
    assert emitted == "abc "  # "hello" could still become "hello world"
    assert dec.finish() == "hello"  # it ended without the stop: released
    assert not dec.stopped


class _Overrunning:
    """A generator that ignores max_tokens; records whether it was closed."""

    max_context = 100

    def __init__(self) -> None:
        self.yielded = 0
        self.closed = False

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[int]:
        try:
            while True:
                self.yielded += 1
                yield 300
        finally:
            self.closed = True


def test_a_generator_past_max_tokens_is_closed(tok: Any) -> None:
    gen = _Overrunning()

    async def main() -> list[Piece]:
        return [p async for p in run_sequence(gen, 0, [1], SamplingParams(max_tokens=3), TextDecoder(tok))]

    pieces = asyncio.run(main())
    assert pieces[-1].finish_reason == "length" and pieces[-1].completion_tokens == 3
    assert gen.closed and gen.yielded == 4  # one past the limit, then closed
    assert "".join(p.text for p in pieces) == tok.decode([300] * 3)


class _Script:
    """Yields fixed token ids (does not itself honour min_tokens)."""

    max_context = 64

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[int]:
        for t in self.ids[: params.max_tokens]:
            yield t


def test_min_tokens_holds_off_stop_strings_and_stop_ids_as_in_vllm(tok: Any) -> None:
    ids = tok.encode("ab, cd, ef")

    def text(params: SamplingParams, stops: list[str]) -> tuple[str, str | None]:
        async def main() -> list[Piece]:
            return [p async for p in run_sequence(_Script(ids + [0]), 0, [1], params, TextDecoder(tok, stops))]

        pieces = asyncio.run(main())
        return "".join(p.text for p in pieces), pieces[-1].finish_reason

    assert text(SamplingParams(max_tokens=20), [","]) == ("ab", "stop")
    first_comma = next(i for i in range(len(ids)) if "," in tok.decode(ids[: i + 1]))
    # the first "," comes before min_tokens: kept; the next one, after it, stops
    assert text(SamplingParams(max_tokens=20, min_tokens=first_comma + 2), [","]) == ("ab, cd", "stop")
    # a stop id before min_tokens is not an end either (a generator that does not hold it off itself)
    stop_id = ids[0]
    assert text(SamplingParams(max_tokens=20, stop_token_ids=[stop_id]), []) == ("", "stop")
    assert text(SamplingParams(max_tokens=20, stop_token_ids=[stop_id], min_tokens=1), []) == (tok.decode(ids), "stop")
