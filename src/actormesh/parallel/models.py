"""A small GPT for tests and demos, shaped the way :mod:`actormesh.parallel` expects.

* Linear layer names match the default tensor-parallel plan: ``attn.q/k/v``
  (colwise), ``attn.o`` (rowwise), ``mlp.up`` (colwise), ``mlp.down`` (rowwise).
* Blocks live in ``blocks`` (an ``nn.ModuleList``) so pipeline stages can split
  it. Modules registered before ``blocks`` (``tok_emb``, ``pos_emb``) belong to
  the first stage, those after it (``norm``, ``head``) to the last. A stage sets
  the others to ``None``, and :meth:`GPT.forward` skips what is ``None``: the
  first stage takes token ids, later stages take hidden states.
* Attention infers the local head count from the projection's width, so the
  same code runs with heads split across tensor-parallel ranks.

Example::

    import functools, torch
    from actormesh.parallel.models import GPT, GPTConfig, lm_loss, synthetic_batches

    cfg = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_blocks=4, seq_len=16)
    model = GPT(cfg)
    tokens, targets = next(synthetic_batches(cfg, batch_size=8, seed=0))
    lm_loss(model(tokens), targets).backward()
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "Block", "Attention", "MLP", "lm_loss", "synthetic_batches", "gpt"]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a :class:`GPT`. ``d_model`` must be a multiple of ``n_heads``."""

    vocab_size: int = 64
    d_model: int = 32
    n_heads: int = 4
    n_blocks: int = 4
    seq_len: int = 16
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig: d_model={self.d_model} is not a multiple of n_heads={self.n_heads}")


class Attention(nn.Module):
    """Causal multi-head self-attention with separate ``q``, ``k``, ``v``, ``o`` projections."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.o = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: with q/k/v sharded colwise each rank holds n_heads / tp of them.
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))

    def forward_cached(self, x: torch.Tensor, cache: Any, layer_idx: int) -> torch.Tensor:
        """Attention of new tokens over the cached ones (``cache`` bound to this pass's rows)."""
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        k, v = cache.update(k, v, layer_idx)
        mask = cache.mask("full_attention", allow_causal=True)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """``down(gelu(up(x)))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))

    def forward_cached(self, x: torch.Tensor, cache: Any, layer_idx: int) -> torch.Tensor:
        """:meth:`forward` with the attention reading and extending ``cache``."""
        x = x + self.attn.forward_cached(self.attn_norm(x), cache, layer_idx)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_blocks`` blocks, final norm, vocabulary head.

    ``forward(tokens[B, T]) -> logits[B, T, vocab]``; a pipeline stage without
    the embeddings takes hidden states ``[B, T, d_model]`` instead, and one
    without the head returns hidden states.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.n_heads = cfg.n_heads
        self.tok_emb: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb: nn.Module | None = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_blocks))
        self.norm: nn.Module | None = nn.LayerNorm(cfg.d_model)
        self.head: nn.Module | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            x = self.tok_emb(x)
            if self.pos_emb is not None:
                x = x + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            if block is not None:
                x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: Any, last: torch.Tensor | None = None) -> torch.Tensor:
        """One generation pass with a key/value cache; same contract as ``HFCausalLM.forward_cached``."""
        if self.tok_emb is not None:
            x = self.tok_emb(x)
            if self.pos_emb is not None:
                x = x + self.pos_emb(positions)
        for i, block in enumerate(self.blocks):
            if block is not None:
                x = block.forward_cached(x, cache, i)
        if last is not None and self.norm is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x

    @property
    def max_context(self) -> int:
        """Longest sequence the position embedding covers (``seq_len``)."""
        return self.config.seq_len

    sliding_window = None  #: full attention in every block


def gpt(vocab_size: int = 64, d_model: int = 32, n_heads: int = 4, n_blocks: int = 4, seq_len: int = 16, mlp_ratio: int = 4) -> GPT:
    """A :class:`GPT` from keyword sizes: ``functools.partial(gpt, n_blocks=8)`` is a picklable ``model_fn``."""
    return GPT(GPTConfig(vocab_size, d_model, n_heads, n_blocks, seq_len, mlp_ratio))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: ``logits[B, T, V]`` against ``targets[B, T]``."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def synthetic_batches(cfg: GPTConfig, batch_size: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(tokens, targets)`` batches of random tokens (targets = tokens shifted by one)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        seq = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=gen)
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
