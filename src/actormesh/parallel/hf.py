"""Hugging Face causal LMs under :func:`actormesh.parallel.spawn_trainer`, for every :class:`Plan`.

:class:`HFCausalLM` takes a transformers causal LM of the Llama family
(``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ...: a base model of ``embed_tokens``, ``layers``,
``norm`` and ``rotary_emb`` under ``model``, plus ``lm_head``) and re-hangs
its modules in the layout the trainer expects, reusing them as they are:

* ``embed_tokens`` (first pipeline stage), ``blocks`` (the HF decoder layers),
  ``norm`` and ``lm_head`` (last stage) are the top-level children, so the
  pipeline cut and the default tensor-parallel plan (``q_proj``/``k_proj``/
  ``v_proj`` and ``gate_proj``/``up_proj`` colwise, ``o_proj``/``down_proj``
  rowwise, the embedding by vocabulary, ``lm_head`` colwise) apply unchanged.
  HF attention reshapes with ``view(*shape, -1, head_dim)`` and keeps the
  query/key-value group ratio, so under TP each rank runs its own heads.
* The rotary embedding is needed by every stage and has no weights, only a
  non-persistent buffer, so it is *not* a child module (a pipeline stage would
  drop it): it is rebuilt by :meth:`HFCausalLM.init_buffers`, which the trainer
  calls after materialising the meta-device model.
* ``forward(x)`` runs the HF layers with the rotary position embeddings and the
  causal (or sliding-window) mask HF itself builds for ``config``; a module
  that is ``None`` (another pipeline stage's) is skipped.

Parameter names are the adapter's (``blocks.0.self_attn.q_proj.weight``);
:func:`from_hf_state_dict` / :func:`to_hf_state_dict` convert from and to HF's
(``model.layers.0.self_attn.q_proj.weight``), e.g. to start training from
pretrained weights with ``trainer.load_state_dict``. The loss is
:func:`actormesh.parallel.models.lm_loss` (targets already shifted).

Example::

    from functools import partial
    import torch
    from transformers import LlamaConfig
    from actormesh.parallel import Plan, spawn_trainer
    from actormesh.parallel.hf import hf_causal_lm
    from actormesh.parallel.models import lm_loss

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    trainer = spawn_trainer(procs, partial(hf_causal_lm, cfg), lm_loss,
                            partial(torch.optim.AdamW, lr=1e-3), Plan(fsdp=2, tp=2))

Importing this module imports torch and transformers.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from torch import nn

from ._fused import FusedDecoder, can_fuse, can_fuse_norm

__all__ = ["HFCausalLM", "hf_causal_lm", "from_hf_state_dict", "to_hf_state_dict"]

_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


class HFCausalLM(nn.Module):
    """A HF causal LM's own modules as ``embed_tokens``, ``blocks``, ``norm``, ``lm_head``.

    ``forward(tokens[B, T]) -> logits[B, T, vocab]``. A pipeline stage
    without ``embed_tokens`` takes hidden states ``[B, T, hidden]`` instead,
    and one without ``lm_head`` returns hidden states. Positions are
    ``0..T-1`` for every sequence and attention is causal (sliding-window for
    layers the config marks so); there is no padding mask and no KV cache:
    this is for training.

    Raises ValueError for a model whose input embedding and head share one
    weight (``tie_word_embeddings=True``): pipeline stages and tensor
    parallelism place them apart, so build the config with
    ``tie_word_embeddings=False`` (:func:`from_hf_state_dict` fills
    ``lm_head`` from the embedding for checkpoints of tied models).
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        config = hf_model.config
        base = getattr(hf_model, getattr(hf_model, "base_model_prefix", "model"), None)
        missing = [p for p in _PARTS if not hasattr(base, p)] + ([] if hasattr(hf_model, "lm_head") else ["lm_head"])
        if base is None or missing:
            raise ValueError(f"HFCausalLM needs a Llama-style causal LM (model.embed_tokens/layers/norm/rotary_emb and "
                             f"lm_head); {type(hf_model).__name__} lacks {missing or ['its base model']}")
        if getattr(config, "tie_word_embeddings", False) or hf_model.lm_head.weight is base.embed_tokens.weight:
            raise ValueError(f"{type(hf_model).__name__} ties lm_head to embed_tokens, which pipeline stages and tensor "
                             "parallelism place apart: build it with tie_word_embeddings=False")
        self.config = config
        # The default TP plan's whole-heads check reads `n_heads`. Key/value heads are
        # the stricter constraint: a tp dividing them also divides the query heads.
        self.n_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.layer_types = _layer_types(config)
        # Order matters: children before `blocks` go to the first pipeline stage, after it to the last.
        self.embed_tokens: nn.Module | None = base.embed_tokens
        self.blocks = nn.ModuleList(base.layers)
        self.norm: nn.Module | None = base.norm
        self.lm_head: nn.Module | None = hf_model.lm_head
        self._set_rotary(base.rotary_emb)
        #: generation runs the decoder layers it can through ``FusedDecoder`` (same values, fewer ops)
        self.fused_decode = True
        self.__dict__["_fused"] = FusedDecoder()  # not a module: holds no parameters of its own

    @property
    def rotary_emb(self) -> nn.Module:
        """HF's rotary embedding module (not a child: every pipeline stage needs it).

        ``.to(device)`` does not move it; HF's forward moves its small buffer to the input's device.
        """
        return self.__dict__["_rotary_emb"]

    def _set_rotary(self, rotary: nn.Module) -> None:
        self.__dict__["_rotary_emb"] = rotary  # bypasses nn.Module registration on purpose

    def init_buffers(self) -> None:
        """Rebuild the rotary embedding on the parameters' device (after ``to_empty`` of a meta model)."""
        param = next(self.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        with torch.device(device):
            self._set_rotary(type(self.rotary_emb)(config=self.config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        if any(b is not None for b in self.blocks):
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            position_embeddings = self.rotary_emb(x, positions)
            masks = self._masks(x, positions)
            for i, block in enumerate(self.blocks):
                if block is not None:
                    x = block(x, attention_mask=masks[self.layer_types[i]], position_ids=positions,
                              position_embeddings=position_embeddings)
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache: Any, last: torch.Tensor | None = None) -> torch.Tensor:
        """One generation pass over new tokens with a key/value cache (see ``actormesh.parallel.KVCache``).

        ``x``: token ids ``[B, T]`` (or hidden states on a later pipeline
        stage), ``positions[B, T]`` their positions, already bound to
        ``cache`` with ``cache.bind``. ``last[B]``, if given, keeps only that
        index of each row before the norm and head (the last stage's logits
        are then ``[B, 1, vocab]``).
        """
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        fusable, fuse_norm = self._fusable()
        if any(fusable):
            x = self._fused.forward(self.blocks, fusable, self.rotary_emb, self.layer_types, x, positions, cache,
                                    self._cache_mask)
        elif any(b is not None for b in self.blocks):
            position_embeddings = self.rotary_emb(x, positions)
            masks = {kind: self._cache_mask(cache, kind) for kind in set(self.layer_types)}
            for i, block in enumerate(self.blocks):
                if block is not None:
                    x = block(x, attention_mask=masks[self.layer_types[i]], position_ids=positions,
                              past_key_values=cache, position_embeddings=position_embeddings)
        if last is not None and self.norm is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        if self.norm is not None:
            x = self._fused.norm(self.norm, x) if fuse_norm else self.norm(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x

    def _fusable(self) -> tuple[list[bool], bool]:
        """Which blocks ``forward_cached`` runs through :class:`FusedDecoder`, and whether the final norm too.

        Decided once per train/eval mode. Also under ``torch.compile``: the
        fewer operations make a smaller graph that runs faster (1.71x Hugging
        Face's ``generate`` against 1.59x through HF's layers, bench/generate_bench.py).
        """
        key = (self.fused_decode, self.training)
        if self.__dict__.get("_fusable_key") != key:
            blocks = [self.fused_decode and b is not None and can_fuse(b) for b in self.blocks]
            norm = self.fused_decode and self.norm is not None and can_fuse_norm(self.norm)
            self.__dict__["_fusable_for"] = (blocks, norm)
            self.__dict__["_fusable_key"] = key
        return self.__dict__["_fusable_for"]

    @property
    def sliding_window(self) -> int | None:
        """The attention window of sliding layers (None when every layer attends to all earlier tokens)."""
        return getattr(self.config, "sliding_window", None) if "sliding_attention" in self.layer_types else None

    @property
    def max_context(self) -> int:
        """Longest sequence the rotary embedding was configured for (``max_position_embeddings``)."""
        return int(self.config.max_position_embeddings)

    def _cache_mask(self, cache: Any, kind: str) -> torch.Tensor | None:
        if self.config._attn_implementation == "sdpa":
            # boolean, True = attend: SDPA's own convention; None: HF's SDPA call sets is_causal itself
            return cache.mask(kind, allow_causal=True)
        mask = cache.mask(kind)
        # eager (and other additive-mask kernels): 0 where visible, the dtype's minimum elsewhere
        dtype = self.norm.weight.dtype if self.norm is not None else torch.float32
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)

    def _masks(self, x: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
        """HF's own masks for this config's attention implementation (None where SDPA's is_causal suffices)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = {"config": self.config, "inputs_embeds": x, "attention_mask": None, "past_key_values": None, "position_ids": positions}
        masks: dict[str, Any] = {}
        if "full_attention" in self.layer_types:
            masks["full_attention"] = create_causal_mask(**kwargs)
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks


def _layer_types(config: Any) -> list[str]:
    """Per-layer attention kind: the config's ``layer_types``, else sliding for all when it has a window."""
    n = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"] * n
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"HFCausalLM supports full and sliding-window attention layers, not {unknown}")
    return list(types)


def hf_causal_lm(config: Any, model_cls_name: str | None = None, attn_implementation: str = "sdpa") -> HFCausalLM:
    """Build a randomly initialised HF causal LM from ``config`` and wrap it in :class:`HFCausalLM`.

    ``config`` is a transformers ``PretrainedConfig`` or a dict of its fields
    (``"model_type"`` selects the architecture, default ``"llama"``).
    ``model_cls_name`` names a transformers class (``"LlamaForCausalLM"``);
    default: ``AutoModelForCausalLM`` for the config. Weights are HF's own
    initialisation, so under ``torch.manual_seed(s)`` this builds the same
    model as ``LlamaForCausalLM(config)`` does. Picklable as
    ``functools.partial(hf_causal_lm, config)``: a ``model_fn``. Nothing is
    downloaded.
    """
    if isinstance(config, Mapping):
        fields = dict(config)
        config = transformers.AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)
    else:
        config = copy.deepcopy(config)  # a copy: the attention setting below is ours
    config._attn_implementation = attn_implementation
    if model_cls_name is None:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    else:
        cls = getattr(transformers, model_cls_name, None)
        if cls is None:
            raise ValueError(f"transformers has no class {model_cls_name!r} (transformers {transformers.__version__})")
        model = cls(config)
    return HFCausalLM(model)


def from_hf_state_dict(state: Mapping[str, Any], prefix: str = "model") -> dict[str, Any]:
    """HF names (``model.layers.0...``, ``model.embed_tokens.weight``) to :class:`HFCausalLM`'s.

    A checkpoint of a tied model (no ``lm_head.weight``) gets the embedding
    as ``lm_head.weight``: the adapter trains them as two weights. Rotary
    buffers, if present, are dropped (the adapter recomputes them).
    """
    out: dict[str, Any] = {}
    for name, value in state.items():
        if "rotary_emb" in name:
            continue
        if name.startswith(f"{prefix}.layers."):
            name = "blocks." + name[len(f"{prefix}.layers."):]
        elif name.startswith(f"{prefix}."):
            name = name[len(prefix) + 1:]
        out[name] = value
    if "lm_head.weight" not in out and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"].clone()
    return out


def to_hf_state_dict(state: Mapping[str, Any], prefix: str = "model") -> dict[str, Any]:
    """:class:`HFCausalLM` names (e.g. from ``gather_state_dict(trainer)``) back to HF's, for ``from_pretrained``-style loading."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        if name.startswith("blocks."):
            name = f"{prefix}.layers." + name[len("blocks."):]
        elif not name.startswith("lm_head."):
            name = f"{prefix}.{name}"
        out[name] = value
    return out
