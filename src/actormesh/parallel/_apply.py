"""Applying a plan to one model chunk with torch's own APIs, in torchtitan's order.

1. tensor parallel: ``parallelize_module`` on the ``tp`` mesh dim;
2. activation checkpointing: ``checkpoint_wrapper`` around each block;
3. ``torch.compile`` of each block (repeated structure compiles once); with
   TP *and* checkpointing the compiled block goes inside the wrapper (a torch
   2.13 limitation, see ``parallelize_chunk``);
4. FSDP2: ``fully_shard`` each block, then the chunk, on ``dp_shard`` (or the
   2-D ``(dp_replicate, dp_shard)`` mesh: HSDP, which is how data parallel
   replication composes with TP and PP);
5. only when data parallel is the only axis: ``DistributedDataParallel``,
   applied after the weights are materialised (DDP broadcasts them).

Steps 1-4 run on the meta device; :func:`materialize` then allocates the
local shards and loads rank 0's weights into them.
"""

from __future__ import annotations

from typing import Any

from ._plan import Plan
from ._tp import apply_tp, check_tp, resolve_tp_plan

__all__ = ["world_mesh", "parallelize_chunk", "materialize", "wrap_ddp", "replace_blocks"]


def world_mesh(plan: Plan, device_type: str) -> Any:
    """The 4-D DeviceMesh ``(pp, dp_replicate, dp_shard, tp)`` over the default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    from ._plan import MESH_DIMS

    return init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=MESH_DIMS)


def replace_blocks(chunk: Any, wrap: Any) -> None:
    """``chunk.blocks[i] = wrap(block)`` for every present block (keeps the ModuleList)."""
    blocks = getattr(chunk, "blocks", None)
    if blocks is None:
        return
    for i, block in enumerate(blocks):
        if block is not None:
            blocks[i] = wrap(block)


def _present_blocks(chunk: Any) -> list[Any]:
    blocks = getattr(chunk, "blocks", None)
    return [b for b in blocks if b is not None] if blocks is not None else []


def _compile_blocks(chunk: Any, plan: Plan) -> None:
    """``torch.compile`` each block in place (``Module.compile`` keeps parameter names)."""
    backend = plan.compile if isinstance(plan.compile, str) else "inductor"
    for block in _present_blocks(chunk):
        block.compile(backend=backend)


def parallelize_chunk(chunk: Any, plan: Plan, mesh: Any) -> Any:
    """Apply TP, activation checkpointing, compile and FSDP to ``chunk`` (on meta), in that order."""
    if plan.tp > 1:
        tp_plan = resolve_tp_plan(chunk, plan.tp_plan)
        if isinstance(tp_plan, dict):
            check_tp(chunk, tp_plan, plan.tp)
        apply_tp(chunk, mesh["tp"], tp_plan)
    # torch 2.13 cannot compile a checkpoint-wrapped block whose graph holds DTensor
    # redistributions (AOT autograd tries to save the DeviceMesh for backward), so
    # under TP the compiled block goes inside the checkpoint wrapper instead.
    compile_inside_ac = plan.tp > 1 and plan.activation_checkpointing
    if plan.compile and compile_inside_ac:
        _compile_blocks(chunk, plan)
    if plan.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        replace_blocks(chunk, lambda b: checkpoint_wrapper(b, preserve_rng_state=False))
    if plan.compile and not compile_inside_ac:
        _compile_blocks(chunk, plan)
    if plan.uses_fsdp:
        from torch.distributed.fsdp import fully_shard

        dp_mesh = mesh["dp_replicate", "dp_shard"] if plan.dp > 1 else mesh["dp_shard"]
        # With a pipeline, keep gathered params between microbatches (torchtitan's default).
        reshard = plan.pp == 1
        for block in _present_blocks(chunk):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=reshard)
    return chunk


def materialize(chunk: Any, device: Any) -> None:
    """Allocate ``chunk``'s (sharded) parameters on ``device``; values are loaded afterwards."""
    chunk.to_empty(device=device)
    init = getattr(chunk, "init_buffers", None)
    if callable(init):  # non-persistent buffers are not in a state dict: the model recreates them
        init()


def wrap_ddp(chunk: Any, plan: Plan, mesh: Any, device: Any) -> Any:
    """``DistributedDataParallel`` over the ``dp_replicate`` dim (the plan's only axis)."""
    from torch.nn.parallel import DistributedDataParallel

    if plan.compile:
        import torch._dynamo

        torch._dynamo.config.optimize_ddp = "ddp_optimizer"
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(chunk, process_group=mesh["dp_replicate"].get_group(), device_ids=ids)
