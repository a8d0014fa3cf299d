"""One training step on a rank: micro-steps, precision, global-norm clipping, LR schedules.

Theory of operation. A step takes this data-parallel rank's share of the
batch and splits it into ``grad_accum_steps`` micro-steps. Without a
pipeline each micro-step runs forward and backward with the loss divided by
the number of micro-steps (so the summed gradient is the mean's), and DDP
all-reduces only on the last (``no_sync``). With a pipeline each micro-step
is one ``schedule.step``; the schedule is built with ``scale_grads=False``
and a loss divided by ``microbatches * micro-steps``, because torch's own
scaling divides *all* gradients after every ``step`` and would shrink those
accumulated by the earlier micro-steps.

The gradient norm is the norm of the whole model's gradient: torch's
``get_total_norm`` on each group of gradients sharing a DeviceMesh (a DTensor
norm, made whole with ``full_tensor``, so FSDP and TP shards count once),
plain tensors as one more group, the squares summed, then summed over the
pipeline group, whose ranks hold disjoint stages. ``clip_grads_with_norm_``
then scales every gradient by the same factor on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ._plan import Plan, PlanError
from ._train_options import LRSchedule, TrainOptions

__all__ = ["parallelize_for_training", "install_reduce_hook", "make_schedulers", "build_train_schedule", "pipeline_loss_scale",
           "precision_context", "forward_backward", "pipeline_step", "clip_grad_norm", "check_accum", "share_of"]


def parallelize_for_training(chunk: Any, plan: Plan, mesh: Any, options: TrainOptions) -> None:
    """``parallelize_chunk`` with FSDP2's ``MixedPrecisionPolicy`` when the options ask for one.

    The shared ``parallelize_chunk`` applies FSDP with the default policy; with
    mixed precision it runs without the data-parallel degrees (TP,
    checkpointing, compile) and this applies ``fully_shard`` the same way
    (each block, then the chunk) with the policy.
    """
    from ._apply import parallelize_chunk

    if not (plan.uses_fsdp and options.mixed_precision):
        parallelize_chunk(chunk, plan, mesh)
        return
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    parallelize_chunk(chunk, dataclasses.replace(plan, dp=1, fsdp=1), mesh)
    dtype = (lambda name: None if name is None else getattr(torch, name))
    policy = MixedPrecisionPolicy(param_dtype=dtype(options.param_dtype), reduce_dtype=dtype(options.reduce_dtype))
    dp_mesh = mesh["dp_replicate", "dp_shard"] if plan.dp > 1 else mesh["dp_shard"]
    reshard = plan.pp == 1  # as parallelize_chunk: a pipeline keeps gathered params between microbatches
    blocks = getattr(chunk, "blocks", None) or []
    for block in blocks:
        if block is not None:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)


def install_reduce_hook(ddp: Any, options: TrainOptions, group: Any, device: Any) -> None:
    """Under DDP, a 16-bit ``reduce_dtype`` all-reduces gradients compressed (torch's comm hooks).

    Raises PlanError for bf16 off CUDA: torch's bf16 hook needs NCCL.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if options.reduce_dtype == "bfloat16" and device.type != "cuda":
        raise PlanError("TrainOptions(reduce_dtype='bf16') under DDP uses torch's bf16 all-reduce hook, which needs CUDA and NCCL; "
                        "on CPU use reduce_dtype='fp16' or 'fp32', or a plan with fsdp > 1 (FSDP2 reduces in bf16 on any backend)")
    hooks = {"bfloat16": default_hooks.bf16_compress_hook, "float16": default_hooks.fp16_compress_hook}
    hook = hooks.get(options.reduce_dtype or "")
    if hook is not None:
        ddp.register_comm_hook(group, hook)


def precision_context(options: TrainOptions, plan: Plan, device: Any) -> Callable[[], Any]:
    """A context factory for the forward: ``torch.autocast`` unless FSDP2's policy already casts."""
    import torch

    if options.param_dtype is None or options.param_dtype == "float32" or plan.uses_fsdp:
        return contextlib.nullcontext
    dtype = getattr(torch, options.param_dtype)
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def make_schedulers(optimizers: Sequence[Any], options: TrainOptions) -> list[Any]:
    """One LR scheduler per optimizer (a pipeline rank may hold several chunks), or none."""
    schedule = options.lr_schedule
    if schedule is None:
        return []
    if isinstance(schedule, LRSchedule):
        from torch.optim.lr_scheduler import LambdaLR

        return [LambdaLR(opt, schedule.factor) for opt in optimizers]
    made = [schedule(opt) for opt in optimizers]
    for m in made:
        if not (callable(getattr(m, "step", None)) and callable(getattr(m, "state_dict", None))):
            raise TypeError(f"TrainOptions(lr_schedule=...) must make a torch.optim.lr_scheduler.LRScheduler, "
                            f"its factory returned {type(m).__name__}")
    return made


class ScaledLoss:
    """``loss_fn(outputs, targets) * scale``: a pipeline's per-microbatch loss, pre-divided."""

    def __init__(self, loss_fn: Callable[[Any, Any], Any], scale: float) -> None:
        self.loss_fn, self.scale = loss_fn, scale

    def __call__(self, outputs: Any, targets: Any) -> Any:
        return self.loss_fn(outputs, targets) * self.scale


def pipeline_loss_scale(plan: Plan, accum: int) -> float:
    """What each microbatch's loss is multiplied by so the summed gradients are the batch mean's."""
    return 1.0 / (plan.n_microbatches * accum)


def build_train_schedule(stages: list[Any], plan: Plan, loss_fn: Callable[..., Any], accum: int) -> Any:
    """torch's ``plan.pp_schedule`` over ``stages``, scaling the loss itself (see the module docstring)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    from ._plan import SINGLE_STAGE_SCHEDULES

    cls = get_schedule_class(plan.pp_schedule)
    loss = ScaledLoss(loss_fn, pipeline_loss_scale(plan, accum))
    held = stages[0] if plan.pp_schedule in SINGLE_STAGE_SCHEDULES else stages
    return cls(held, n_microbatches=plan.n_microbatches, loss_fn=loss, scale_grads=False)


def share_of(batch: Any, plan: Plan, dp_rank: int) -> tuple[Any, Any]:
    """Data-parallel rank ``dp_rank``'s contiguous ``1/dp_size`` of a global ``(inputs, targets)`` batch."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"step(batch) expects (inputs, targets), got {type(batch).__name__}")
    inputs, targets = batch
    plan.check_batch(int(inputs.shape[0]))
    n = inputs.shape[0] // plan.dp_size
    return inputs[dp_rank * n:(dp_rank + 1) * n], targets[dp_rank * n:(dp_rank + 1) * n]


def check_accum(local_batch: int, plan: Plan, accum: int) -> None:
    """Raise PlanError unless a rank's share splits into ``accum`` micro-steps (and their microbatches)."""
    per = plan.n_microbatches if plan.pp > 1 else 1
    if local_batch % (accum * per):
        raise PlanError(f"each data-parallel rank gets {local_batch} samples, which do not split into grad_accum_steps={accum} "
                        f"micro-steps" + (f" of {per} pipeline microbatches" if per > 1 else "")
                        + f": use a batch size that is a multiple of {plan.dp_size * accum * per}")


def forward_backward(model: Any, loss_fn: Callable[[Any, Any], Any], x: Any, y: Any, accum: int,
                     autocast: Callable[[], Any], ddp: bool) -> float:
    """Micro-steps without a pipeline; returns the mean loss over this rank's share."""
    total: Any = 0.0
    for i, (xi, yi) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
        last = i == accum - 1
        with (contextlib.nullcontext() if last or not ddp else model.no_sync()):
            with autocast():
                loss = loss_fn(model(xi), yi)
            (loss / accum).backward()
        total = total + loss.detach().float()
    return float(total) / accum


def pipeline_step(schedule: Any, stages: Sequence[Any], x: Any, y: Any, accum: int, autocast: Callable[[], Any],
                  loss_scale: float) -> float | None:
    """Micro-steps through the pipeline; the mean loss on ranks holding the last stage, else None.

    ``loss_scale`` is the factor :func:`build_train_schedule` put in the loss; it is taken out of the figure.
    """
    import torch

    first = any(s.is_first for s in stages)
    has_loss = any(s.is_last for s in stages)
    losses: list[Any] = []
    for xi, yi in zip(x.chunk(accum), y.chunk(accum)):
        mine: list[Any] = []  # torch clears the list it is given on every step
        kwargs = {"target": yi, "losses": mine} if has_loss else {}
        with autocast():
            schedule.step(*((xi,) if first else ()), **kwargs)
        losses += mine
    if not has_loss:
        return None
    return float(torch.stack([mb.detach().float() for mb in losses]).mean()) / loss_scale


def _norm_groups(params: Sequence[Any]) -> list[list[Any]]:
    """Parameters with gradients, grouped by their gradient's DeviceMesh (plain tensors: one group), in order."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[Any]] = {}
    for p in params:
        g = p.grad
        if g is not None:
            groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(p)
    return list(groups.values())


def clip_grad_norm(params: Sequence[Any], max_norm: float | None, pp_group: Any, device: Any) -> float:
    """The whole model's gradient L2 norm (every shard, every stage); clips to ``max_norm`` when given."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    square = torch.zeros((), dtype=torch.float32, device=device)
    groups = _norm_groups(params)
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        square = square + norm.to(device=device, dtype=torch.float32) ** 2
    if pp_group is not None:
        dist.all_reduce(square, group=pp_group)
    total = square.sqrt()
    if max_norm is not None:
        for group in groups:  # per group: torch's foreach kernels do not mix DTensors and tensors
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return float(total)
