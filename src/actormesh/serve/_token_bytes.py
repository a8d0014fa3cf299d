"""The exact bytes of one token, which its decoded text cannot always give.

A byte-level BPE token may hold part of a UTF-8 character: decoded alone it
reads U+FFFD, and the tokens' texts no longer add up to the answer. OpenAI's
log-probabilities list each token's bytes so that they do. Byte-level tokenizers
(GPT-2, Llama 3, Qwen) spell every byte as one printable character of a fixed
table; SentencePiece ones with byte fallback name lone bytes ``<0xE6>``; any
other token's bytes are its decoded text's.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["token_bytes"]

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """The byte-level alphabet, reversed: printable Latin-1 bytes stand for themselves,
    the other bytes for the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_FROM_BYTE_LEVEL = _byte_level_table()


def _is_byte_level(tokenizer: Any) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The UTF-8 bytes ``token_id`` adds to a text (``tokenizer``: a Hugging Face one)."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if isinstance(piece, str):
        lone = _BYTE_PIECE.fullmatch(piece)
        if lone:
            return bytes([int(lone.group(1), 16)])
        if _is_byte_level(tokenizer) and all(c in _FROM_BYTE_LEVEL for c in piece):
            return bytes(_FROM_BYTE_LEVEL[c] for c in piece)
    return str(tokenizer.decode([token_id], skip_special_tokens=False)).encode("utf-8")
