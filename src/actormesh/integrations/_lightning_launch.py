"""The machinery under :mod:`actormesh.integrations.lightning`: rank environment, launcher, rank runner.

See that module's docstring for the theory of operation.
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import suppress
from typing import Any, Callable, NamedTuple, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _GlobalStateSnapshot
from lightning.pytorch.trainer.states import TrainerFn, TrainerState

from ..errors import SupervisionError
from ..mesh import ActorMesh, ProcMesh, endpoint
from ..runtime import Actor
from ..spmd import ElasticEnv, setup_torch_elastic_env, share_host_cores

__all__ = ["ActorMeshEnvironment", "ActorMeshLauncher", "MeshStrategyMixin"]

log = logging.getLogger("actormesh.integrations.lightning")

#: True in a proc once a :class:`_RankRunner` started there: from then on
#: :class:`ActorMeshEnvironment` reads torchrun's variables from ``os.environ``.
_in_proc = False

#: Set by ``seed_everything`` in the controller; read by Lightning in the procs
#: (DistributedSampler's seed, dataloader worker seeding).
_FORWARDED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")

#: Attribute a failing rank stamps on its exception: (wall time raised, global rank).
_RAISED_AT = "_actormesh_raised_at"


class ActorMeshEnvironment(ClusterEnvironment):
    """Lightning's view of the torch.distributed world of a proc mesh.

    In a proc running a launch it reads the variables that
    ``setup_torch_elastic_env`` set (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``GROUP_RANK``, ``MASTER_ADDR``/``PORT``). In the controller it reads
    nothing and reports rank 0 of a world of ``world_size`` (the mesh size),
    so a controller that was itself started by torchrun is not confused.
    """

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size

    @staticmethod
    def _read(name: str, default: int) -> int:
        return int(os.environ[name]) if _in_proc else default

    @property
    def creates_processes_externally(self) -> bool:
        return True  # the procs exist already; Lightning must not start any

    @property
    def main_address(self) -> str:
        return os.environ["MASTER_ADDR"] if _in_proc else "127.0.0.1"

    @property
    def main_port(self) -> int:
        return self._read("MASTER_PORT", 0)

    @staticmethod
    def detect() -> bool:
        return False  # chosen by ActorMeshStrategy, never detected

    def world_size(self) -> int:
        return self._read("WORLD_SIZE", self._world_size)

    def set_world_size(self, size: int) -> None:
        pass  # fixed by the proc mesh

    def global_rank(self) -> int:
        return self._read("RANK", 0)

    def set_global_rank(self, rank: int) -> None:
        pass  # fixed by the proc's point in the mesh

    def local_rank(self) -> int:
        return self._read("LOCAL_RANK", 0)

    def node_rank(self) -> int:
        return self._read("GROUP_RANK", 0)

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_devices * num_nodes != self._world_size:
            raise ValueError(f"Trainer(devices={num_devices}, num_nodes={num_nodes}) asks for {num_devices * num_nodes} "
                             f"processes, but the proc mesh has {self._world_size} procs")



class MeshStrategyMixin:
    """What every actormesh Lightning strategy holds: the procs, the launch bounds, the world check."""

    procs: ProcMesh
    timeout_s: float | None
    failure_grace_s: float
    setup_timeout_s: float
    parallel_devices: Any
    num_nodes: int

    @staticmethod
    def _require_procs(procs: Any) -> None:
        if not isinstance(procs, ProcMesh):
            raise TypeError(f"ActorMeshStrategy needs a ProcMesh (this_host().spawn_procs(...)), got {type(procs).__name__}")

    def _init_mesh(self, procs: ProcMesh, timeout_s: float | None, failure_grace_s: float, setup_timeout_s: float) -> None:
        self.procs = procs
        self.timeout_s = timeout_s
        self.failure_grace_s = failure_grace_s
        self.setup_timeout_s = setup_timeout_s

    def _configure_launcher(self) -> None:
        self.check_world()
        self._launcher = ActorMeshLauncher(self)

    def check_world(self) -> None:
        """Raise ValueError unless Trainer(devices, num_nodes) matches the proc mesh's shape."""
        devices, nodes = len(self.parallel_devices or ()), self.num_nodes
        sizes = self.procs.sizes
        if devices * nodes != len(self.procs):
            raise ValueError(f"Trainer(devices={devices}, num_nodes={nodes}) asks for {devices * nodes} processes, but the "
                             f"proc mesh {sizes} has {len(self.procs)} procs: pass devices=<procs per host>, num_nodes=<hosts>")
        labels, dims = tuple(sizes), tuple(sizes.values())
        env = ElasticEnv.for_point(labels, dims, (0,) * len(labels), 0)
        if (devices, nodes) != (env.local_world_size, env.group_world_size):
            raise ValueError(f"Trainer(devices={devices}, num_nodes={nodes}) does not match the proc mesh {sizes}: it has "
                             f"{env.local_world_size} procs per node and {env.group_world_size} node(s)")

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's weights, unsharded (a collective: every rank calls it; rank 0's is complete)."""
        return self.lightning_module.state_dict()  # type: ignore[attr-defined]


class _RankZeroOutput(NamedTuple):
    """What global rank 0 sends back to the controller (Lightning's ``_WorkerOutput``)."""

    best_model_path: str | None
    state_dict: dict[str, Any] | None
    trainer_state: TrainerState
    loop_state: dict[str, Any] | None
    trainer_results: Any
    metrics: dict[str, dict[str, Any]]


class ActorMeshLauncher(_Launcher):
    """Runs a Trainer entry point on every proc of the strategy's mesh (see the module docstring)."""

    def __init__(self, strategy: MeshStrategyMixin) -> None:
        self._strategy = strategy
        self._already_fit = False

    @property
    def is_interactive_compatible(self) -> bool:
        return True  # nothing is forked: code from a notebook travels by value

    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` on every proc; return global rank 0's result.

        With a ``trainer``, rank 0's weights, trainer state and metrics are
        loaded into it (and its model) first. Raises the first failing rank's
        exception, SupervisionError if a proc died, TimeoutError past ``timeout_s``.
        """
        strategy = self._strategy
        strategy.check_world()
        if self._already_fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise NotImplementedError("Calling trainer.fit() twice on the same Trainer is not supported with ActorMeshStrategy "
                                      "(as with Lightning's spawn strategies): create a new Trainer, on the same procs if "
                                      "you like, and pass fit(ckpt_path=...) to resume")
        setup_torch_elastic_env(strategy.procs, timeout=strategy.setup_timeout_s)
        runners = cast("ActorMesh[_RankRunner]", strategy.procs.spawn("lightning_rank", _RankRunner))
        try:
            output = self._run(runners, trainer, function, args, kwargs)
        finally:
            self._stop(runners)
        if trainer is None:
            return output
        self._already_fit |= trainer.state.fn == TrainerFn.FITTING
        self._recover_results_in_main_process(output, trainer)
        return output.trainer_results

    def _run(self, runners: ActorMesh[_RankRunner], trainer: pl.Trainer | None, function: Callable[..., Any],
             args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Wait for every rank (replies in arrival order); return rank 0's output or raise the first failure."""
        strategy = self._strategy
        env = {name: os.environ.get(name) for name in _FORWARDED_ENV}
        futures = list(runners.run.stream(trainer, function, args, kwargs, _GlobalStateSnapshot.capture(), env))
        deadline = None if strategy.timeout_s is None else time.monotonic() + strategy.timeout_s
        failures: list[BaseException] = []
        rank0: Any = None
        for fut in futures:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                rank, value = fut.get(timeout=wait)
            except Exception as exc:
                if isinstance(exc, TimeoutError) and not fut.done():
                    if failures:
                        log.warning("actormesh/lightning: ranks still busy %.0fs after the first failure; raising it now "
                                    "(stop the procs if they stay stuck)", strategy.failure_grace_s)
                        break
                    raise TimeoutError(f"the Lightning run on {strategy.procs!r} did not finish within timeout_s="
                                       f"{strategy.timeout_s} (the procs may still be running it: stop them)") from None
                if not failures:
                    grace_end = time.monotonic() + strategy.failure_grace_s
                    deadline = grace_end if deadline is None else min(deadline, grace_end)
                failures.append(exc)
                continue
            if rank == 0:
                rank0 = value
        if failures:
            raise _root_cause(failures)
        return rank0

    def _stop(self, runners: ActorMesh[_RankRunner]) -> None:
        try:
            runners.stop().get(timeout=self._strategy.setup_timeout_s)
        except Exception as exc:  # a rank stuck in a collective; do not mask the launch's own outcome
            log.warning("actormesh/lightning: the rank runners did not stop cleanly (%r); stop the procs", exc)

    def _recover_results_in_main_process(self, output: _RankZeroOutput, trainer: pl.Trainer) -> None:
        """Load rank 0's results into the controller's trainer and model (as Lightning's spawn launcher does)."""
        callback = trainer.checkpoint_callback
        if callback is not None and hasattr(callback, "best_model_path") and output.best_model_path is not None:
            callback.best_model_path = str(output.best_model_path)
        if output.state_dict is not None:
            # not strict, like Lightning: the model's composition may have changed in the procs
            trainer.lightning_module.load_state_dict(output.state_dict, strict=False)
        trainer.state = output.trainer_state
        if output.loop_state is not None:  # progress counters: trainer.global_step, current_epoch
            trainer.fit_loop.load_state_dict(output.loop_state)
        trainer.callback_metrics.update(output.metrics["callback"])
        trainer.logged_metrics.update(output.metrics["logged"])
        trainer.progress_bar_metrics.update(output.metrics["progress_bar"])

    def kill(self, signum: Any) -> None:
        """Nothing to kill: the procs belong to the caller (``procs.stop()``)."""


class _RankRunner(Actor):
    """Runs one rank of a launch in its proc, on the actor's own thread."""

    def __init__(self) -> None:
        global _in_proc
        _in_proc = True

    @endpoint
    def run(self, trainer: pl.Trainer | None, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            global_states: _GlobalStateSnapshot, env: dict[str, str | None]) -> tuple[int, Any]:
        """(global rank, rank 0's output or None); the process group is destroyed before returning or raising."""
        import torch.distributed as dist

        global_states.restore()
        for name, value in env.items():  # the controller's seed settings, as a freshly spawned process inherits them
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        rank = int(os.environ["RANK"])
        _limit_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        try:
            results = function(*args, **kwargs)
            if trainer is not None:
                results = _collect_rank_zero_results(trainer, results, rank)
        except BaseException as exc:
            with suppress(Exception):  # lets the controller order failures (see _root_cause)
                setattr(exc, _RAISED_AT, (time.time(), rank))
            if trainer is not None:  # what Lightning's call wrapper does; here the proc outlives the run
                with suppress(Exception):
                    trainer._teardown()
            raise
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        return rank, (move_data_to_device(results, "cpu") if rank == 0 else None)


def _collect_rank_zero_results(trainer: pl.Trainer, results: Any, rank: int) -> _RankZeroOutput | None:
    callback = trainer.checkpoint_callback
    best = getattr(callback, "best_model_path", None) if callback is not None else None
    state_dict = trainer.strategy.full_state_dict()  # on every rank: torchmetrics (and FSDP) gather inside
    if rank != 0:
        return None
    metrics = {
        "callback": dict(trainer.callback_metrics),
        "logged": dict(trainer.logged_metrics),
        "progress_bar": dict(trainer.progress_bar_metrics),
    }
    weights = state_dict if trainer.state.fn == TrainerFn.FITTING else None
    loops = trainer.fit_loop.state_dict() if trainer.state.fn == TrainerFn.FITTING else None
    return _RankZeroOutput(None if best is None else str(best), weights, trainer.state, loops, results, metrics)


def _root_cause(failures: list[BaseException]) -> BaseException:
    """The failure to raise: a dead proc first, else the earliest raised (peers' collectives fail after it).

    Arrival order breaks ties. The ranks and the other failures go into a note (Python 3.11+).
    """
    def stamp(exc: BaseException) -> tuple[float, str]:
        when, rank = getattr(exc, _RAISED_AT, (math.inf, None))
        return when, "a dead or stopped proc" if rank is None else f"rank {rank}"

    order = sorted(range(len(failures)), key=lambda i: (not isinstance(failures[i], SupervisionError), stamp(failures[i])[0], i))
    root = failures[order[0]]
    if hasattr(root, "add_note"):
        lines = [f"actormesh: the Lightning run failed on {stamp(root)[1]} first"]
        for i in order[1:]:
            original = getattr(failures[i], "exception", None) or failures[i]
            text = (str(original).splitlines() or [""])[0][:200]
            lines.append(f"  then on {stamp(failures[i])[1]}: {type(original).__name__}: {text}")
        root.add_note("\n".join(lines))
    return root


def _limit_threads(local_world_size: int) -> None:
    """Share the host's cores among its ranks unless OMP_NUM_THREADS says otherwise (as Lightning's launchers do)."""
    share_host_cores(local_world_size)
