"""Pipeline stages: which blocks each stage holds, cutting a model down to a stage, schedules.

Stage boundaries are a list of ``range``s over block indices, one per stage,
contiguous and covering every block (the format an automatic partitioner's
``partition(costs, num_stages)`` returns). Stage ``s`` runs on pp rank
``s % pp`` (the "loop" assignment torch's interleaved schedules expect).

A stage keeps the model's fully qualified parameter names: blocks of other
stages are replaced by ``None`` in the ``blocks`` ModuleList, not removed, so a
checkpoint written under one pipeline layout loads under another. Top-level
modules registered before ``blocks`` go to the first stage, those after it to
the last; the model's ``forward`` must skip ``None`` modules (as
:class:`actormesh.parallel.models.GPT` does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._plan import SINGLE_STAGE_SCHEDULES, Plan, PlanError

__all__ = ["equal_stages", "check_stages", "stage_ids", "cut_to_stage", "build_schedule", "count_blocks"]


def count_blocks(model: Any) -> int | None:
    """Length of ``model.blocks`` if it is an ``nn.ModuleList``, else None."""
    from torch import nn

    blocks = getattr(model, "blocks", None)
    return len(blocks) if isinstance(blocks, nn.ModuleList) else None


def equal_stages(n_blocks: int, n_stages: int) -> list[range]:
    """Split ``n_blocks`` blocks into ``n_stages`` contiguous ranges, earlier ones one longer if uneven.

    >>> equal_stages(5, 2)
    [range(0, 3), range(3, 5)]
    """
    if not 1 <= n_stages <= n_blocks:
        raise PlanError(f"cannot split {n_blocks} blocks into {n_stages} non-empty stages")
    from ._partition import even_split

    return even_split(n_blocks, n_stages)


def check_stages(stages: Sequence[range], n_blocks: int, n_stages: int) -> list[range]:
    """Validate user-given boundaries: ``n_stages`` contiguous, non-empty ranges covering all blocks."""
    stages = [range(r.start, r.stop) if isinstance(r, range) else range(*r) for r in stages]
    if len(stages) != n_stages:
        raise PlanError(f"stages has {len(stages)} ranges but the plan runs {n_stages} pipeline stages "
                        "(pp x stages_per_rank): give one range of block indices per stage")
    expect = 0
    for i, r in enumerate(stages):
        if r.step != 1 or r.start != expect or r.stop <= r.start:
            raise PlanError(f"stages[{i}] = {r} is not a non-empty range starting at block {expect}: "
                            f"stages must be contiguous, in order and cover blocks 0..{n_blocks - 1}, e.g. {equal_stages(n_blocks, n_stages)}")
        expect = r.stop
    if expect != n_blocks:
        raise PlanError(f"stages cover blocks 0..{expect - 1} but the model has {n_blocks} blocks: the last range must end at {n_blocks}")
    return stages


def stage_ids(pp_rank: int, plan: Plan) -> list[int]:
    """Stages held by pp rank ``pp_rank``: ``pp_rank, pp_rank + pp, ...`` (loop assignment)."""
    return [pp_rank + k * plan.pp for k in range(plan.n_stages_per_rank)]


def cut_to_stage(model: Any, blocks: range, first: bool, last: bool) -> Any:
    """Cut ``model`` (in place) down to one stage: other blocks and pre/post modules become None."""
    children = list(model.named_children())
    names = [n for n, _ in children]
    if "blocks" not in names:
        raise PlanError("pipeline parallelism splits the model's `blocks` ModuleList, but the model has no `blocks` attribute")
    at = names.index("blocks")
    for i, (name, _) in enumerate(children):
        if (i < at and not first) or (i > at and not last):
            setattr(model, name, None)
    for i in range(len(model.blocks)):
        if i not in blocks:
            model.blocks[i] = None
    return model


def build_schedule(stages: list[Any], plan: Plan, loss_fn: Callable[..., Any]) -> Any:
    """torch's schedule ``plan.pp_schedule`` over this rank's ``PipelineStage``s."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    cls = get_schedule_class(plan.pp_schedule)
    if plan.pp_schedule in SINGLE_STAGE_SCHEDULES:
        return cls(stages[0], n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=True)
