"""One inference replica under a plan: its stage boundaries, this rank's chunk, weights in and out.

A replica spans ``tp * pp`` procs (data parallelism is replicas, not a plan
axis here). The chunk is built as the trainer builds it: the model on the
meta device, cut to this rank's pipeline stage (the same boundaries as
training: an equal split, boundaries given, or ``stages="memory"`` to let the
partitioner balance parameter bytes), tensor-parallelised with DTensor,
then materialised. Weights are copied in locally on every rank
(:func:`load_weights`: each rank keeps its own shard of each full tensor), so
loading needs no collective and can happen between two decode steps.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._generate import StageLinks
from ._pipeline import check_stages, count_blocks, cut_to_stage, equal_stages
from ._plan import Plan, PlanError

__all__ = ["check_inference_plan", "replica_stages", "build_chunk", "stage_links", "check_weights", "load_weights", "read_weights",
           "hidden_size_of"]


def check_inference_plan(plan: Plan) -> None:
    """Raise PlanError for plan parts that do not apply within one inference replica."""
    if plan.dp > 1 or plan.fsdp > 1:
        raise PlanError(f"{plan!s}: a generation replica is parallel only by tp and pp; for data parallelism "
                        "run several replicas (a serve Service) instead of dp/fsdp")
    if plan.n_stages_per_rank != 1:
        raise PlanError(f"{plan!s}: generation runs one pipeline stage per pp rank; use pp_schedule='1F1B' or 'GPipe'")


def _block_bytes(model: Any) -> list[float]:
    return [float(sum(p.numel() * p.element_size() for p in b.parameters())) for b in model.blocks]


def replica_stages(model: Any, plan: Plan, stages: Sequence[range] | str | None = None,
                   memory_limit_bytes: float | Sequence[float] | None = None) -> list[range] | None:
    """Block ranges per pipeline stage (None without a pipeline).

    ``stages``: None for an equal split, explicit ``range``s, or ``"memory"``:
    the partitioner balances the blocks' parameter bytes (under
    ``memory_limit_bytes`` per stage when given: one number or one per stage).
    """
    n_blocks = count_blocks(model)
    plan.check_blocks(n_blocks)
    if plan.pp == 1:
        return None
    assert n_blocks is not None
    if stages is None:
        return equal_stages(n_blocks, plan.pp)
    if stages == "memory":
        from ._partition import partition

        sizes = _block_bytes(model)
        return partition(sizes, plan.pp, memory=sizes, memory_limit=memory_limit_bytes)
    if isinstance(stages, str):
        raise PlanError(f"stages={stages!r}: give None (equal split), 'memory' (balance parameter bytes) or a list of ranges")
    return check_stages(stages, n_blocks, plan.pp)


def build_chunk(model_fn: Callable[[], Any], plan: Plan, ranges: list[range] | None, mesh: Any, device: Any) -> Any:
    """This rank's chunk (stage ``pp`` coordinate of ``mesh``), tensor-parallel, allocated (weights not loaded)."""
    import torch

    from ._apply import materialize
    from ._tp import apply_tp, check_tp, resolve_tp_plan
    from ._tp_infer import local_tp_forwards

    with torch.device("meta"):
        chunk = model_fn()
    if ranges is not None:
        sid = mesh["pp"].get_local_rank()
        cut_to_stage(chunk, ranges[sid], sid == 0, sid == plan.pp - 1)
    if plan.tp > 1:
        tp_plan = resolve_tp_plan(chunk, plan.tp_plan)
        if isinstance(tp_plan, dict):
            check_tp(chunk, tp_plan, plan.tp)
        apply_tp(chunk, mesh["tp"], tp_plan)
        if isinstance(tp_plan, dict):
            local_tp_forwards(chunk, mesh["tp"], tp_plan)
    materialize(chunk, device)
    return chunk.eval()


def stage_links(plan: Plan, rank: int, hidden_size: int, dtype: Any) -> StageLinks:
    """Global ranks of this rank's pipeline neighbours and of the sampling rank (mesh ``(pp, 1, 1, tp)``)."""
    pp_rank, tp_rank = divmod(rank, plan.tp)
    prev_rank = (pp_rank - 1) * plan.tp + tp_rank if pp_rank > 0 else None
    next_rank = (pp_rank + 1) * plan.tp + tp_rank if pp_rank < plan.pp - 1 else None
    return StageLinks(rank, prev_rank, next_rank, (plan.pp - 1) * plan.tp, hidden_size, dtype)


def _hf_names(chunk: Any, state: Mapping[str, Any]) -> Mapping[str, Any]:
    """Hugging Face checkpoint names converted for an ``HFCausalLM`` chunk (other states unchanged)."""
    if type(chunk).__name__ == "HFCausalLM" and any(k.startswith("model.") for k in state):
        from .hf import from_hf_state_dict

        return from_hf_state_dict(state)
    return state


def weight_targets(chunks: Sequence[Any], state: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(name, source, destination)`` for every parameter and buffer of the chunks (sources from
    ``state``, which may hold meta tensors: only names and shapes are looked at).

    Raises ValueError naming the first entry that is missing or has another shape.
    """
    import torch

    out = []
    for chunk in chunks:
        named = _hf_names(chunk, state)
        targets = chunk.state_dict(keep_vars=True)
        missing = sorted(k for k in targets if k not in named)
        if missing:
            raise ValueError(f"the weights lack {len(missing)} entries of the model, e.g. {missing[:3]}: "
                             "pass the full model's state dict (names as in model.state_dict())")
        for name, dst in targets.items():
            src = named[name]
            if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"weights[{name!r}] has shape {tuple(getattr(src, 'shape', ()))}, the model's is {tuple(dst.shape)}")
            out.append((name, src, dst))
    return out


def shard_of(dst: Any, src: Any) -> tuple[Any, Any]:
    """``(memory to copy into, what to copy)`` for one full tensor ``src`` and a (DTensor) parameter or buffer."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(dst, DTensor):
        local = distribute_tensor(src.detach().to(dst.dtype), dst.device_mesh, dst.placements, src_data_rank=None).to_local()
        return dst.to_local(), local
    return (dst.data if isinstance(dst, torch.nn.Parameter) else dst), src


def _weight_copies(chunks: Sequence[Any], state: Mapping[str, Any]) -> list[tuple[Any, Any]]:
    """(destination, source) pairs for every parameter and buffer; ValueError naming what does not fit."""
    return [shard_of(dst, src) for _, src, dst in weight_targets(chunks, state)]


def check_weights(chunks: Sequence[Any], state: Mapping[str, Any]) -> None:
    """Raise ValueError if :func:`load_weights` would refuse ``state`` for these chunks (nothing is copied)."""
    weight_targets(chunks, state)


def load_weights(chunks: Sequence[Any], state: Mapping[str, Any]) -> None:
    """Copy full tensors from ``state`` into the chunks' (possibly DTensor-sharded) parameters and buffers.

    Each rank takes its own shard of each full tensor: no communication.
    Raises ValueError naming missing or wrongly shaped entries (nothing is
    changed then). Accepts Hugging Face names for ``HFCausalLM`` chunks.
    """
    import torch

    copies = _weight_copies(chunks, state)
    with torch.no_grad():
        for dst, src in copies:
            dst.copy_(src)


def read_weights(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A state dict from a file (``.safetensors``, or ``torch.save``'d) or a directory holding one
    (``model.safetensors``, ``pytorch_model.bin``, ``model.pt``); read memory-mapped where possible."""
    import torch

    path = os.fspath(path)
    if os.path.isdir(path):
        for name in ("model.safetensors", "pytorch_model.bin", "model.pt"):
            if os.path.exists(os.path.join(path, name)):
                path = os.path.join(path, name)
                break
        else:
            raise FileNotFoundError(f"{path} holds none of model.safetensors, pytorch_model.bin, model.pt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no weights file at {path}")
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise ImportError(f"reading {path} needs the safetensors package (pip install safetensors)") from exc
        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, Mapping):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict")
    return dict(state)


def hidden_size_of(model: Any) -> int:
    """Width of the hidden states a pipeline stage passes on."""
    config = getattr(model, "config", None)
    for attr in ("hidden_size", "d_model"):
        if getattr(config, attr, None) is not None:
            return int(getattr(config, attr))
    raise PlanError(f"cannot tell the hidden size of {type(model).__name__}: its config has no hidden_size or d_model")
