"""A :class:`~actormesh.parallel.Plan` under Lightning: FSDP2 and tensor parallel on a proc mesh.

:class:`ActorMeshModelParallelStrategy` is Lightning's ``ModelParallelStrategy``
(FSDP2 + DTensor TP, driven by ``LightningModule.configure_model``) with the
ranks on an actormesh proc mesh and the parallelism chosen by a Plan. If
``configure_model`` left the model unparallelised (or is not overridden), the
strategy applies the Plan itself with :mod:`actormesh.parallel`'s code, in
torchtitan's order (TP, activation checkpointing, compile, FSDP).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from ..mesh import ProcMesh
from ..parallel import Plan, PlanError
from ._lightning_launch import ActorMeshEnvironment, MeshStrategyMixin

__all__ = ["ActorMeshModelParallelStrategy", "check_plan", "needs_model_parallel"]


def needs_model_parallel(plan: Plan) -> bool:
    """Whether ``plan`` shards or splits the model (FSDP, TP) rather than only replicating it (DDP)."""
    return plan.fsdp > 1 or plan.tp > 1


def check_plan(plan: Any, procs: ProcMesh) -> Plan:
    """``plan`` if Lightning can run it on ``procs``; TypeError/PlanError naming the problem otherwise."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an actormesh.parallel.Plan, got {type(plan).__name__}")
    if plan.pp > 1:
        raise PlanError(f"{plan}: Lightning's training loop has no pipeline schedule, so ActorMeshStrategy cannot run pp > 1; "
                        "drop pp, or train with actormesh.parallel.spawn_trainer, which runs pipelines")
    if plan.world_size != len(procs):
        raise PlanError(f"{plan} needs {plan.world_size} procs, but the proc mesh {procs.sizes} has {len(procs)}")
    if not needs_model_parallel(plan) and (plan.compile or plan.activation_checkpointing):
        raise PlanError(f"{plan}: under DDP the strategy does not rewrite the model; apply torch.compile or activation "
                        "checkpointing in LightningModule.configure_model instead")
    return plan


def _is_parallelized(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(isinstance(p, DTensor) for p in model.parameters())


def plan_target(module: torch.nn.Module) -> torch.nn.Module:
    """The module a Plan applies to: ``module`` if it holds ``blocks``, else its one child that does, else ``module``."""
    if hasattr(module, "blocks"):
        return module
    holders = [child for child in module.children() if hasattr(child, "blocks")]
    return holders[0] if len(holders) == 1 else module


def _average_gradients(dp_mesh: Any, params: list[torch.nn.Parameter]) -> None:
    """Replicate ``params`` DDP-style: average each one's gradient over the data-parallel ranks as it lands.

    Parameters outside the planned module are used in ``training_step``, not in
    a sharded module's ``forward``, so FSDP's hooks would never gather them.
    """
    import torch.distributed as dist

    if dp_mesh.size() == 1 or not params:
        return
    group, size = dp_mesh.get_group(), dp_mesh.size()

    def average(param: torch.Tensor) -> None:
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad.div_(size)

    for param in params:
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(average)


class ActorMeshModelParallelStrategy(MeshStrategyMixin, ModelParallelStrategy):
    """Lightning's ModelParallelStrategy on ``procs``, shaped by ``plan`` (FSDP ``fsdp``/``dp``, TP ``tp``).

    ``ActorMeshStrategy(procs, plan=...)`` returns one of these when the plan
    shards or splits the model. ``LightningModule.device_mesh`` is Lightning's
    2-D mesh ``("data_parallel", "tensor_parallel")`` with sizes
    ``(dp * fsdp, tp)``. A ``configure_model`` that parallelises the model
    itself (``fully_shard``, ``parallelize_module``) is left alone; otherwise
    the strategy applies the plan to the module that holds ``blocks`` (the
    LightningModule or its one child with ``blocks``); parameters outside that
    module stay whole on every rank, their gradients averaged over the
    data-parallel ranks (as DDP would). Lightning checkpoints are distributed
    (a folder of shards) unless ``save_distributed_checkpoint=False``.
    """

    strategy_name = "actormesh_model_parallel"
    model: Any  #: Lightning's attribute (its type is not seen here: Lightning's sources are not type-checked)

    def __init__(self, procs: ProcMesh, plan: Plan, *, timeout_s: float | None = None, failure_grace_s: float = 30.0,
                 setup_timeout_s: float = 60.0, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout) -> None:
        self._require_procs(procs)
        self.plan = check_plan(plan, procs)
        super().__init__(data_parallel_size=plan.dp * plan.fsdp, tensor_parallel_size=plan.tp,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.cluster_environment = ActorMeshEnvironment(len(procs))
        self._init_mesh(procs, timeout_s, failure_grace_s, setup_timeout_s)

    def setup(self, trainer: pl.Trainer) -> None:
        """ModelParallelStrategy.setup, except that an unparallelised model gets the plan instead of a TypeError."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if not _is_parallelized(self.model):
            self._apply_plan()
        # The rest is ModelParallelStrategy.setup (its configure_model check is what we replace).
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _apply_plan(self) -> None:
        from ..parallel import parallelize_chunk, world_mesh

        module = self.lightning_module
        assert module is not None
        module.to(self.root_device)  # every rank holds the controller's weights: TP/FSDP shard them in place
        plan = self.plan
        mesh = world_mesh(plan, self.root_device.type)
        target = plan_target(module)
        parallelize_chunk(target, plan, mesh)
        if target is not module:
            inside = {id(p) for p in target.parameters()}
            _average_gradients(self.device_mesh["data_parallel"], [p for p in module.parameters() if id(p) not in inside])

    def full_state_dict(self) -> dict[str, Any]:
        """The unsharded weights, gathered to rank 0 on the CPU (a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.model is not None
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
