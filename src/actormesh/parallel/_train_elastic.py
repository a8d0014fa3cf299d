"""Training that survives a lost proc: checkpoints every N steps, and on a proc's death new procs,
a new process group, the last checkpoint restored, the data rewound, and the same step again.

Theory of operation. :class:`ElasticTrainer` lives on the controller. Its
procs and trainer mesh are spawned by a small owner actor in the
controller's own process (``this_proc()``), so a dead proc's supervision
event reaches that owner (not ``unhandled_fault_hook``), which forwards it on
a port the controller listens to. A step waits for whichever comes first:
the step's replies or a failure of the current generation's mesh.

* A proc lost (killed, out of memory, found hung): the owner stops the whole
  generation (survivors are blocked in collectives with the dead rank; the
  stop kills them after its deadline), spawns procs again with the same
  ``per_host`` on the same host mesh, sets up a trainer (a new process group),
  loads the last checkpoint (from disk: DCP, so the layout does not matter),
  which rewinds the rank-side data, replays the steps done since that
  checkpoint (batches the controller sent are kept until the next
  checkpoint), then runs the step the caller asked for. The caller's call
  returns normally, later; ``StepFigures.recovery`` and the log say what
  happened. Deterministic data and seeds give the same losses as a run that
  never failed.
* User code raised (``loss_fn``, the model, the data factory), or
  ``max_restarts`` is used up, or new procs cannot be had: everything is
  stopped and :class:`TrainingFailed` names the rank and the cause. It never
  loops.

A rank's error can arrive before its proc's death is known (a survivor's
collective fails as the dead rank's sockets close), so an error that is not
a supervision error waits ``failure_grace_s`` for a death notice before it
is judged to be the user's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ..errors import SupervisionError
from ..mesh import ProcMesh
from ..runtime import Actor, Channel, MeshFailure, endpoint, when_done
from ._plan import Plan
from ._train_figures import StepFigures
from ._train_options import TrainOptionsError

__all__ = ["Recovery", "ElasticTrainer", "TrainingFailed", "spawn_elastic_trainer"]

log = logging.getLogger("actormesh.parallel.train")
STOP_TIMEOUT_S = 60.0


class TrainingFailed(RuntimeError):
    """Training stopped for good: user code raised, restarts ran out, or procs could not be had.

    ``rank`` is the failed rank when known, ``cause`` what happened to it;
    the original error is ``__cause__``. Nothing of the run is left running.
    """

    def __init__(self, message: str, *, rank: int | None = None, cause: str = "") -> None:
        super().__init__(message)
        self.rank, self.cause = rank, cause


@dataclass(frozen=True)
class Recovery:
    """When to checkpoint and how often to come back from a lost proc.

    ``checkpoint_dir`` must be reachable from every host (one host: any
    directory); checkpoints go to ``step_<n>`` under it every
    ``checkpoint_every`` steps, the previous one removed once the next is
    complete. ``max_restarts`` counts recoveries over the whole run.
    ``resume=True`` starts from the newest complete checkpoint already in
    ``checkpoint_dir`` (e.g. one left by a controller that died), if any.
    """

    checkpoint_dir: str
    checkpoint_every: int = 10
    max_restarts: int = 3
    failure_grace_s: float = 3.0
    resume: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint_dir, (str, os.PathLike)) or not str(self.checkpoint_dir):
            raise TrainOptionsError(f"Recovery(checkpoint_dir={self.checkpoint_dir!r}) must name a directory")
        for name in ("checkpoint_every", "max_restarts"):
            value, low = getattr(self, name), 1 if name == "checkpoint_every" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise TrainOptionsError(f"Recovery({name}={value!r}) must be an int >= {low}")
        if not isinstance(self.failure_grace_s, (int, float)) or self.failure_grace_s < 0:
            raise TrainOptionsError(f"Recovery(failure_grace_s={self.failure_grace_s!r}) must be a number >= 0")


class TrainerOwner(Actor):
    """Spawns, and stops, each generation's procs and trainer; forwards their failures to the controller."""

    def __init__(self, failures: Any) -> None:
        self.failures = failures
        self.procs: ProcMesh | None = None

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.failures.send(failure)
        return True

    @endpoint
    def build(self, hosts: Any, per_host: dict[str, int], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """New procs and a trainer on them (its setup done); the trainer mesh."""
        from ..mesh import this_host
        from ._trainer import spawn_trainer

        self.procs = (hosts if hosts is not None else this_host()).spawn_procs(per_host=per_host)
        return spawn_trainer(self.procs, *args, **kwargs)

    @endpoint
    def stop_procs(self) -> None:
        """Stop this generation's procs (bounded by the stop deadlines; the stuck are killed)."""
        procs, self.procs = self.procs, None
        if procs is not None:
            procs.stop("the trainer is replacing or stopping them").get(timeout=STOP_TIMEOUT_S)


class _Lost(Exception):
    """The current generation lost a rank; recover."""

    def __init__(self, rank: int | None, cause: str) -> None:
        super().__init__(cause)
        self.rank, self.cause = rank, cause


class ElasticTrainer:
    """A trainer mesh that is rebuilt from its last checkpoint when a proc dies (see the module docstring).

    Call it from one thread. ``step``/``step_figures`` are the trainer's, with
    ``timeout_s`` per attempt; ``mesh`` is the current generation's actor mesh.
    """

    def __init__(self, hosts: Any, per_host: dict[str, int], recovery: Recovery, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        from ..mesh import this_proc

        self.hosts, self.per_host, self.recovery = hosts, dict(per_host), recovery
        self._args, self._kwargs = args, kwargs
        port, self._receiver = Channel.open()
        self._owner: Any = this_proc().spawn(f"trainer_owner_{id(self):x}", TrainerOwner, port)
        self._wake = threading.Event()
        self._arm()
        self._base_name = str(kwargs.pop("name", "trainer")).replace("-", "_")
        self._generation = 0
        self._mesh_label = ""
        self.mesh: Any = None
        self.steps = 0
        self.restarts = 0
        self.recoveries: list[str] = []
        self.last_checkpoint: str | None = None
        self._replay: list[Any] = []  # batches the controller sent since the last checkpoint
        self._stopped = False
        self._build()
        if recovery.resume:
            self._resume()

    # ----------------------------------------------------------------- public

    def step(self, batch: Any = None, timeout_s: float = 600.0) -> float:
        """One step (see :meth:`Trainer.step`); its loss."""
        return self.step_figures(batch, timeout_s).loss

    def step_figures(self, batch: Any = None, timeout_s: float = 600.0) -> StepFigures:
        """One step; its figures, with ``recovery`` set when this call had to recover first."""
        notes: list[str] = []
        while True:
            try:
                figures = self._attempt(batch, timeout_s)
                break
            except _Lost as lost:
                notes.append(self._recover(lost, timeout_s))
        self.steps += 1
        if batch is not None:
            self._replay.append(batch)
        if self.steps % self.recovery.checkpoint_every == 0:
            self._checkpoint(timeout_s)
        return dataclasses.replace(figures, recovery="; ".join(notes) or None, restarts=self.restarts)

    def stop(self) -> None:
        """Stop the trainer, its procs and the owner (each wait bounded); a second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._owner.stop_procs.call_one().get(timeout=STOP_TIMEOUT_S + 10)
        finally:
            self._receiver.close()
            self._owner.stop("the elastic trainer was stopped").get(timeout=STOP_TIMEOUT_S)

    def __enter__(self) -> ElasticTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --------------------------------------------------------------- internal

    def _resume(self) -> None:
        """Load the newest complete checkpoint in the directory (DCP writes ``.metadata`` last)."""
        root = str(self.recovery.checkpoint_dir)
        names = sorted(n for n in os.listdir(root) if n.startswith("step_") and os.path.exists(os.path.join(root, n, ".metadata"))) \
            if os.path.isdir(root) else []
        if not names:
            log.info("no checkpoint in %s to resume from: starting at step 0", root)
            return
        path = os.path.join(root, names[-1])
        try:
            self.steps = self._await(list(self.mesh.load.stream(path)), float(self._kwargs.get("timeout", 600.0)), f"resuming from {path}")
        except Exception as exc:
            self._fail_stop(f"could not resume from {path}: {type(exc).__name__}: {exc}", None, exc)
        self.last_checkpoint = path
        log.warning("resumed from %s at step %d", path, self.steps)

    def _build(self) -> None:
        """A new generation: procs and trainer; failures are told apart by its mesh name."""
        self._generation += 1
        self._mesh_label = f"{self._base_name}_g{self._generation}"
        kwargs = dict(self._kwargs, name=self._mesh_label)
        try:
            self.mesh = self._owner.build.call_one(self.hosts, self.per_host, self._args, kwargs).get(
                timeout=float(self._kwargs.get("timeout", 600.0)) + 120)
        except Exception as exc:
            self._fail_stop(f"could not set up the trainer's procs: {type(exc).__name__}: {exc}", None, exc)

    def _fail_stop(self, message: str, rank: int | None, exc: BaseException | None) -> NoReturn:
        """Stop everything, then raise TrainingFailed (never returns)."""
        try:
            self.stop()
        except Exception as stop_exc:  # the error being reported matters more
            log.warning("stopping the failed trainer: %s", stop_exc)
        raise TrainingFailed(message, rank=rank, cause=str(exc) if exc else message) from exc

    def _arm(self) -> None:
        """Listen for the next failure; its arrival wakes whatever waits."""
        self._next_failure = self._receiver.recv()
        when_done(self._next_failure, self._wake.set)

    def _take_failure(self) -> MeshFailure | None:
        """A failure of the current generation that has arrived, else None (earlier generations' are dropped)."""
        while self._next_failure.done():
            failure = self._next_failure.get(timeout=0)
            self._arm()
            if failure.mesh_name.rsplit("-", 1)[0] == self._mesh_label:
                return failure
            log.debug("ignoring a failure of an earlier generation: %r", failure)
        return None

    def _await(self, replies: Sequence[Any], timeout_s: float, what: str) -> Any:
        """Every rank's reply, or the first error, or a failure of this generation, whichever first.

        Per-rank futures (``stream``) so that one rank's error is seen while its
        peers wait for it in a collective; returns the first reply's value, raises
        the first error (a SupervisionError as _Lost), or _Lost for a failure or timeout.
        """
        deadline = time.monotonic() + timeout_s
        self._wake.clear()
        for reply in replies:
            when_done(reply, self._wake.set)
        while True:
            failure = self._take_failure()
            if failure is not None:
                raise _Lost(_first(failure.crashed_ranks), failure.cause)
            errors = [r.exception(timeout=0) for r in replies if r.done()]
            error = next((e for e in errors if e is not None), None)
            if isinstance(error, SupervisionError):
                raise _Lost(error.rank, str(error.cause or error)) from error
            if error is not None:
                raise error
            if len(errors) == len(replies):
                return replies[0].get(timeout=0)
            if not self._wake.wait(max(0.0, deadline - time.monotonic())):
                raise _Lost(None, f"no reply to {what} within {timeout_s}s (a rank hung?)")
            self._wake.clear()

    def _failure_within(self, grace_s: float) -> MeshFailure | None:
        """A failure of this generation arriving within ``grace_s``, else None."""
        deadline = time.monotonic() + grace_s
        while True:
            self._wake.clear()
            failure = self._take_failure()
            if failure is not None or not self._wake.wait(max(0.0, deadline - time.monotonic())):
                return failure

    def _attempt(self, batch: Any, timeout_s: float) -> StepFigures:
        replies = list(self.mesh.step_figures.stream(*(() if batch is None else (batch,))))
        try:
            return self._await(replies, timeout_s, f"step {self.steps + 1}")
        except _Lost:
            raise
        except Exception as exc:
            self._judge(exc)
            raise  # unreachable: _judge raises

    def _judge(self, exc: Exception) -> NoReturn:
        """A rank's error: a lost proc seen late (-> _Lost) or the user's (-> stop, TrainingFailed)."""
        failure = self._failure_within(self.recovery.failure_grace_s)
        if failure is not None:
            raise _Lost(_first(failure.crashed_ranks), failure.cause) from exc
        original = getattr(exc, "exception", exc)
        rank = getattr(exc, "trainer_rank", None)
        where = f"rank {rank}" if rank is not None else "a rank"
        self._fail_stop(f"training stopped at step {self.steps + 1}: user code raised on {where}: "
                        f"{type(original).__name__}: {original}", rank, exc)

    def _recover(self, lost: _Lost, timeout_s: float) -> str:
        """Replace the generation, restore, replay (again if that loses a proc too); a note of what was done.

        TrainingFailed past max_restarts, or when new procs cannot be set up.
        """
        started = time.monotonic()
        while True:
            cause = lost.cause.strip().splitlines()[0] if lost.cause.strip() else "unknown cause"
            what = f"rank {lost.rank if lost.rank is not None else '?'} lost at step {self.steps + 1} ({cause})"
            self.restarts += 1
            if self.restarts > self.recovery.max_restarts:
                self._fail_stop(f"training stopped: {what}, and all {self.recovery.max_restarts} restarts are used", lost.rank, lost)
            log.warning("%s: replacing the procs (restart %d of %d)", what, self.restarts, self.recovery.max_restarts)
            try:
                restored = self._replace_and_restore(timeout_s)
                break
            except _Lost as again:
                lost = again
        source = f"checkpoint {self.last_checkpoint} (disk)" if self.last_checkpoint else "the initial weights (no checkpoint yet)"
        note = (f"{what}; procs replaced, restored step {restored} from {source}, replayed {self.steps - restored} "
                f"step(s), in {time.monotonic() - started:.1f}s (restart {self.restarts} of {self.recovery.max_restarts})")
        log.warning("%s", note)
        self.recoveries.append(note)
        return note

    def _replace_and_restore(self, timeout_s: float) -> int:
        """Stop this generation, build the next, load the last checkpoint, replay to ``self.steps``; the step restored."""
        self._owner.stop_procs.call_one().get(timeout=STOP_TIMEOUT_S + 10)
        self._build()
        restored = 0
        if self.last_checkpoint is not None:
            restored = self._await(list(self.mesh.load.stream(self.last_checkpoint)), timeout_s, "restoring the checkpoint")
        for i in range(restored, self.steps):
            self._attempt(self._replay[i - restored] if self._replay else None, timeout_s)
        return restored

    def _checkpoint(self, timeout_s: float) -> None:
        path = os.path.join(str(self.recovery.checkpoint_dir), f"step_{self.steps:08d}")
        while True:
            try:
                self._await(list(self.mesh.save.stream(path)), timeout_s, f"the checkpoint of step {self.steps}")
                break
            except _Lost as lost:
                self._recover(lost, timeout_s)
        previous, self.last_checkpoint = self.last_checkpoint, path
        self._replay.clear()
        if previous is not None and previous != path:
            shutil.rmtree(previous, ignore_errors=True)


def _first(ranks: Sequence[int]) -> int | None:
    return ranks[0] if ranks else None


def spawn_elastic_trainer(
    model_fn: Callable[[], Any],
    loss_fn: Callable[[Any, Any], Any],
    optimizer_fn: Callable[[Any], Any],
    plan: Plan | None = None,
    *,
    recovery: Recovery,
    hosts: Any = None,
    per_host: dict[str, int] | None = None,
    **trainer_kwargs: Any,
) -> ElasticTrainer:
    """Spawn procs (``per_host`` on ``hosts``, default ``this_host()`` with one proc per plan rank) and a
    trainer that comes back from a lost proc (:class:`ElasticTrainer`).

    ``trainer_kwargs`` are :func:`spawn_trainer`'s (``options``, ``data``,
    ``stages``, ``seed``, ``timeout``, ``pg_timeout_s``). Raises
    :class:`TrainingFailed` when the first procs or trainer cannot be set up
    (nothing is left running).

    Example::

        trainer = spawn_elastic_trainer(model_fn, lm_loss, optimizer_fn, Plan(fsdp=2), data=factory,
                                        recovery=Recovery("/tmp/ckpt", checkpoint_every=5, max_restarts=2))
        with trainer:
            for _ in range(20):
                print(trainer.step())
    """
    plan = Plan() if plan is None else plan
    if not isinstance(recovery, Recovery):
        raise TypeError(f"recovery must be an actormesh.parallel.Recovery, got {type(recovery).__name__}")
    per_host = dict(per_host) if per_host is not None else {"gpus": plan.world_size}
    return ElasticTrainer(hosts, per_host, recovery, (model_fn, loss_fn, optimizer_fn, plan), trainer_kwargs)
