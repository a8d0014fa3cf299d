"""The trainer actor: one per proc, the model built and parallelised per a :class:`Plan`.

``spawn_trainer`` gives every proc torchrun's environment, spawns a
:class:`Trainer` on each, and runs ``setup`` everywhere: build the model on
the meta device, validate the plan against it, init the process group and the
``(pp, dp_replicate, dp_shard, tp)`` DeviceMesh, cut out this rank's pipeline
stages, apply TP / activation checkpointing / compile / FSDP, allocate the
local shards and load rank 0's seeded weights into them
(``set_model_state_dict(..., broadcast_from_rank0=True)``), then DDP and the
pipeline schedule where the plan asks for them.

Every endpoint is collective: call it on the whole mesh (``.call()``), never
on a slice, or the other ranks' collectives wait for the missing ones.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, cast

from ..mesh import ActorMesh, ProcMesh
from ..runtime import Actor, endpoint
from ._pipeline import cut_to_stage, stage_ids
from ._train_checkpoint import load_checkpoint, save_checkpoint
from ._plan import Plan
from ._publish import PublishedWeights
from ._publisher import Publisher, changing
from ._train_data import DataFactory, RankData
from ._train_figures import StepFigures, state_bytes
from ._train_options import TrainOptions
from ._train_setup import check_trainer_args, probe_model

__all__ = ["Trainer", "spawn_trainer", "gather_state_dict", "publish_weights"]

Batch = Sequence[Any]  # (inputs, targets)
NO_BATCH = "step() without a batch reads the data on the ranks: pass spawn_trainer(..., data=factory), or give step a batch"


class Trainer(Actor):
    """Holds this rank's model chunk(s), optimizer(s) and pipeline schedule.

    Endpoints (call them on the whole mesh): ``setup()``, ``step(batch=None) -> loss``,
    ``step_figures(batch=None) -> StepFigures``, ``state_dict()``, ``load_state_dict(sd)``,
    ``save(path)``, ``load(path)``, ``info()``. Without a batch, a step reads the
    next one from the ranks' data (``data=`` factory, see :mod:`._train_data`).
    """

    def __init__(self, model_fn: Callable[[], Any], loss_fn: Callable[[Any, Any], Any], optimizer_fn: Callable[[Any], Any],
                 plan: Plan, stages: Sequence[range] | None = None, seed: int = 0, pg_timeout_s: float = 600.0,
                 options: TrainOptions | None = None, data: DataFactory | None = None) -> None:
        self.model_fn, self.loss_fn, self.optimizer_fn = model_fn, loss_fn, optimizer_fn
        self.plan, self.stage_ranges, self.seed, self.pg_timeout_s = plan, stages, seed, pg_timeout_s
        self.options = options if options is not None else TrainOptions()
        self.data_fn = data
        self.data: RankData | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.chunks: list[Any] = []
        self.optimizers: list[Any] = []
        self.schedulers: list[Any] = []
        self.n_params = 0
        self.peak_flops: float | None = None
        self.schedule: Any = None
        self.stages: list[Any] = []
        self.steps = 0
        self.device: Any = None
        self.owns_process_group = False
        self._publisher: Publisher | None = None  #: made by the first publish_weights

    # ------------------------------------------------------------------ setup

    @endpoint
    def setup(self) -> dict[str, Any]:
        """Build, parallelise and initialise the model; returns :meth:`info`."""
        import warnings

        import torch

        from ..spmd import init_process_group
        from ._apply import world_mesh, wrap_ddp
        from ._train_figures import peak_flops
        from ._train_step import build_train_schedule, install_reduce_hook, make_schedulers

        # FSDP2 warns when a module returns a view (TP's replicated logits are one);
        # the trainer never modifies outputs in place, so the warning is noise here.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        probe = probe_model(self.model_fn, self.plan, self.stage_ranges)  # before any collective: all ranks fail alike
        ranges, self.n_params, self.shapes = probe.stages, probe.n_params, probe.shapes
        plan = self.plan
        if torch.distributed.is_initialized():
            raise RuntimeError("this proc already has a torch.distributed process group (another trainer or SPMD actor "
                               "on these procs?): stop it before spawning a trainer here")
        init_process_group(timeout_s=self.pg_timeout_s)  # on CUDA also selects cuda:LOCAL_RANK
        self.owns_process_group = True
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.rank = torch.distributed.get_rank()
        self.mesh = mesh = world_mesh(plan, self.device.type)
        coord = {name: mesh[name].get_local_rank() for name in ("pp", "dp_replicate", "dp_shard", "tp")}
        self.dp_rank = coord["dp_replicate"] * plan.fsdp + coord["dp_shard"]
        self.tp_rank = coord["tp"]
        self.stage_ids = stage_ids(coord["pp"], plan) if ranges is not None else [0]
        if self.data_fn is not None:
            from ._train_data import rank_data

            self.data = rank_data(self.data_fn, mesh, self.rank, self.dp_rank, plan.dp_size)
        self._build_chunks(ranges)
        if plan.uses_ddp:
            self.chunks[0] = wrap_ddp(self.chunks[0], plan, mesh, self.device)
            install_reduce_hook(self.chunks[0], self.options, mesh["dp_replicate"].get_group(), self.device)
        self.optimizers = [self.optimizer_fn(chunk.parameters()) for chunk in self.chunks]
        self.schedulers = make_schedulers(self.optimizers, self.options)
        self.peak_flops = peak_flops(self.options.peak_flops, self.device, self.options.param_dtype)
        if ranges is not None:
            from torch.distributed.pipelining import PipelineStage

            group = mesh["pp"].get_group()
            self.stages = [PipelineStage(chunk, sid, plan.n_stages, self.device, group=group) for sid, chunk in zip(self.stage_ids, self.chunks)]
            self.schedule = build_train_schedule(self.stages, plan, self.loss_fn, self.options.grad_accum_steps)
        return self._info()

    def _build_chunks(self, ranges: list[range] | None) -> None:
        """This rank's stages, parallelised on meta, materialised, loaded with rank 0's seeded weights."""
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from ._apply import materialize
        from ._train_step import parallelize_for_training

        plan = self.plan
        torch.manual_seed(self.seed)
        for sid in self.stage_ids:
            with torch.device("meta"):
                chunk = self.model_fn()
            if ranges is not None:
                cut_to_stage(chunk, ranges[sid], sid == 0, sid == plan.n_stages - 1)
            parallelize_for_training(chunk, plan, self.mesh, self.options)
            materialize(chunk, self.device)
            self.chunks.append(chunk)
        full: dict[str, Any] = {}
        if self.rank == 0:  # the seeded full model, as a single process would build it
            torch.manual_seed(self.seed)
            full = self.model_fn().state_dict()
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        for chunk in self.chunks:  # a copy each time: torch consumes the dict's entries
            set_model_state_dict(chunk, dict(full), options=options)

    # --------------------------------------------------------------- training

    @endpoint
    def step(self, batch: Batch | None = None) -> float:
        """One optimisation step on the global ``batch = (inputs, targets)``; returns its mean loss.

        Each data-parallel rank takes its contiguous ``1/(dp*fsdp)`` of the
        batch; gradient accumulation splits that into micro-steps and a
        pipeline each micro-step into microbatches. Every rank returns the
        same loss (averaged over data-parallel ranks). Without a batch each
        data-parallel rank draws its share from the ``data`` factory's
        iterator (:class:`TrainDataError` on every rank if one fails).
        """
        return self._guarded(batch).loss

    @endpoint
    def step_figures(self, batch: Batch | None = None) -> StepFigures:
        """:meth:`step`, returning the step's figures (loss, grad norm, lr, tokens/s, MFU, peak memory per rank)."""
        return self._guarded(batch)

    def _guarded(self, batch: Batch | None) -> StepFigures:
        try:
            return self._train(batch)
        except Exception as exc:
            try:  # the controller names the rank (the attribute travels with the pickled exception)
                exc.trainer_rank = self.rank  # type: ignore[attr-defined]
            except AttributeError:
                pass
            raise

    def _local_batch(self, batch: Batch | None) -> tuple[Any, Any]:
        """This data-parallel rank's share: drawn from the rank-side data, or cut from the global batch."""
        from ._train_step import check_accum, share_of

        if batch is None:
            if self.data is None:
                raise TypeError(NO_BATCH)
            x, y = self.data.next_batch()
        else:
            x, y = share_of(batch, self.plan, self.dp_rank)
        check_accum(int(x.shape[0]), self.plan, self.options.grad_accum_steps)
        return x.to(self.device), y.to(self.device)

    def _train(self, batch: Batch | None) -> StepFigures:
        import time

        from ._train_figures import gather_figures, reset_peak_memory
        from ._train_step import clip_grad_norm, forward_backward, pipeline_loss_scale, pipeline_step, precision_context

        if self.device is None:
            raise RuntimeError("step() before setup(): use actormesh.parallel.spawn_trainer, which runs setup")
        started = time.perf_counter()
        reset_peak_memory(self.device)
        plan, opts, accum = self.plan, self.options, self.options.grad_accum_steps
        x, y = self._local_batch(batch)
        autocast = precision_context(opts, plan, self.device)
        loss: float | None
        # One change per step on every rank (equal counters, see _live): from the forward pass if buffers are published
        with changing(self._publisher, forward=True):
            if self.schedule is None:
                loss = forward_backward(self.chunks[0], self.loss_fn, x, y, accum, autocast, plan.uses_ddp)
            else:
                loss = pipeline_step(self.schedule, self.stages, x, y, accum, autocast, pipeline_loss_scale(plan, accum))
            params = [p for chunk in self.chunks for p in chunk.parameters()]
            pp_group = self.mesh["pp"].get_group() if plan.pp > 1 else None
            grad_norm = clip_grad_norm(params, opts.max_grad_norm, pp_group, self.device)
            lr = float(self.optimizers[0].param_groups[0]["lr"])
            with changing(self._publisher):  # nested in the one above when that one began: no second move
                for opt in self.optimizers:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        for sched in self.schedulers:
            sched.step()
        self.steps += 1
        return gather_figures(loss=loss, device=self.device, started=started, step=self.steps, grad_norm=grad_norm, lr=lr,
                              local_tokens=int(x.numel()), dp_size=plan.dp_size,
                              flops_per_token=opts.flops_per_token or 6.0 * self.n_params, peak_flops=self.peak_flops)

    # ------------------------------------------------------------ checkpoints

    @endpoint
    def save(self, path: str) -> None:
        """Write model, optimizer, LR schedule, step count and data position with DCP (every rank its shards)."""
        save_checkpoint(path, self.chunks, self.optimizers, self.schedulers, self.steps, self.data.position if self.data else self.steps)

    @endpoint
    def load(self, path: str) -> int:
        """Load a checkpoint written by :meth:`save` under *any* plan (DCP reshards); returns the step count.

        Raises CheckpointMismatch, naming the first differing key, for a checkpoint of another model.
        The rank-side data resumes at the saved position.
        """
        with changing(self._publisher):
            self.steps, position = load_checkpoint(path, self.chunks, self.optimizers, self.schedulers, self.shapes)
        if self.data is not None:
            self.data.seek(position)
        return self.steps

    @endpoint
    def state_dict(self) -> dict[str, Any]:
        """Full (unsharded) model weights on CPU, by the full model's names.

        Each pipeline stage's weights come back once, from its first
        data/tensor-parallel rank (the others return ``{}``);
        :func:`gather_state_dict` merges them.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        out: dict[str, Any] = {}
        for chunk in self.chunks:
            out.update(get_model_state_dict(chunk, options=StateDictOptions(full_state_dict=True)))
        if self.dp_rank or self.tp_rank:
            return {}
        return {k: v.detach().cpu() for k, v in out.items()}

    @endpoint
    def publish_weights(self) -> Any:
        """This rank's pieces of the weights (its shards; plain tensors on data-parallel rank 0), in place or
        copied (see _publisher): ``(source, layout, stamp)`` or None. See :func:`publish_weights`."""
        from ._live import ChangeCounter

        if self._publisher is None:  # from now on every change of the weights moves the counter
            self._publisher = Publisher(ChangeCounter())
        coords = {dim: self.mesh[dim].get_local_rank() for dim in ("dp_replicate", "dp_shard", "tp")}
        return self._publisher.publish_chunks(self.chunks, first_copy=not (self.dp_rank or self.tp_rank), coords=coords)

    @endpoint
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load full model weights (e.g. from :func:`gather_state_dict` or a single-process model)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        with changing(self._publisher):
            for chunk in self.chunks:
                set_model_state_dict(chunk, state, options=StateDictOptions(full_state_dict=True, strict=False))

    @endpoint
    def info(self) -> dict[str, Any]:
        """This rank's place: plan, mesh coordinates, stages and local parameter count."""
        return self._info()

    def _info(self) -> dict[str, Any]:
        def local_numel(p: Any) -> int:
            return int(p.to_local().numel()) if hasattr(p, "to_local") else int(p.numel())

        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "plan": self.plan.describe(),
            "coords": {name: self.mesh[name].get_local_rank() for name in ("pp", "dp_replicate", "dp_shard", "tp")},
            "stages": list(self.stage_ids) if self.schedule is not None else [],
            "wrappers": sorted({type(c).__name__ for c in self.chunks}),
            "local_params": sum(local_numel(p) for c in self.chunks for p in c.parameters()),
            "state_bytes": state_bytes(self.chunks, self.optimizers),
        }

    def __cleanup__(self, exc: Exception | None) -> None:
        from ..spmd import destroy_process_group

        self.schedule = None
        if self._publisher is not None:  # registrations hold the parameters' memory: a later trainer here needs it back
            self._publisher.close()
        self.stages.clear()
        self.chunks.clear()
        self.optimizers.clear()
        if self.owns_process_group:  # so a later trainer on these procs starts a fresh world
            destroy_process_group()


def spawn_trainer(
    procs: ProcMesh,
    model_fn: Callable[[], Any],
    loss_fn: Callable[[Any, Any], Any],
    optimizer_fn: Callable[[Any], Any],
    plan: Plan | None = None,
    *,
    stages: Sequence[range] | None = None,
    seed: int = 0,
    name: str = "trainer",
    timeout: float = 600.0,
    pg_timeout_s: float = 600.0,
    options: TrainOptions | None = None,
    data: DataFactory | None = None,
) -> ActorMesh[Trainer]:
    """Spawn a :class:`Trainer` on every proc and set it up per ``plan``; returns the actor mesh.

    ``model_fn()`` builds the model (called under ``torch.device("meta")`` on
    every rank, and once for real on rank 0 under ``torch.manual_seed(seed)``
    for the initial weights), ``loss_fn(outputs, targets)`` returns a mean
    loss, ``optimizer_fn(params)`` makes an optimizer. All three must be
    picklable (module-level functions or ``functools.partial``). ``stages``
    optionally gives the pipeline stage boundaries (``range``s over block
    indices, e.g. from a partitioner); default: equal split. Raises
    :class:`PlanError` (from the controller or the ranks) when the plan does
    not fit the procs, the model or its options. ``options`` sets clipping,
    accumulation, LR schedule, mixed precision and the MFU inputs
    (:class:`TrainOptions`, checked before anything is spawned). ``data``
    is a picklable factory ``(dp_rank=, dp_size=, start_step=) -> iterable``
    of this data-parallel rank's ``(inputs, targets)`` shares; with it,
    ``trainer.step.call()`` carries no data (see :mod:`._train_data`).

    Example::

        from functools import partial
        import torch
        from actormesh.parallel import Plan, spawn_trainer
        from actormesh.parallel.models import gpt, lm_loss

        trainer = spawn_trainer(procs, partial(gpt, n_blocks=4), lm_loss,
                                partial(torch.optim.AdamW, lr=1e-3), Plan(fsdp=2, tp=2))
        loss = trainer.step.call((tokens, targets)).get(timeout=60).values()[0]
    """
    from ..spmd import setup_torch_elastic_env

    plan = Plan() if plan is None else plan
    check_trainer_args(procs, plan, (model_fn, loss_fn, optimizer_fn), options, data)
    setup_torch_elastic_env(procs, timeout=min(timeout, 120.0))
    trainer = cast("ActorMesh[Trainer]", procs.spawn(name, Trainer, model_fn, loss_fn, optimizer_fn, plan, stages, seed, pg_timeout_s,
                                                           options, data))
    try:
        trainer.setup.call().get(timeout=timeout)
    except BaseException:
        trainer.stop("setup failed").get(timeout=60)
        raise
    return trainer


def publish_weights(trainer: ActorMesh[Trainer], version: int = 0, timeout: float = 300.0) -> PublishedWeights:
    """The full model's weights left in the trainer's memory as RDMA buffers, under any plan.

    Each rank snapshots the shards it holds (no gather). Returns a small
    :class:`PublishedWeights` (handles and layout) that can be sent anywhere;
    its ``fetch()`` reads the bytes straight from the trainer's ranks and
    assembles the full tensors, so the controller never carries them.
    """
    return PublishedWeights.from_replies(version, list(trainer.publish_weights.call().get(timeout=timeout).values()))


def gather_state_dict(trainer: ActorMesh[Trainer], timeout: float = 300.0) -> dict[str, Any]:
    """The full model's weights (CPU tensors) from a trainer mesh under any plan."""
    merged: dict[str, Any] = {}
    for part in trainer.state_dict.call().get(timeout=timeout).values():
        merged.update(part)
    return merged
