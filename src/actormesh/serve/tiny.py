"""A tiny Hugging Face model directory for demos, tests and benchmarks: nothing downloaded.

``make_tiny_llama(path)`` writes what ``save_pretrained`` writes for a Llama-family
model with random weights (config.json, model.safetensors, generation_config.json)
and a byte-level BPE tokenizer trained on a small built-in corpus, with a chat
template, so ``AutoTokenizer.from_pretrained(path)`` and
``AutoModelForCausalLM.from_pretrained(path)`` both work offline. The weights
are random: the text it generates is noise, but it is a real model of the
Llama family (a few hundred kB), enough to exercise serving end to end.

Example::

    from actormesh.serve.tiny import make_tiny_llama
    path = make_tiny_llama(Path(tempfile.mkdtemp()) / "tiny")
    serve_openai(path, replicas=2, tp=2)

Importing this module imports neither torch nor transformers (they load on call).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["make_tiny_llama", "make_tokenizer", "CHAT_TEMPLATE"]

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "actors send messages to meshes of processes",
    "hello world, hello actors, hello meshes",
    "a replica serves requests; a router picks a replica",
    "tokens stream back to the client as server-sent events",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u65e5\u672c\u8a9e \U0001f600",
] * 4

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def make_tokenizer(path: str | os.PathLike[str], *, chat_template: str | None = CHAT_TEMPLATE) -> Any:
    """Train a byte-level BPE tokenizer on CORPUS and save it under ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return fast


def make_tiny_llama(path: str | os.PathLike[str], *, max_positions: int = 128, seed: int = 0) -> Path:
    """Write a random-weight tiny Llama and its tokenizer to ``path`` (made if missing); return it as a Path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(str(out))
    return out
