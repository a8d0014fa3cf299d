"""Layer-wise tensor-parallel plans: the default for transformer blocks, user plans, checks.

The default plan is Megatron's: in every block the attention's q/k/v
projections are split by output features (colwise) and its output projection
by input features (rowwise), the MLP's up (and gate) projections colwise and
its down projection rowwise; so each block needs one all-reduce forward and
one backward per sub-layer. The token embedding is split rowwise (by
vocabulary) and the vocabulary head colwise with a replicated output.
Everything else (norms, position embeddings) stays replicated.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

from ._plan import PlanError

__all__ = ["COLWISE_NAMES", "ROWWISE_NAMES", "default_tp_plan", "resolve_tp_plan", "check_tp", "apply_tp"]

#: Leaf names of Linear layers in blocks that the default plan splits colwise / rowwise.
COLWISE_NAMES = frozenset({"q", "k", "v", "wq", "wk", "wv", "q_proj", "k_proj", "v_proj", "query", "key", "value",
                           "up", "gate", "w1", "w3", "up_proj", "gate_proj", "fc1", "c_fc"})
ROWWISE_NAMES = frozenset({"o", "wo", "o_proj", "out_proj", "down", "w2", "down_proj", "fc2"})
_EMBEDDING_NAMES = frozenset({"tok_emb", "tok_embeddings", "embed_tokens", "wte"})
_HEAD_NAMES = frozenset({"head", "output", "lm_head"})


def default_tp_plan(model: Any) -> dict[str, str]:
    """``{fqn: "colwise"|"rowwise"|"embedding"|"head"}`` for a standard transformer.

    Walks ``model.blocks`` (``None`` entries, i.e. other pipeline stages, are
    skipped) and the top-level embedding/head. Raises PlanError when no block
    layer has a known name: pass ``Plan(tp_plan=...)`` for such models.
    """
    from torch import nn

    plan: dict[str, str] = {}
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        for i, block in enumerate(blocks):
            if block is None:
                continue
            for name, mod in block.named_modules():
                leaf = name.rsplit(".", 1)[-1]
                if isinstance(mod, nn.Linear) and leaf in COLWISE_NAMES:
                    plan[f"blocks.{i}.{name}"] = "colwise"
                elif isinstance(mod, nn.Linear) and leaf in ROWWISE_NAMES:
                    plan[f"blocks.{i}.{name}"] = "rowwise"
        if not plan and any(b is not None for b in blocks):
            raise PlanError("tp > 1 but the default tensor-parallel plan found no q/k/v/o or up/down Linear layers in model.blocks: "
                            "pass Plan(tp_plan={'blocks.*.<name>': 'colwise' | 'rowwise', ...}) for this model")
    elif blocks is None:
        raise PlanError("tp > 1 with the default plan needs the model's blocks in `self.blocks = nn.ModuleList(...)`; "
                        "otherwise pass Plan(tp_plan={...}) naming the layers to split")
    for name, mod in model.named_children():
        if name in _EMBEDDING_NAMES and isinstance(mod, nn.Embedding):
            plan[name] = "embedding"
        elif name in _HEAD_NAMES and isinstance(mod, nn.Linear):
            plan[name] = "head"
    return plan


def _expand(model: Any, patterns: Mapping[str, Any]) -> dict[str, Any]:
    """Expand ``*`` patterns to the module names they match in ``model`` (skipping ``None`` modules)."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, Any] = {}
    for pattern, style in patterns.items():
        if not isinstance(pattern, str):
            raise PlanError(f"tp_plan keys are module names or patterns like 'blocks.*.attn.q', got {pattern!r}")
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)] if any(c in pattern for c in "*?[") else ([pattern] if pattern in names else [])
        out.update((n, style) for n in matched)
    return out


def resolve_tp_plan(model: Any, user_plan: Mapping[str, Any] | Callable[..., Any] | None) -> dict[str, Any] | Callable[..., Any]:
    """The concrete ``{fqn: style}`` for ``model`` (or the user's callable unchanged)."""
    if callable(user_plan) and not isinstance(user_plan, Mapping):
        return user_plan
    if user_plan is None:
        return default_tp_plan(model)
    return _expand(model, user_plan)


def _style(kind: Any) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

    if isinstance(kind, ParallelStyle):
        return kind
    styles = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "sequence": lambda: SequenceParallel(),
        "embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
        "head": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_replicate": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_shard": lambda: RowwiseParallel(output_layouts=Shard(1)),
    }
    make = styles.get(str(kind).lower())
    if make is None:
        raise PlanError(f"unknown tensor-parallel style {kind!r}: use one of {sorted(styles)} or a torch ParallelStyle")
    return make()


def _split_dim(kind: Any) -> str | None:
    """Which feature dim a style splits: "out" (colwise), "in" (rowwise) or None."""
    name = kind.lower() if isinstance(kind, str) else type(kind).__name__.lower()
    if "colwise" in name or name == "head":
        return "out"
    if "rowwise" in name or name == "embedding":
        return "in"
    return None


def check_tp(model: Any, plan: Mapping[str, Any], tp: int) -> None:
    """Raise PlanError when ``tp`` does not divide a split dimension or the head count."""
    from torch import nn

    modules = dict(model.named_modules())
    for name, kind in plan.items():
        mod, where = modules.get(name), _split_dim(kind)
        if where is None:
            continue
        if isinstance(mod, nn.Linear):
            attr, why = ("out_features", "colwise") if where == "out" else ("in_features", "rowwise")
            size = getattr(mod, attr)
        elif isinstance(mod, nn.Embedding):
            attr, why, size = "num_embeddings", "rowwise: the vocabulary is split", mod.num_embeddings
        else:
            continue
        if size % tp:
            raise PlanError(f"tp={tp} does not divide {name}.{attr} = {size} ({why}): choose tp from the divisors of {size}")
    for name, mod in modules.items():
        heads = getattr(mod, "n_heads", None)
        if isinstance(heads, int) and heads % tp:
            raise PlanError(f"tp={tp} does not divide the {heads} attention heads of {name or 'the model'}: "
                            f"each tensor-parallel rank must hold whole heads; choose tp from the divisors of {heads}")


def apply_tp(model: Any, tp_mesh: Any, plan: Mapping[str, Any] | Callable[..., Any]) -> None:
    """Apply ``plan`` with ``torch.distributed.tensor.parallel.parallelize_module``."""
    from torch.distributed.tensor.parallel import parallelize_module

    if callable(plan) and not isinstance(plan, Mapping):
        plan(model, tp_mesh)
        return
    if plan:
        parallelize_module(model, tp_mesh, {name: _style(kind) for name, kind in plan.items()})
