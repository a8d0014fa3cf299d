"""PyTorch Lightning on a proc mesh: ``Trainer(strategy=ActorMeshStrategy(procs))``.

Example::

    import lightning as L
    from actormesh.actor import this_host
    from actormesh.integrations.lightning import ActorMeshStrategy
    from actormesh.parallel import Plan

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    trainer = L.Trainer(strategy=ActorMeshStrategy(procs), accelerator="cpu", devices=2, max_epochs=1)
    trainer.fit(model, train_dataloaders=loader)   # DDP on the 2 procs; `model` holds the result

    # FSDP2 x tensor parallel on 4 procs (the plan applies to the module holding `blocks`):
    strategy = ActorMeshStrategy(procs4, plan=Plan(fsdp=2, tp=2))
    procs.stop().get(timeout=30)

Theory of operation
-------------------
The controller builds the Trainer as usual. ``trainer.fit`` (``validate``,
``test``, ``predict``) hands its entry point to the strategy's launcher, as it
does for Lightning's ``ddp_spawn`` (``_MultiProcessingLauncher``). Instead of
starting local processes, :class:`ActorMeshLauncher.launch`

1. gives every proc torchrun's environment (``setup_torch_elastic_env``);
2. spawns one :class:`_RankRunner` actor per proc and calls it with the
   trainer, the entry point (a bound method of that trainer) and its
   arguments, pickled together in one message so they stay one object graph;
3. in each proc Lightning's DDP reads the rank from
   :class:`ActorMeshEnvironment`, inits the process group (gloo on CPU, nccl
   on CUDA) and runs; the runner destroys the process group afterwards, pass
   or fail, so the same procs can run the next launch;
4. global rank 0 returns the weights, the trainer state and the metrics; the
   controller loads them into its own model and trainer;
5. the runner actors are stopped.

The controller never inits a process group. A failing rank fails the launch
with its exception (an ``ActorError`` that is also an instance of the
exception's class). The first failure to arrive is raised as the root cause;
the other ranks get ``failure_grace_s`` to finish (their collectives fail once
the failed rank has destroyed its process group) before the controller raises
anyway. A proc that dies fails its call through actormesh's supervision.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from ..mesh import ProcMesh
from ..parallel import Plan
from ._lightning_launch import ActorMeshEnvironment, ActorMeshLauncher, MeshStrategyMixin
from ._lightning_plan import ActorMeshModelParallelStrategy, check_plan, needs_model_parallel

__all__ = ["ActorMeshStrategy", "ActorMeshModelParallelStrategy", "ActorMeshLauncher", "ActorMeshEnvironment"]


class ActorMeshStrategy(MeshStrategyMixin, DDPStrategy):
    """Lightning on ``procs``, one rank per proc, driven from the controller; DDP unless ``plan`` says otherwise.

    ``plan`` (an :class:`actormesh.parallel.Plan`) chooses the parallelism:
    ``None`` or ``Plan(dp=N)`` is Lightning's DDP (this class); a plan with
    ``fsdp`` or ``tp`` > 1 makes this call return an
    :class:`ActorMeshModelParallelStrategy` (FSDP2 and/or tensor parallel,
    Lightning's ModelParallelStrategy underneath). ``pp`` > 1 is refused:
    Lightning's loop has no pipeline schedule.

    ``Trainer(devices=..., num_nodes=...)`` must describe the mesh: ``devices``
    the procs per host (the ``gpus`` dim, else the last one) and ``num_nodes``
    the product of the other dims; a mismatch raises ValueError when the
    Trainer is built. Other keyword arguments go to ``DDPStrategy`` (e.g.
    ``process_group_backend``, ``timeout``, ``find_unused_parameters``).

    ``timeout_s`` bounds a whole launch (None: no bound; a dead proc still
    fails the launch). ``failure_grace_s`` is how long the other ranks may take
    to finish once one failed. ``setup_timeout_s`` bounds the environment
    setup and the stop of the runner actors. The procs belong to the caller:
    the strategy never stops them.
    """

    strategy_name = "actormesh"

    def __new__(cls, procs: Any = None, *args: Any, plan: Plan | None = None, **kwargs: Any) -> Any:
        # A plan that shards or splits the model needs Lightning's ModelParallelStrategy, not DDP.
        if cls is ActorMeshStrategy and plan is not None and isinstance(plan, Plan) and needs_model_parallel(plan):
            return ActorMeshModelParallelStrategy(procs, plan, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, procs: ProcMesh, *, plan: Plan | None = None, timeout_s: float | None = None,
                 failure_grace_s: float = 30.0, setup_timeout_s: float = 60.0, **kwargs: Any) -> None:
        self._require_procs(procs)
        self.plan = None if plan is None else check_plan(plan, procs)
        for name in ("cluster_environment", "start_method"):
            if name in kwargs:
                raise TypeError(f"ActorMeshStrategy sets {name} itself; do not pass it")
        super().__init__(cluster_environment=ActorMeshEnvironment(len(procs)), **kwargs)
        self._init_mesh(procs, timeout_s, failure_grace_s, setup_timeout_s)
