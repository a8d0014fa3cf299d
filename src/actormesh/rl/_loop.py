"""``GRPOLoop``: post-training on one controller: a generator service, a reference model, a trainer, a buffer.

Theory of operation. The loop owns every part it starts: an
:class:`~actormesh.serve.LLMService` of generator replicas (continuous
batching, sampling with log-probabilities), a :class:`ReferenceModel` on a
proc of its own (when the KL term is on), a trainer under any
:class:`~actormesh.parallel.Plan` whose loss is :func:`grpo_loss`, and a
:class:`ReplayBuffer` actor. Version 0 of the weights is the trainer's
initial model, which the generators and the reference load.

A step takes ``prompts_per_step`` groups of ``group_size`` completions from
the buffer, scores them with the reference, packs them and runs one trainer
step; every ``sync_every`` steps the new weights go to every generator
replica (:mod:`._weights`), which swaps them between two decode steps, and
the version goes up. In ``"sync"`` mode the groups are generated for the
step, then trained on; in ``"async"`` mode a generation thread keeps the
buffer filled with the weights of the moment while the trainer steps, and the
buffer drops groups more than ``max_policy_lag`` versions old. A sample is
tagged with the version in force when it was requested, a lower bound of
the weights it was drawn with (a swap may land while it is being decoded);
its log-probabilities are those it was drawn with, whatever the version.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..errors import SupervisionError
from ..mesh import ActorMesh, ProcMesh, this_host, this_proc
from ..parallel import (ElasticTrainer, Plan, Recovery, Trainer, gather_state_dict, spawn_elastic_trainer,
                        spawn_trainer)
from ..serve import LLMService, SamplingParams
from ._buffer import ReplayBuffer
from ._grpo import GRPOConfig, Sample, group_advantages, grpo_loss, pack_batch
from ._reference import ReferenceModel
from ._rollout import generate_groups
from ._weights import push_weights

__all__ = ["GRPOLoop", "StepReport"]

log = logging.getLogger(__name__)


@dataclass
class StepReport:
    """What one trainer step did (the figures a progress line shows)."""

    step: int
    reward_mean: float
    reward_max: float
    loss: float
    kl: float  #: mean k3 estimate of KL(sampling policy || reference) over completion tokens
    samples: int
    samples_per_s: float  #: completions trained on per second of this step
    policy_lag: int  #: the trainer's version minus the oldest sample's
    version: int  #: the generators' weights version after this step
    sync_s: float  #: seconds pushing weights this step (0 when it did not)
    trainer_idle: float  #: fraction of this step the trainer waited for samples
    dropped: dict[str, int] = field(default_factory=dict)  #: samples dropped so far, by why
    figures: Any = None  #: the trainer's StepFigures (grad norm, lr, tokens/s, memory)


class GRPOLoop:
    """GRPO on one controller: ``model_fn`` is the policy (and reference) architecture.

    ``prompts(step) -> list of prompts`` (token ids) gives ``prompts_per_step``
    prompts; ``reward_fn(prompt, completion) -> float`` scores a completion
    (it may call an actor); a sample whose reward raises is dropped (counted
    and logged once per kind of error). ``trainer_plan`` places the trainer
    (``Plan(dp=2)``, ``Plan(fsdp=2)``...), ``generator_plan`` each of
    ``generator_replicas`` replicas. Everything runs on ``host`` (default:
    this host); :meth:`stop` (or leaving ``with``) frees every proc. A trainer
    rank that dies stops the loop: the step raises its ``SupervisionError``
    (naming the rank); with ``trainer_recovery`` (a
    :class:`~actormesh.parallel.Recovery`: checkpoint directory and interval,
    ``max_restarts``) the trainer comes back from its last checkpoint instead
    and the step returns normally, later (``report.figures.recovery`` says so).

    Example::

        with GRPOLoop(partial(hf_causal_lm, cfg), reward, prompts, GRPOConfig(group_size=8),
                      partial(torch.optim.AdamW, lr=3e-3), trainer_plan=Plan(dp=2)) as loop:
            for report in loop.run(100):
                print(report.step, report.reward_mean)
    """

    def __init__(self, model_fn: Callable[[], Any], reward_fn: Callable[[list[int], list[int]], float],
                 prompts: Callable[[int], Sequence[Sequence[int]]], config: GRPOConfig, optimizer_fn: Callable[[Any], Any],
                 *, trainer_plan: Plan | None = None, generator_plan: Plan | None = None, generator_replicas: int = 2,
                 host: Any = None, seed: int = 0, max_slots: int = 32, trainer_recovery: Recovery | None = None,
                 timeout_s: float = 600.0) -> None:
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}")
        if not callable(reward_fn) or not callable(prompts):
            raise TypeError("reward_fn and prompts must be callables: reward_fn(prompt, completion) -> float, prompts(step) -> prompts")
        self.config, self.reward_fn, self.prompts, self.timeout_s = config, reward_fn, prompts, timeout_s
        self.trainer_plan = trainer_plan or Plan()
        self.trainer_plan.check_batch(config.batch_size)
        host = host or this_host()
        self._owned: list[Any] = []
        self.version, self.steps = 0, 0
        self.dropped: Counter[str] = Counter()
        self._closed = False
        self._async: _AsyncGeneration | None = None
        try:
            loss = partial(grpo_loss, clip_eps=config.clip_eps, kl_coef=config.kl_coef, norm=config.norm)
            self._elastic: ElasticTrainer | None = None
            if trainer_recovery is None:
                procs = self._own(host.spawn_procs(per_host={"gpus": self.trainer_plan.world_size}))
                self._trainer = spawn_trainer(procs, model_fn, loss, optimizer_fn, self.trainer_plan, seed=seed,
                                              name="grpo-trainer", timeout=timeout_s)
            else:
                self._elastic = spawn_elastic_trainer(model_fn, loss, optimizer_fn, self.trainer_plan, recovery=trainer_recovery,
                                                      hosts=host, seed=seed, timeout=timeout_s)
                self._owned.append(self._elastic)
            initial = gather_state_dict(self.trainer, timeout=timeout_s)
            self.reference = None
            if config.kl_coef:
                ref_procs = self._own(host.spawn_procs(per_host={"gpus": 1}))
                self.reference = ref_procs.spawn("grpo-reference", ReferenceModel, model_fn, initial)
            self.generator = LLMService(model_fn, generator_plan or Plan(), replicas=generator_replicas, weights=initial,
                                        max_slots=max_slots, seed=seed, name="grpo-generator",
                                        max_queue=max(64, config.batch_size))
            self._owned.append(self.generator)
            self.generator.ready(timeout_s)
            self.buffer = this_proc().spawn("grpo-buffer", ReplayBuffer, config.max_policy_lag)
            self._owned.append(self.buffer)
        except BaseException:
            self.stop()
            raise

    @property
    def trainer(self) -> ActorMesh[Trainer]:
        """The trainer's actor mesh (with ``trainer_recovery``, the current one: a recovery makes a new one)."""
        return self._elastic.mesh if self._elastic is not None else self._trainer

    def _train(self, batch: tuple[Any, Any]) -> Any:
        """One trainer step; its StepFigures. Without recovery a lost rank raises its SupervisionError."""
        if self._elastic is not None:
            return self._elastic.step_figures(batch, self.timeout_s)
        return _first_reply(list(self._trainer.step_figures.stream(batch)), self.timeout_s)

    def _own(self, procs: ProcMesh) -> ProcMesh:
        self._owned.append(procs)
        return procs

    # ------------------------------------------------------------------ running

    def run(self, steps: int) -> Iterator[StepReport]:
        """Run ``steps`` trainer steps, yielding each one's :class:`StepReport`."""
        if self._closed:
            raise RuntimeError("this GRPOLoop was stopped: make a new one")
        if self.config.mode == "async" and self._async is None:
            self._async = _AsyncGeneration(self)
        for _ in range(steps):
            yield self.step()

    def step(self) -> StepReport:
        """One trainer step (and a weight push every ``sync_every``); see the module's docstring."""
        if self._closed:
            raise RuntimeError("this GRPOLoop was stopped: make a new one")
        cfg = self.config
        t0 = time.perf_counter()
        if cfg.mode == "sync":
            for group in self._generate(self.steps):
                self.buffer.add.call_one(group).get(timeout=self.timeout_s)
        groups = self._take(cfg.prompts_per_step)
        waited = time.perf_counter() - t0
        samples = [s for g in groups for s in g]
        inputs, targets = self._pack(samples)
        figures = self._train((inputs, targets))
        self.steps += 1
        lag = self.version - min(s.version for s in samples)
        sync_s = 0.0
        if self.steps % cfg.sync_every == 0:
            sync_s = push_weights(self.trainer, self.generator, self.version + 1, self.timeout_s)
            self.version += 1
        rewards = [s.reward for s in samples]
        elapsed = time.perf_counter() - t0
        return StepReport(
            step=self.steps, reward_mean=sum(rewards) / len(rewards), reward_max=max(rewards), loss=float(figures.loss),
            kl=_kl(targets), samples=len(samples), samples_per_s=len(samples) / elapsed,
            policy_lag=lag, version=self.version,
            sync_s=sync_s, trainer_idle=waited / elapsed, dropped=dict(self.dropped), figures=figures)

    def _take(self, n_groups: int) -> list[list[Sample]]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            groups = self.buffer.take.call_one(n_groups, self.version).get(timeout=self.timeout_s)
            if groups is not None:
                if self._async is not None:
                    self._async.took()
                return groups
            if self._async is not None:
                self._async.check()
                self._async.wait_for_more(min(1.0, max(0.0, deadline - time.monotonic())))
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {n_groups} fresh groups of samples within {self.timeout_s}s")
            if self._async is None:  # sync: groups were dropped (rewards raised): generate more
                for group in self._generate(self.steps):
                    self.buffer.add.call_one(group).get(timeout=self.timeout_s)

    def _generate(self, step: int) -> list[list[Sample]]:
        """The groups for one step's prompts, scored, advantages set (groups left with < 2 samples dropped)."""
        prompts = [list(map(int, p)) for p in self.prompts(step)]
        if not prompts:
            raise ValueError(f"prompts({step}) gave no prompts")
        cfg = self.config
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, logprobs=True,
                                stop_token_ids=tuple(cfg.stop_token_ids))
        groups = asyncio.run(generate_groups(self.generator, prompts, cfg.group_size, params, self.version,
                                             self.timeout_s, self.dropped))
        scored = [self._score(g) for g in groups if len(g) >= 2]
        return [g for g in scored if g is not None]

    def _score(self, group: list[Sample]) -> list[Sample] | None:
        kept = []
        for s in group:
            try:
                s.reward = float(self.reward_fn(s.prompt, s.tokens))
            except Exception as exc:
                kind = f"reward raised {type(exc).__name__}"
                if not self.dropped[kind]:
                    log.warning("dropping a sample: the reward function raised %r (logged once per kind)", exc)
                self.dropped[kind] += 1
                continue
            kept.append(s)
        if len(kept) < 2:
            return None
        for s, adv in zip(kept, group_advantages([s.reward for s in kept], len(kept))):
            s.advantage = adv
        return kept

    def _pack(self, samples: list[Sample]) -> tuple[Any, Any]:
        """The trainer's batch: reference log-probabilities filled in, padded to a size the plan splits."""
        inputs, targets = pack_batch(samples)
        if self.reference is not None:
            ref = self.reference.logprobs.call_one(inputs, targets).get(timeout=self.timeout_s)
            targets[..., 4] = ref * targets[..., 1] + targets[..., 3] * (1 - targets[..., 1])
        return _pad(inputs, targets, self.trainer_plan.dp_size)

    # ------------------------------------------------------------------ stopping

    def stop(self) -> None:
        """Stop generation and free every proc the loop started (safe to call twice)."""
        self._closed = True
        if self._async is not None:
            self._async.close()
        for part in reversed(self._owned):
            try:
                if isinstance(part, (LLMService, ElasticTrainer)):
                    part.stop()
                else:
                    part.stop().get(timeout=60)
            except Exception as exc:  # keep freeing the others
                log.warning("stopping %r: %r", part, exc)
        self._owned.clear()

    def __enter__(self) -> GRPOLoop:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


#: after a rank's error, how long to wait for a supervision error from another rank that may explain it
FAILURE_GRACE_S = 3.0


def _first_reply(replies: list[Any], timeout_s: float) -> Any:
    """The first rank's value once every rank replied; else the error that explains the failure.

    A rank that dies leaves its peers' collectives failing (gloo's RuntimeError)
    often before the death itself is reported, so after a first error the other
    replies get ``FAILURE_GRACE_S`` to bring the SupervisionError that names the
    lost rank, which is raised in preference.
    """
    deadline = time.monotonic() + timeout_s
    errors: list[BaseException] = []
    for reply in replies:
        left = deadline - time.monotonic()
        if errors:
            left = min(left, FAILURE_GRACE_S)
        try:
            reply.get(timeout=max(0.0, left))
        except TimeoutError:
            if not errors:
                raise TimeoutError(f"a trainer step did not finish within {timeout_s}s") from None
            break
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise next((e for e in errors if isinstance(e, SupervisionError)), errors[0])
    return replies[0].get(timeout=0)


def _pad(inputs: Any, targets: Any, multiple: int) -> tuple[Any, Any]:
    """Rows of zero mask up to a multiple of ``multiple`` (they add nothing to the loss)."""
    import torch

    extra = -inputs.shape[0] % multiple
    if not extra:
        return inputs, targets
    return (torch.cat([inputs, inputs[:extra].clone()]),
            torch.cat([targets, torch.zeros_like(targets[:extra])]))


def _kl(targets: Any) -> float:
    """Mean k3 estimate of KL(sampling policy || reference) over the batch's completion tokens."""
    import torch

    mask, old, ref = targets[..., 1], targets[..., 3], targets[..., 4]
    delta = ref - old
    k3 = (torch.exp(delta) - delta - 1) * mask
    return float(k3.sum() / mask.sum().clamp(min=1))


class _AsyncGeneration:
    """A thread that keeps the buffer supplied with groups drawn with the weights of the moment."""

    def __init__(self, loop: GRPOLoop) -> None:
        self.loop = loop
        cfg = loop.config
        # Held groups the trainer can still take before they are max_policy_lag versions old: whatever is
        # drawn beyond that goes stale unread (with a lag of 1, two steps ahead wasted about a fifth).
        self.ahead = cfg.prompts_per_step * max(1, cfg.max_policy_lag * cfg.sync_every)
        self._stop = threading.Event()
        self._more = threading.Condition()
        self._taken = threading.Condition()
        self._takes = 0  #: how many times the trainer took groups
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="grpo-generation", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        step = 0
        try:
            while not self._stop.is_set():
                seen = self._takes
                held = self.loop.buffer.stats.call_one().get(timeout=self.loop.timeout_s)["held"]
                if held >= self.ahead:  # enough ahead: wait for the trainer's next take
                    with self._taken:
                        self._taken.wait_for(lambda: self._takes != seen or self._stop.is_set(), timeout=1.0)
                    continue
                for group in self.loop._generate(step):
                    self.loop.buffer.add.call_one(group).get(timeout=self.loop.timeout_s)
                step += 1
                with self._more:
                    self._more.notify_all()
        except BaseException as exc:  # the trainer's next wait raises it
            if not self._stop.is_set():
                self.error = exc
            with self._more:
                self._more.notify_all()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"generation failed: {self.error!r}") from self.error

    def wait_for_more(self, timeout_s: float) -> None:
        with self._more:
            self._more.wait(timeout_s)

    def took(self) -> None:
        """The trainer took groups: room for more."""
        with self._taken:
            self._takes += 1
            self._taken.notify_all()

    def close(self) -> None:
        self._stop.set()
        with self._taken:
            self._taken.notify_all()
        self._thread.join(self.loop.timeout_s)
