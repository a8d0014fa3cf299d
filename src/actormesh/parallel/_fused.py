"""A direct path through Llama-family decoder layers for generation with a :class:`KVCache`.

Why: at serving batch sizes on a CPU (and for small models anywhere) a decode
step is bound by per-operation overhead, not arithmetic. Hugging Face's layer
spends most of a step in module calls, keyword plumbing and decorators around
about forty small tensor operations. :class:`FusedDecoder` runs the layers
straight from their weights, with operations chosen to give bit-for-bit the
values the layer's own ``forward`` gives, so greedy generation stays
token-for-token equal to ``generate``:

* ``rotate_half(x) * sin`` as ``roll(x) * signed_sin`` (negating and rolling
  are exact), the step's signed sines computed once for all layers;
* ``rms_norm`` as one call where this build computes it exactly as the
  composite form does (checked once);
* no module calls, hooks, keyword plumbing or output objects.

Projections are not concatenated into one product: a cached concatenation
would miss weights written in place through ``.data`` (as swaps do).

It applies to the decoder layers whose ``forward`` it reproduces (Llama,
Mistral, Qwen2, Qwen3: pre-norm RMSNorm, q/k/v/o projections with optional
bias and optional per-head q/k norms, rotary embeddings, SDPA attention, a
gated MLP) when their weights are plain tensors in this process. Anything
else (tensor-parallel DTensor weights, module hooks, another attention
implementation, an unknown layer class) runs the layer's own ``forward``:
:func:`can_fuse` decides.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward as _sdpa

__all__ = ["can_fuse", "can_fuse_norm", "FusedDecoder"]

#: Decoder layers whose forward is, op for op, what :class:`FusedDecoder` computes.
FUSABLE_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"})
_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _plain(module: Any) -> bool:
    """A module with no hooks whose tensors are ordinary ones (not DTensor shards, not on meta)."""
    if module._forward_hooks or module._forward_pre_hooks or getattr(module, "_backward_hooks", None):
        return False
    return all(type(t) in (torch.Tensor, nn.Parameter) and not t.is_meta
               for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))


def can_fuse_norm(norm: Any) -> bool:
    """Whether :meth:`FusedDecoder.norm` computes exactly what ``norm.forward`` would."""
    return type(norm).__name__ in _NORMS and _plain(norm)


def can_fuse(block: Any) -> bool:
    """Whether :class:`FusedDecoder` computes exactly what ``block.forward`` would (in eval mode)."""
    if type(block).__name__ not in FUSABLE_LAYERS:
        return False
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    if attn is None or mlp is None or getattr(attn.config, "_attn_implementation", None) != "sdpa":
        return False
    norms = [block.input_layernorm, block.post_attention_layernorm]
    norms += [n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n is not None]
    if any(type(n).__name__ not in _NORMS for n in norms):
        return False
    linears = [getattr(attn, n, None) for n in _ATTN] + [getattr(mlp, n, None) for n in _MLP]
    if any(type(m) is not nn.Linear for m in linears):
        return False
    return all(_plain(m) for m in (block, attn, mlp, *norms, *linears)) and not block.training


def _rms_composite(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # LlamaRMSNorm.forward's own operations
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rms_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


class FusedDecoder:
    """Runs the fusable blocks of one model chunk for ``forward_cached`` (see the module's docstring).

    It holds no copy of any weight: every call reads the layer's current
    parameters, so weights swapped in place (or replaced) are used at once.
    """

    def __init__(self) -> None:
        self.rms: Any = None  #: the RMSNorm form in use (chosen at the first block)
        self._table: tuple[torch.Tensor, ...] = ()
        self._table_key: Any = None

    def _choose_rms(self, norm: Any) -> Any:
        # one rms_norm call where this build computes it as the composite form does, bit for bit
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(32, 1, norm.weight.shape[0], generator=gen).to(device=norm.weight.device, dtype=norm.weight.dtype)
        with torch.no_grad():
            same = torch.equal(_rms_fused(probe, norm.weight, norm.variance_epsilon),
                               _rms_composite(probe, norm.weight, norm.variance_epsilon))
        self.rms = _rms_fused if same else _rms_composite
        return self.rms

    @staticmethod
    def rotary(position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's ``(cos, signed_sin)`` as ``[B, 1, T, D]``, shared by every layer."""
        cos, sin = position_embeddings
        return cos.unsqueeze(1), _signed(sin).unsqueeze(1)

    def _rotary_at(self, rotary_emb: Any, x: torch.Tensor, positions: torch.Tensor, need_sin: bool) -> tuple[Any, ...]:
        """``(cos, signed_sin, sin)`` at ``positions`` (``sin`` only if ``need_sin``), from a table of every position.

        The table holds what the rotary module computes for each position, so
        a step indexes it (one operation) instead of recomputing it (about a
        dozen). Rotary kinds whose frequencies change with the sequence
        (dynamic, longrope) are computed per step as the module does.
        """
        kind = str(getattr(rotary_emb, "rope_type", "default"))
        if "dynamic" in kind or kind == "longrope":
            cos, sin = rotary_emb(x, positions)
            return cos, _signed(sin), sin
        key = (id(rotary_emb), x.device, x.dtype)
        if self._table_key != key:
            length = int(rotary_emb.config.max_position_embeddings)
            cos, sin = rotary_emb(x[:1, :1], torch.arange(length, device=x.device)[None])
            self._table, self._table_key = (cos[0], _signed(sin[0]), sin[0]), key
        cos_t, signed_t, sin_t = self._table
        return cos_t[positions], signed_t[positions], sin_t[positions] if need_sin else None

    def forward(self, blocks: Any, fusable: list[bool], rotary_emb: Any, layer_types: list[str], x: torch.Tensor,
                positions: torch.Tensor, cache: Any, mask_of: Any) -> torch.Tensor:
        """Every block of a chunk over ``x``: fused where ``fusable``, else the block's own forward."""
        cos, signed, sin = self._rotary_at(rotary_emb, x, positions, not all(f or b is None for f, b in zip(fusable, blocks)))
        rotary = (cos.unsqueeze(1), signed.unsqueeze(1))
        masks = {kind: mask_of(cache, kind) for kind in set(layer_types)}
        for i, (block, fused) in enumerate(zip(blocks, fusable)):
            if fused:
                x = self.block(block, x, rotary, masks[layer_types[i]], cache)
            elif block is not None:
                x = block(x, attention_mask=masks[layer_types[i]], position_ids=positions, past_key_values=cache,
                          position_embeddings=(cos, sin))
        return x

    def norm(self, norm: Any, x: torch.Tensor) -> torch.Tensor:
        """The model's final RMSNorm, for a ``norm`` :func:`can_fuse_norm` accepts."""
        rms = self.rms or self._choose_rms(norm)
        return rms(x, norm.weight, norm.variance_epsilon)

    def block(self, block: Any, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
              mask: torch.Tensor | None, cache: Any) -> torch.Tensor:
        """``block(x, attention_mask=mask, past_key_values=cache, ...)`` for a block :func:`can_fuse` accepts.

        ``x`` is ``[B, T, hidden]``; ``rotary`` from :meth:`rotary`; ``cache`` a bound :class:`KVCache`.
        """
        attn, mlp, norm = block.self_attn, block.mlp, block.input_layernorm
        rms = self.rms or self._choose_rms(norm)
        lead = x.shape[:-1]
        shape = (*lead, -1, attn.head_dim)
        h = rms(x, norm.weight, norm.variance_epsilon)
        q, k, v = (F.linear(h, p.weight, p.bias).view(shape) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        q_norm = getattr(attn, "q_norm", None)
        if q_norm is not None:
            q = rms(q, q_norm.weight, q_norm.variance_epsilon)
            k = rms(k, attn.k_norm.weight, attn.k_norm.variance_epsilon)
        q, k = _rotate(q.transpose(1, 2), rotary), _rotate(k.transpose(1, 2), rotary)
        k, v = cache.update(k, v.transpose(1, 2), attn.layer_idx)
        out, _ = _sdpa(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling)
        x = x + F.linear(out.reshape(*lead, -1).contiguous(), attn.o_proj.weight, attn.o_proj.bias)
        norm = block.post_attention_layernorm
        h = rms(x, norm.weight, norm.variance_epsilon)
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        return x + F.linear(mlp.act_fn(F.linear(h, gate.weight, gate.bias)) * F.linear(h, up.weight, up.bias),
                            down.weight, down.bias)


def _signed(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x) * signed_sin exactly
    cos, signed_sin = rotary
    return (x * cos) + (x.roll(x.shape[-1] // 2, -1) * signed_sin)
