"""``TrainOptions``: what a trainer does each step besides the plan, checked when it is made.

Pure Python (no torch import), so bad settings are refused on the controller,
before any proc is touched. The ranks turn the options into torch objects
(schedulers, precision policies) in :mod:`._train_step`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["TrainOptions", "TrainOptionsError", "LRSchedule", "DTYPE_NAMES", "dtype_name"]

#: Accepted spellings of the floating point dtypes, mapped to torch's attribute name.
DTYPE_NAMES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}
DECAYS = ("cosine", "linear", "constant")


class TrainOptionsError(ValueError):
    """A training option makes no sense; the message names it and says what to give instead."""


def dtype_name(label: str, value: Any) -> str | None:
    """``"bf16"``, ``torch.bfloat16`` or None -> ``"bfloat16"`` / None; anything else is refused."""
    if value is None:
        return None
    text = str(value).removeprefix("torch.").lower()
    if text not in DTYPE_NAMES:
        raise TrainOptionsError(f"TrainOptions({label}={value!r}) is not a floating point dtype I know: "
                                f"use one of {sorted(set(DTYPE_NAMES))} or the torch dtype")
    return DTYPE_NAMES[text]


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up to the optimizer's learning rate, then decay to ``min_lr_ratio`` of it.

    The factor for step ``s`` (0-based, counted in optimizer steps) is
    ``(s + 1) / warmup_steps`` during warm-up, then falls over the remaining
    ``total_steps - warmup_steps`` steps by ``decay`` ("cosine", "linear" or
    "constant") and stays at ``min_lr_ratio`` after ``total_steps``.

    Example::

        LRSchedule(warmup_steps=100, total_steps=10_000, decay="cosine", min_lr_ratio=0.1)
    """

    warmup_steps: int = 0
    total_steps: int | None = None
    decay: str = "cosine"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise TrainOptionsError(f"LRSchedule(warmup_steps={self.warmup_steps!r}) must be an int >= 0")
        if self.decay not in DECAYS:
            raise TrainOptionsError(f"LRSchedule(decay={self.decay!r}) must be one of {list(DECAYS)}")
        if self.decay != "constant":
            if not isinstance(self.total_steps, int) or isinstance(self.total_steps, bool) or self.total_steps <= self.warmup_steps:
                raise TrainOptionsError(f"LRSchedule(decay={self.decay!r}) needs total_steps > warmup_steps={self.warmup_steps}, "
                                        f"got total_steps={self.total_steps!r}: give the run's length in optimizer steps")
        if not isinstance(self.min_lr_ratio, (int, float)) or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise TrainOptionsError(f"LRSchedule(min_lr_ratio={self.min_lr_ratio!r}) must be a number in [0, 1]")

    def factor(self, step: int) -> float:
        """The multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        assert self.total_steps is not None
        done = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * done)) if self.decay == "cosine" else 1.0 - done
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


@dataclass(frozen=True)
class TrainOptions:
    """Per-step behaviour of a trainer, each done with torch's own implementation.

    * ``max_grad_norm``: clip gradients to this global L2 norm (over every
      shard and pipeline stage, as one model would have it); None: no
      clipping (the norm is still measured and reported).
    * ``grad_accum_steps``: split each data-parallel rank's part of the batch
      into this many micro-steps, forward and backward each, one optimizer
      step (the gradient is the same as one pass over the whole batch).
    * ``lr_schedule``: an :class:`LRSchedule`, or a picklable factory
      ``optimizer -> torch.optim.lr_scheduler.LRScheduler`` (e.g.
      ``functools.partial(StepLR, step_size=10)``); stepped after every
      optimizer step.
    * ``param_dtype`` / ``reduce_dtype``: mixed precision ("bf16", "fp16",
      "fp32" or torch dtypes). Under FSDP2 they are its
      ``MixedPrecisionPolicy`` (compute in ``param_dtype``, reduce gradients
      in ``reduce_dtype``, keep fp32 master weights); otherwise the forward
      runs under ``torch.autocast(param_dtype)``, and under DDP a 16-bit
      ``reduce_dtype`` installs torch's compress hook for the all-reduce.
    * ``flops_per_token``: model FLOPs per token for forward + backward, for
      the MFU figure; default ``6 * parameters``.
    * ``peak_flops``: one device's peak FLOP/s for MFU; ``"measure"`` times a
      matmul on each rank at setup; None: no MFU figure.

    Settings that make no sense raise :class:`TrainOptionsError` here.
    """

    max_grad_norm: float | None = None
    grad_accum_steps: int = 1
    lr_schedule: LRSchedule | Callable[[Any], Any] | None = None
    param_dtype: Any = None
    reduce_dtype: Any = None
    flops_per_token: float | None = None
    peak_flops: float | str | None = None

    def __post_init__(self) -> None:
        norm = self.max_grad_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm > 0 or math.isinf(norm)):
            raise TrainOptionsError(f"TrainOptions(max_grad_norm={norm!r}) must be a positive finite number (None: no clipping)")
        k = self.grad_accum_steps
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise TrainOptionsError(f"TrainOptions(grad_accum_steps={k!r}) must be an int >= 1 (1: no accumulation)")
        if self.lr_schedule is not None and not (isinstance(self.lr_schedule, LRSchedule) or callable(self.lr_schedule)):
            raise TrainOptionsError(f"TrainOptions(lr_schedule={self.lr_schedule!r}) must be an LRSchedule or a factory "
                                    "optimizer -> torch.optim.lr_scheduler.LRScheduler")
        object.__setattr__(self, "param_dtype", dtype_name("param_dtype", self.param_dtype))
        object.__setattr__(self, "reduce_dtype", dtype_name("reduce_dtype", self.reduce_dtype))
        fpt = self.flops_per_token
        if fpt is not None and (isinstance(fpt, bool) or not isinstance(fpt, (int, float)) or not fpt > 0):
            raise TrainOptionsError(f"TrainOptions(flops_per_token={fpt!r}) must be a positive number")
        peak = self.peak_flops
        if peak is not None and peak != "measure" and (isinstance(peak, bool) or not isinstance(peak, (int, float)) or not peak > 0):
            raise TrainOptionsError(f"TrainOptions(peak_flops={peak!r}) must be a positive FLOP/s figure, 'measure' or None")

    @property
    def mixed_precision(self) -> bool:
        """Whether a dtype other than the parameters' own was asked for."""
        return self.param_dtype is not None or self.reduce_dtype is not None
