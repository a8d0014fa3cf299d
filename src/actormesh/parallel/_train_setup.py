"""What a trainer learns about the model before any collective: the plan checked against it, on meta.

Every rank runs :func:`probe_model` on the meta device before the process
group exists, so a plan that does not fit the model fails on all ranks alike
with a :class:`PlanError` that says what to change, instead of hanging one
rank in a collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..mesh import ProcMesh
from ._plan import Plan, PlanError
from ._train_options import TrainOptions
from ._train_checkpoint import model_shapes

__all__ = ["ModelProbe", "check_trainer_args", "probe_model"]


@dataclass(frozen=True)
class ModelProbe:
    """``stages``: pipeline stage boundaries (None without a pipeline); ``n_params`` and
    ``shapes`` (``{fqn: shape}``) of the full model, for MFU and checkpoint checks."""

    stages: list[range] | None
    n_params: int
    shapes: dict[str, tuple[int, ...]]


def probe_model(model_fn: Callable[[], Any], plan: Plan, stage_ranges: Sequence[range] | None) -> ModelProbe:
    """Build the model on meta and check ``plan`` (world size, blocks, TP plan, stages) against it."""
    import torch

    from ._pipeline import check_stages, count_blocks, equal_stages
    from ._tp import check_tp, resolve_tp_plan

    plan.check_world(int(os.environ["WORLD_SIZE"]))
    with torch.device("meta"):
        probe = model_fn()
    if not isinstance(probe, torch.nn.Module):
        raise PlanError(f"model_fn must return a torch.nn.Module, got {type(probe).__name__}")
    n_blocks = count_blocks(probe)
    plan.check_blocks(n_blocks)
    if plan.tp > 1:
        tp_plan = resolve_tp_plan(probe, plan.tp_plan)
        if isinstance(tp_plan, dict):
            if not tp_plan:
                raise PlanError(f"tp={plan.tp} but the tensor-parallel plan matches no module of the model: check the names in Plan(tp_plan=...)")
            check_tp(probe, tp_plan, plan.tp)
    stages = None
    if plan.pp > 1:
        assert n_blocks is not None
        stages = equal_stages(n_blocks, plan.n_stages) if stage_ranges is None else check_stages(stage_ranges, n_blocks, plan.n_stages)
    return ModelProbe(stages, sum(p.numel() for p in probe.parameters()), model_shapes(probe))


def check_trainer_args(procs: Any, plan: Any, fns: tuple[Any, Any, Any], options: Any, data: Any) -> None:
    """TypeError or PlanError for arguments of spawn_trainer that cannot work, before anything is spawned."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an actormesh.parallel.Plan, got {type(plan).__name__}")
    if not isinstance(procs, ProcMesh):
        raise TypeError(f"spawn_trainer needs a ProcMesh (this_host().spawn_procs(...)), got {type(procs).__name__}")
    for label, fn in zip(("model_fn", "loss_fn", "optimizer_fn"), fns):
        if not callable(fn):
            raise TypeError(f"{label} must be callable, got {fn!r}")
    if data is not None and not callable(data):
        raise TypeError(f"data must be a factory (dp_rank=, dp_size=, start_step=) -> iterable of (inputs, targets), got {data!r}")
    if options is not None and not isinstance(options, TrainOptions):
        raise TypeError(f"options must be an actormesh.parallel.TrainOptions, got {type(options).__name__}")
    plan.check_world(len(procs))
