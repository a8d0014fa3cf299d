"""Log-probabilities of the chosen tokens (and the most probable ones) in OpenAI's two shapes.

Tokens arrive as their exact bytes (``_token_bytes``): one may hold part of a
UTF-8 character. Chat (``logprobs: true``, ``top_logprobs: k``): ``content``,
one entry per token with its text, log-probability, bytes (which add up to the
answer's) and its position's ``k`` most probable tokens. Completions
(``logprobs: k``): parallel lists ``tokens`` (a token that is part of a
character is written ``bytes:\\xe6\\x97``, as OpenAI does), ``token_logprobs``,
``top_logprobs`` (per position the ``k`` most probable tokens and the chosen
one: up to ``k + 1`` entries, as OpenAI gives) and ``text_offset``, the
character of the choice's text where each token starts. A streamed choice gets
the entries of the tokens in each chunk.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from ._text_stream import TokenScore

__all__ = ["CompletionLogprobs", "chat_logprobs"]

Scored = Sequence[TokenScore]


def _completion_token(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class CompletionLogprobs:
    """The completions shape, per choice; offsets run on across a streamed choice's chunks."""

    def __init__(self) -> None:
        # Per choice: its text's characters so far, and a decoder holding a character cut in two
        # (invalid bytes count as one U+FFFD each, as in the text).
        self._chars: dict[int, int] = {}
        self._decoders: dict[int, codecs.IncrementalDecoder] = {}

    def entries(self, index: int, scored: Scored, prompt: Scored | None = None, echoed: str = "") -> dict[str, Any]:
        """The entries of ``scored``, the tokens of a choice's next piece. With ``prompt`` (echo of a
        scored prompt, on the first piece) the prompt's tokens come first, and the generated tokens'
        offsets start after ``echoed``, the prompt's text as the choice's text begins with it."""
        if prompt is None:
            return self._entries(index, scored)
        head = self._entries(index, prompt)
        self._chars[index] = len(echoed)
        self._decoders.pop(index, None)
        tail = self._entries(index, scored)
        return {key: head[key] + tail[key] for key in head}

    def _entries(self, index: int, scored: Scored) -> dict[str, Any]:
        decoder = self._decoders.get(index)
        if decoder is None:
            decoder = self._decoders[index] = codecs.getincrementaldecoder("utf-8")("replace")
        chars = self._chars.get(index, 0)
        tokens, offsets = [], []
        for raw, _, _ in scored:
            offsets.append(chars)  # a token that ends a cut character points at where it starts
            tokens.append(_completion_token(raw))
            chars += len(decoder.decode(raw))
        self._chars[index] = chars
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in scored],
            # The chosen token and the most probable ones: up to logprobs + 1 entries, as OpenAI gives;
            # nothing for a prompt's first token, which nothing predicts.
            "top_logprobs": [None if lp is None else {t: lp, **{_completion_token(a): alp for a, alp in top}}
                             for t, (_, lp, top) in zip(tokens, scored)],
            "text_offset": offsets,
        }


def _chat_token(raw: bytes, logprob: float | None) -> dict[str, Any]:
    return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(scored: Scored) -> dict[str, Any]:
    """The chat shape for ``scored`` tokens."""
    return {
        "content": [{**_chat_token(raw, lp), "top_logprobs": [_chat_token(a, alp) for a, alp in top]}
                    for raw, lp, top in scored],
        "refusal": None,
    }
