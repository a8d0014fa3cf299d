"""The chosen tokens' log-probabilities in OpenAI's two shapes.

Tokens arrive as their exact bytes (``_token_bytes``): one may hold part of a
UTF-8 character. Chat (``logprobs: true``): ``content``, one entry per token
with its text, log-probability, bytes (which add up to the answer's) and an empty
``top_logprobs``. Completions (``logprobs: 0``): parallel lists ``tokens`` (a
token that is part of a character is written ``bytes:\\xe6\\x97``, as OpenAI
does), ``token_logprobs``, ``top_logprobs`` (each position's dict holds the
chosen token only: OpenAI returns up to ``logprobs + 1`` entries) and
``text_offset``, the character of the choice's text where each token starts. A
streamed choice gets the entries of the tokens in each chunk.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

__all__ = ["CompletionLogprobs", "chat_logprobs"]

Scored = Sequence[tuple[bytes, "float | None"]]


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

    def entries(self, index: int, scored: Scored) -> dict[str, Any]:
        decoder = self._decoders.get(index)
        if decoder is None:
            decoder = self._decoders[index] = codecs.getincrementaldecoder("utf-8")("replace")
        chars = self._chars.get(index, 0)
        tokens, offsets = [], []
        for raw, _ in scored:
            offsets.append(chars)  # a token that ends a cut character points at where it starts
            tokens.append(_completion_token(raw))
            chars += len(decoder.decode(raw))
        self._chars[index] = chars
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp in scored],
            "top_logprobs": [{t: lp} for t, (_, lp) in zip(tokens, scored)],
            "text_offset": offsets,
        }


def chat_logprobs(scored: Scored) -> dict[str, Any]:
    """The chat shape for ``scored`` tokens."""
    return {
        "content": [{"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw), "top_logprobs": []}
                    for raw, lp in scored],
        "refusal": None,
    }
