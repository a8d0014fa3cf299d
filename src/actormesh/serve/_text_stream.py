"""From token ids to text pieces: incremental detokenizing, stop strings, merging.

Theory of operation. A generator yields token ids one at a time; a client wants
text as soon as it is final. Two things make a piece of text not yet final:

* the last tokens may end in the middle of a UTF-8 character (byte-level BPE):
  their decoded text ends with U+FFFD, so it is held until more tokens arrive;
* the text may be the start of a stop string: the longest tail of the text that
  is a prefix of some stop string is held until it is ruled out or completed.

:class:`TextDecoder` does both with no I/O (feed a token id, get the text that
became final). Decoding re-decodes only a short window of tokens
(``ids[prefix:]``) so each token costs O(window), not O(length), while keeping
enough context for tokenizers whose pieces depend on their neighbour (leading
spaces of SentencePiece). :func:`run_sequence` drives one generation through a
decoder and closes the token iterator on every exit path, which is what frees
the request's batch slot; :func:`merge` interleaves several sequences (``n > 1``
or a list of prompts) as their pieces arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from ._token_bytes import token_bytes
from ._types import PromptLogprobs, SamplingParams, TokenGenerator

#: how long closing a cancelled request's token iterator may take
CLOSE_TIMEOUT_S = 10.0


class TextDecoder:
    """Turns a stream of token ids into final text, honouring stop strings.

    ``tokenizer`` is a Hugging Face tokenizer (anything with
    ``decode(ids, skip_special_tokens=...)``). After a stop string is seen,
    :attr:`stopped` is true and the text up to (not including) it was returned.

    Example::

        dec = TextDecoder(tok, stops=["\\n"])
        text = "".join(dec.feed(t) for t in ids) + dec.finish()
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._stops = [s for s in stops if s]
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] give context; their text was already taken
        self._read = 0
        self._held = ""  # final text kept back because it may start a stop string
        self.stopped = False
        self._checking = True  # whether the text fed last is searched for stop strings

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (maybe part of a character), as OpenAI's logprobs list it."""
        return token_bytes(self._tok, token_id)

    def feed(self, token_id: int, stops: bool = True) -> str:
        """Add one token; return the text that became final (maybe empty). ``stops=False``:
        its text is not searched for stop strings (vLLM's ``min_tokens`` not yet reached)."""
        if self.stopped:
            return ""
        self._checking = stops
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new yet, or a character cut in half: wait for more bytes
        self._prefix, self._read = self._read, len(self._ids)
        return self._cut(after[len(before) :])

    def finish(self) -> str:
        """The generation ended: return whatever text is still held back."""
        if self.stopped:
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        text = self._cut(after[len(before) :]) if len(after) > len(before) else ""
        if self.stopped:
            return text
        text, self._held = text + self._held, ""
        return text

    def _cut(self, delta: str) -> str:
        """Apply stop strings to held text + ``delta``; return the final part."""
        text = self._held + delta
        if not self._stops or not self._checking:
            self._held = ""
            return text
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return text[: min(hits)]
        keep = _longest_stop_prefix_tail(text, self._stops)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


def _longest_stop_prefix_tail(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


#: A token's bytes, its log-probability (None from a generator that gave none) and, when
#: asked for, the most probable tokens at its position as ``(bytes, log-probability)``.
TokenScore = tuple[bytes, "float | None", "tuple[tuple[bytes, float], ...]"]


@dataclass(frozen=True)
class Piece:
    """Text for choice ``index``; the last piece of a choice has ``finish_reason``."""

    index: int
    text: str
    finish_reason: str | None = None  #: "stop" or "length" on the last piece
    completion_tokens: int = 0  #: tokens generated so far for this choice
    #: with ``SamplingParams.logprobs``: each token generated since the last piece (stop tokens excluded)
    logprobs: tuple[TokenScore, ...] = ()
    #: with ``SamplingParams.prompt_logprobs``, on a choice's first piece: every prompt token, scored
    #: (the first has no log-probability)
    prompt: tuple[TokenScore, ...] | None = None
    #: the ids of the tokens generated since the last piece (stop tokens excluded)
    token_ids: tuple[int, ...] = ()


async def close_iterator(it: Any) -> None:
    """Close a token iterator even inside a cancelled scope, within a deadline."""
    aclose = getattr(it, "aclose", None)
    if aclose is None:
        return
    with anyio.CancelScope(shield=True) as scope:
        scope.deadline = anyio.current_time() + CLOSE_TIMEOUT_S
        await aclose()


def _score(decoder: TextDecoder, token: int, logprob: float | None, top: Sequence[tuple[int, float]]) -> TokenScore:
    return decoder.token_bytes(token), logprob, tuple((decoder.token_bytes(t), lp) for t, lp in top)


async def run_sequence(generator: TokenGenerator, index: int, prompt_ids: list[int], params: SamplingParams,
                       decoder: TextDecoder) -> AsyncIterator[Piece]:
    """Generate one choice: pieces of final text, then a last piece with the reason.

    The reason is ``"stop"`` when a stop token or stop string ended it (or the
    generator ended before ``max_tokens``), ``"length"`` when ``max_tokens`` did.
    Stop tokens are not part of the text. After a stop token or the last
    allowed token the generator is given the chance to end by itself (an engine
    ends its stream there), so the common end costs no cancellation; one that
    yields more is closed then. The token iterator is closed on every exit,
    including the consumer going away.
    """
    it = generator.generate(prompt_ids, params)
    count, finish = 0, None
    stop_ids = set(params.stop_token_ids)
    want = params.logprobs
    scored: list[TokenScore] = []  # tokens not yet in a piece, with their log-probabilities
    prompt: tuple[TokenScore, ...] | None = None  # the scored prompt, until a piece carries it
    fresh: list[int] = []  # ids of the tokens not yet in a piece

    def piece(text: str, finish_reason: str | None) -> Piece:  # takes the scores gathered so far
        nonlocal prompt
        out = Piece(index, text, finish_reason, count, tuple(scored), prompt, tuple(fresh))
        scored.clear()
        fresh.clear()
        prompt = None
        return out

    try:
        async for item in it:
            if finish is not None:
                break  # past its end: close it
            if type(item) is PromptLogprobs:
                prompt = tuple(_score(decoder, *t) for t in item.tokens)
                continue
            count += 1
            # With logprobs, generators yield (token id, log-probability[, top tokens]).
            tid, logprob, top = (item[0], item[1], item[2] if len(item) > 2 else ()) if type(item) is tuple else (item, None, ())
            # vLLM's min_tokens: a stop token only after that many tokens, stop strings from the last of them
            if tid in stop_ids and count > params.min_tokens:
                finish = "stop"
                continue
            fresh.append(tid)
            if want:
                scored.append(_score(decoder, tid, logprob, top))
            delta = decoder.feed(tid, stops=count >= params.min_tokens)
            if decoder.stopped:
                finish = "stop"
                if delta:
                    yield piece(delta, None)
                break  # a stop string: the generator does not know, cancel it
            if delta:
                yield piece(delta, None)
            if count >= params.max_tokens:
                finish = "length"
    finally:
        await close_iterator(it)
    if finish is None:
        finish = "length" if count >= params.max_tokens else "stop"
    yield piece(decoder.finish(), finish)


_DONE = object()


async def merge(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[Piece]:
    """Interleave several piece streams in arrival order; the first error is raised.

    Leaving early (or being cancelled) cancels every stream, which closes their
    token iterators.
    """
    if len(streams) == 1:
        stream = streams[0]
        try:
            async for piece in stream:
                yield piece
        finally:
            await close_iterator(stream)
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                await queue.put(piece)
        except Exception as exc:  # handed to the consumer, raised there
            await queue.put(exc)
        finally:
            await queue.put(_DONE)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + CLOSE_TIMEOUT_S
            await asyncio.gather(*tasks, return_exceptions=True)
