"""A generation replica's parts on each of its ranks: the model chunk, its cache and runner (``_Replica``),
and rank 0's engine backend, which broadcasts each step's plan to the other ranks (``_ReplicaBackend``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..parallel import Plan, StepPlan

__all__: list[str] = []  # private to the serve package


class _Staged(Protocol):
    def take_staged(self, version: int) -> Any: ...


class _Replica:
    """This rank's chunk, cache and runner, and the replica's process group (when it has several ranks)."""

    def __init__(self, model_fn: Callable[[], Any], plan: Plan, stages: Any, max_slots: int, max_context: int | None,
                 seed: int, pg_timeout_s: float, host_procs: int | None = None) -> None:
        import torch

        from ..spmd import share_host_cores

        from ..parallel import (KVCache, StepRunner, WeightStaging, build_chunk, check_inference_plan, hidden_size_of,
                                replica_stages, stage_links, world_mesh)

        check_inference_plan(plan)
        with torch.device("meta"):
            probe = model_fn()
        ranges = replica_stages(probe, plan, stages)
        self.model_max = int(probe.max_context)
        self.max_context = self.model_max if max_context is None else int(max_context)
        if not 1 < self.max_context <= self.model_max:
            raise ValueError(f"max_context={max_context} must be in 2..{self.model_max} (the model's positions)")
        config: Any = getattr(probe, "config", None)
        self.vocab_size = int(config.vocab_size) if getattr(config, "vocab_size", None) is not None else None
        self.distributed = plan.world_size > 1
        self.rank = int(os.environ.get("RANK", "0")) if self.distributed else 0
        links = None
        if host_procs is not None or self.distributed:
            # Threads spinning for cores other procs hold cost 2-20x on a busy CPU host.
            share_host_cores(host_procs if host_procs is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if self.distributed:
            from ..spmd import init_process_group

            init_process_group(timeout_s=pg_timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        mesh = world_mesh(plan, self.device.type) if self.distributed else None
        if mesh is not None:
            self.chunk = build_chunk(model_fn, plan, ranges, mesh, self.device)
        else:
            torch.manual_seed(seed)
            self.chunk = model_fn().to(self.device).eval()
        if self.distributed:
            dtype = next(self.chunk.parameters()).dtype
            links = stage_links(plan, self.rank, hidden_size_of(probe), dtype)
        self.stages = [list(r) for r in ranges] if ranges is not None else None
        cache = KVCache(max_slots, self.max_context, probe.sliding_window)
        self.version = 0  #: the weight version this rank holds (0: the ones it was built with)
        self.staging = WeightStaging([self.chunk])  #: the spare set published weights are read into
        self.runner = StepRunner(self.chunk, cache, self.device, links, compile=plan.compile)

    def load(self, weights: Any) -> None:
        """Install weights: staged ones are swapped in (no copy); others are read if needed and copied."""
        from ..parallel import StagedWeights, load_weights, resolve_weights

        if isinstance(weights, StagedWeights):
            self.staging.install(weights)
            return
        load_weights([self.chunk], resolve_weights(weights))


def _seeded_weights(model_fn: Callable[[], Any], seed: int) -> dict[str, Any]:
    """The full model as a single process builds it under ``torch.manual_seed(seed)``."""
    import torch

    torch.manual_seed(seed)
    return model_fn().state_dict()


class _ReplicaBackend:
    """Rank 0's engine backend: broadcast each plan to the followers, then run it here too."""

    def __init__(self, replica: _Replica, server: _Staged, idle_s: float) -> None:
        self.replica, self.server, self.idle_s = replica, server, idle_s
        self.max_context, self.vocab_size = replica.max_context, replica.vocab_size
        self.broken = False
        self._last_broadcast = time.monotonic()

    def _broadcast(self, plan: StepPlan) -> None:
        if not self.replica.distributed:
            return
        import torch.distributed as dist

        try:
            dist.broadcast_object_list([plan], src=0)
        except Exception:
            self.broken = True
            raise
        self._last_broadcast = time.monotonic()

    def run(self, plan: StepPlan) -> list[int]:
        self._broadcast(plan)
        try:
            out = self.replica.runner.run(plan)
        except Exception:
            self.broken = self.replica.distributed  # the followers' step may be stuck half-way
            raise
        assert out is not None
        return out

    @property
    def last_logprobs(self) -> list[float] | None:
        """The last step's log-probabilities, when its plan asked for them."""
        return self.replica.runner.last_logprobs

    @property
    def last_top_logprobs(self) -> list[tuple[tuple[int, float], ...]] | None:
        """The last step's most probable tokens per row, when its plan asked for them."""
        return self.replica.runner.last_top_logprobs

    @property
    def last_prompt_logprobs(self) -> dict[int, Any] | None:
        """The last step's prompt scores per row, when its plan asked for them."""
        return self.replica.runner.last_prompt_logprobs

    def idle(self) -> None:
        if self.replica.distributed and time.monotonic() - self._last_broadcast >= self.idle_s:
            self._broadcast(StepPlan(kind="idle"))

    def swap(self, version: int) -> None:
        self._broadcast(StepPlan(kind="swap", version=version))
        self.replica.load(self.server.take_staged(version))
        self.replica.version = version

    def close(self) -> None:
        try:
            self._broadcast(StepPlan(kind="stop"))
        except Exception:
            pass
