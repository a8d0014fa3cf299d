"""``Plan``: how one model is spread over a proc mesh, and its validation.

A plan is four degrees whose product is the world size, laid out as a
DeviceMesh with dims ``("pp", "dp_replicate", "dp_shard", "tp")`` (tp
innermost, so tensor-parallel peers are neighbouring ranks, i.e. the same
host), plus the pipeline schedule and per-block options. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Plan", "PlanError", "MESH_DIMS", "SINGLE_STAGE_SCHEDULES", "MULTI_STAGE_SCHEDULES"]

#: DeviceMesh dim names, outermost first.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
#: Schedules with one stage per pp rank.
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
#: Schedules with several (``stages_per_rank``) stages per pp rank, assigned in a loop.
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


class PlanError(ValueError):
    """A plan does not fit the proc mesh, the model or the batch; the message says what to change."""


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"Plan({name}={value!r}): {name} must be a positive int (1 = not used)")
    return value


@dataclass(frozen=True)
class Plan:
    """How to parallelise training: degrees, pipeline schedule, per-block options.

    * ``dp``: replicas (DDP when it is the only axis, else FSDP2's replicate dim).
    * ``fsdp``: shards of parameters, gradients and optimizer state (FSDP2 ``fully_shard``).
    * ``tp``: tensor parallel degree (DTensor ``parallelize_module``).
    * ``pp``: pipeline stages (``torch.distributed.pipelining``), run with
      ``pp_schedule`` over ``microbatches`` microbatches (default: ``pp``).
    * ``stages_per_rank``: model chunks per pp rank (default 2 for the
      interleaved/looped schedules, 1 otherwise).
    * ``compile``: ``torch.compile`` each block (``True`` or a backend name).
    * ``activation_checkpointing``: recompute each block's activations in backward.
    * ``tp_plan``: layer-wise TP plan for models the default does not cover:
      ``{"blocks.*.attn.q": "colwise", "blocks.*.attn.o": "rowwise", ...}``
      (values: "colwise", "rowwise", "sequence", or torch ``ParallelStyle``
      objects), or a callable ``(module, tp_mesh) -> None`` that applies TP itself.

    ``dp * fsdp * tp * pp`` must equal the number of procs.

    Example::

        Plan(fsdp=2, tp=2)                                   # 4 procs
        Plan(dp=2, pp=2, pp_schedule="GPipe", microbatches=4)
    """

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1F1B"
    microbatches: int | None = None
    stages_per_rank: int | None = None
    compile: bool | str = False
    activation_checkpointing: bool = False
    tp_plan: Mapping[str, Any] | Callable[..., Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp", "fsdp", "tp", "pp"):
            _positive(name, getattr(self, name))
        known = {s.lower(): s for s in SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES}
        schedule = known.get(str(self.pp_schedule).lower())
        if schedule is None:
            raise PlanError(f"Plan(pp_schedule={self.pp_schedule!r}) is not a known schedule; choose one of {sorted(known.values())}")
        object.__setattr__(self, "pp_schedule", schedule)
        if self.microbatches is not None:
            _positive("microbatches", self.microbatches)
        if self.stages_per_rank is not None:
            _positive("stages_per_rank", self.stages_per_rank)
            if schedule in SINGLE_STAGE_SCHEDULES and self.stages_per_rank != 1:
                raise PlanError(f"Plan(pp_schedule={schedule!r}) runs one stage per rank; use Interleaved1F1B or LoopedBFS for stages_per_rank={self.stages_per_rank}")
        if schedule == "1F1B" and self.microbatches is not None and self.microbatches < self.pp:
            raise PlanError(f"Plan(pp={self.pp}, pp_schedule='1F1B') needs microbatches >= pp, got {self.microbatches}")
        if schedule in MULTI_STAGE_SCHEDULES and self.pp > 1:
            rounds = max(1, self.n_microbatches // self.pp)
            if self.n_microbatches % rounds:
                raise PlanError(f"Plan(pp={self.pp}, pp_schedule={schedule!r}): microbatches={self.n_microbatches} must be a multiple of "
                                f"{rounds} (microbatches // pp); try {self.pp * rounds}")
        if not isinstance(self.compile, (bool, str)):
            raise PlanError(f"Plan(compile={self.compile!r}) must be True/False or a torch.compile backend name")
        if self.tp_plan is not None and not (callable(self.tp_plan) or isinstance(self.tp_plan, Mapping)):
            raise PlanError("Plan(tp_plan=...) must be a mapping {module name pattern: style} or a callable (module, tp_mesh)")

    # ----------------------------------------------------------- derived sizes

    @property
    def world_size(self) -> int:
        """Number of procs the plan needs: ``dp * fsdp * tp * pp``."""
        return self.dp * self.fsdp * self.tp * self.pp

    @property
    def dp_size(self) -> int:
        """Data-parallel ways (``dp * fsdp``): the batch is split this many ways."""
        return self.dp * self.fsdp

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """Sizes of the ``MESH_DIMS`` dims."""
        return (self.pp, self.dp, self.fsdp, self.tp)

    @property
    def n_stages_per_rank(self) -> int:
        """Pipeline stages (model chunks) on each pp rank."""
        if self.pp == 1:
            return 1
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 1 if self.pp_schedule in SINGLE_STAGE_SCHEDULES else 2

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all: ``pp * stages_per_rank``."""
        return self.pp * self.n_stages_per_rank

    @property
    def n_microbatches(self) -> int:
        """Microbatches per step (``microbatches``, default ``pp``)."""
        return self.microbatches if self.microbatches is not None else self.pp

    @property
    def uses_ddp(self) -> bool:
        """DDP wraps the model: data parallel is the only axis (as in torchtitan)."""
        return self.dp > 1 and self.fsdp == self.tp == self.pp == 1

    @property
    def uses_fsdp(self) -> bool:
        """FSDP2 wraps the blocks: sharding, or replication combined with another axis (HSDP mesh)."""
        return self.fsdp > 1 or (self.dp > 1 and not self.uses_ddp)

    def describe(self) -> str:
        """``"DP2xTP2"``-style name of the plan ("single" when nothing is parallel)."""
        parts = [f"{name}{degree}" for name, degree in (("PP", self.pp), ("DP", self.dp), ("FSDP", self.fsdp), ("TP", self.tp)) if degree > 1]
        return "x".join(parts) or "single"

    # -------------------------------------------------------------- validation

    def check_world(self, world_size: int) -> None:
        """Raise PlanError unless the plan uses exactly ``world_size`` procs."""
        if self.world_size != world_size:
            raise PlanError(
                f"{self!s} needs dp*fsdp*tp*pp = {self.dp}*{self.fsdp}*{self.tp}*{self.pp} = {self.world_size} procs, "
                f"but the proc mesh has {world_size}: change the degrees so their product is {world_size}, "
                f"or spawn {self.world_size} procs")

    def check_blocks(self, n_blocks: int | None) -> None:
        """Raise PlanError unless the pipeline stages can split ``n_blocks`` blocks."""
        if self.pp == 1:
            return
        if n_blocks is None:
            raise PlanError(f"{self!s} splits the model into pipeline stages along its `blocks` ModuleList, but the model has none: "
                            "put the repeated layers in `self.blocks = nn.ModuleList(...)`, or use pp=1")
        if self.n_stages > n_blocks:
            raise PlanError(f"{self!s} needs {self.n_stages} pipeline stages (pp={self.pp} x stages_per_rank={self.n_stages_per_rank}) "
                            f"but the model has only {n_blocks} blocks: lower pp/stages_per_rank or add blocks")

    def check_batch(self, batch_size: int) -> None:
        """Raise PlanError unless the batch splits evenly over data-parallel ranks and microbatches."""
        if batch_size % self.dp_size:
            raise PlanError(f"batch of {batch_size} samples does not split evenly over dp*fsdp = {self.dp_size} data-parallel ranks: "
                            f"use a batch size that is a multiple of {self.dp_size}")
        local = batch_size // self.dp_size
        if self.pp > 1 and local % self.n_microbatches:
            raise PlanError(f"each data-parallel rank gets {local} samples, which do not split into {self.n_microbatches} microbatches: "
                            f"use a batch size that is a multiple of {self.dp_size * self.n_microbatches}")

    def __str__(self) -> str:
        extra = []
        if self.pp > 1:
            extra.append(f"pp_schedule={self.pp_schedule!r}, microbatches={self.n_microbatches}")
        if self.compile:
            extra.append(f"compile={self.compile!r}")
        if self.activation_checkpointing:
            extra.append("activation_checkpointing=True")
        if self.tp_plan is not None:
            extra.append("tp_plan=<user>")
        degrees = ", ".join(f"{n}={getattr(self, n)}" for n in ("dp", "fsdp", "tp", "pp") if getattr(self, n) > 1) or "single process"
        return f"Plan({', '.join([degrees, *extra])})"
