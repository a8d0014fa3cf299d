"""``LLMServer``: one generation replica on a proc mesh, its model spread by ``Plan(tp=..., pp=...)``.

Every proc of the replica runs an ``LLMServer`` actor holding its chunk of
the model (its tensor-parallel heads of its pipeline stage) and that chunk's
KV cache. Rank 0 is the driver: it owns an :class:`~._engine.LLMEngine`
whose backend broadcasts each :class:`~actormesh.parallel.StepPlan` to the
other ranks over the replica's process group before running it, so all
ranks run the same steps in the same order; the other ranks run a follower
loop that receives plans and runs them. Requests, cancellations and weight
swaps reach rank 0 as actor messages and are taken between two steps;
after each step every caller's port gets one message with the new tokens
(and ends) of that caller's requests, so a client streaming many requests
pays one message per step, not one per token.

Use :func:`spawn_llm_server` to start one and
:class:`~actormesh.serve.LLMServerClient` to call it as a ``TokenGenerator``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from ..mesh import ActorMesh, ProcMesh
from ..parallel import Plan, StepPlan, check_weights
from ..runtime import Actor, Port, concurrent_endpoint, endpoint
from ._engine import LLMEngine
from ._scheduler import Event
from ._types import SamplingParams

__all__ = ["LLMServer", "spawn_llm_server"]

Weights = Mapping[str, Any] | str | os.PathLike[str] | None


class _Replica:
    """This rank's chunk, cache and runner, and the replica's process group (when it has several ranks)."""

    def __init__(self, model_fn: Callable[[], Any], plan: Plan, stages: Any, max_slots: int, max_context: int | None,
                 seed: int, pg_timeout_s: float) -> None:
        import torch

        from ..parallel import (KVCache, StepRunner, build_chunk, check_inference_plan, hidden_size_of, replica_stages,
                                stage_links, world_mesh)

        check_inference_plan(plan)
        with torch.device("meta"):
            probe = model_fn()
        ranges = replica_stages(probe, plan, stages)
        self.model_max = int(probe.max_context)
        self.max_context = self.model_max if max_context is None else int(max_context)
        if not 1 < self.max_context <= self.model_max:
            raise ValueError(f"max_context={max_context} must be in 2..{self.model_max} (the model's positions)")
        config = getattr(probe, "config", None)
        self.vocab_size = int(config.vocab_size) if getattr(config, "vocab_size", None) is not None else None
        self.distributed = plan.world_size > 1
        self.rank = int(os.environ.get("RANK", "0")) if self.distributed else 0
        links = None
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
        self.runner = StepRunner(self.chunk, cache, self.device, links, compile=plan.compile)

    def load(self, weights: Any) -> None:
        from ..parallel import load_weights, read_weights

        state = read_weights(weights) if isinstance(weights, (str, os.PathLike)) else weights
        load_weights([self.chunk], state)


def _seeded_weights(model_fn: Callable[[], Any], seed: int) -> dict[str, Any]:
    """The full model as a single process builds it under ``torch.manual_seed(seed)``."""
    import torch

    torch.manual_seed(seed)
    return model_fn().state_dict()


class _ReplicaBackend:
    """Rank 0's engine backend: broadcast each plan to the followers, then run it here too."""

    def __init__(self, replica: _Replica, server: LLMServer, idle_s: float) -> None:
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


class LLMServer(Actor):
    """One replica's rank: its model chunk; on rank 0 also the batching engine.

    Endpoints: ``setup()`` (all ranks), ``generate(request_id, prompt_ids,
    params, port)`` and ``cancel(request_id)`` (rank 0), ``stage_weights``
    (all ranks) then ``commit_weights`` (rank 0) to swap weights, ``info()``.
    """

    def __init__(self, model_fn: Callable[[], Any], plan: Plan | None = None, weights: Weights = None,
                 stages: Sequence[range] | str | None = None, max_slots: int = 32, max_context: int | None = None,
                 seed: int = 0, pg_timeout_s: float = 300.0, idle_s: float = 1.0) -> None:
        self.model_fn, self.plan = model_fn, plan or Plan()
        self.weights, self.stages, self.max_slots, self.max_context = weights, stages, max_slots, max_context
        self.seed, self.pg_timeout_s, self.idle_s = seed, pg_timeout_s, idle_s
        self.replica: _Replica | None = None
        self.engine: LLMEngine | None = None
        self._follower: threading.Thread | None = None
        self._follower_error: BaseException | None = None
        self._staged: dict[int, Any] = {}  #: weights staged for a swap, by version
        self._outbox: dict[Any, tuple[Port[Any], list[Any]]] = {}
        self._outbox_lock = threading.Lock()
        self._staged_lock = threading.Lock()

    @endpoint
    async def setup(self) -> dict[str, Any]:
        """Build this rank's chunk, load the weights, start the engine (rank 0) or the follower loop."""
        self.replica = replica = _Replica(self.model_fn, self.plan, self.stages, self.max_slots, self.max_context,
                                          self.seed, self.pg_timeout_s)
        if self.weights is not None:
            replica.load(self.weights)
        elif replica.distributed:  # one proc built the seeded model itself; ranks take their shards of it
            replica.load(_seeded_weights(self.model_fn, self.seed))
        self.weights = None  # not kept twice
        if replica.rank == 0:
            backend = _ReplicaBackend(replica, self, self.idle_s)
            self.engine = LLMEngine(backend=backend, max_slots=self.max_slots, seed=self.seed, idle_s=self.idle_s,
                                    name="llm-server-engine", after_events=self._flush)
        else:
            self._follower = threading.Thread(target=self._follow, name="llm-server-follower", daemon=True)
            self._follower.start()
        return self._info()

    def _follow(self) -> None:
        """Ranks other than 0: run the plans rank 0 broadcasts until it says stop."""
        import torch.distributed as dist

        assert self.replica is not None
        try:
            while True:
                box: list[Any] = [None]
                dist.broadcast_object_list(box, src=0)
                plan: StepPlan = box[0]
                if plan.kind == "stop":
                    return
                if plan.kind == "swap":
                    self._swap(plan.version)
                elif plan.kind == "step":
                    self.replica.runner.run(plan)
        except BaseException as exc:  # the replica is broken; rank 0's next collective times out and fails its requests
            self._follower_error = exc

    def _swap(self, version: int) -> None:
        """Follower side of a swap; the weights were checked when staged, so a failure here is unexpected."""
        assert self.replica is not None
        try:
            self.replica.load(self.take_staged(version))
            self.replica.version = version
        except Exception as exc:  # keep following: stopping would block rank 0's next broadcast
            self._follower_error = exc

    @concurrent_endpoint
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, port: Port[Any]) -> str:
        """Generate for one request (rank 0); its events go to ``port`` in batches.

        After every step each port gets one message: a list of ``(request_id,
        "token", id)`` and ``(request_id, "end", reason)`` items of the
        requests it asked for. Returns the finish reason ("stop", "length",
        "cancelled"). Raises ValueError for a prompt over the context,
        RuntimeError if a step failed, EngineClosedError when stopping.
        """
        engine = self._driver()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Event] = loop.create_future()

        def settle(event: Event) -> None:
            if not done.done():
                done.set_result(event)

        def sink(event: Event) -> None:
            if event.token is not None:
                self._queue(port, (request_id, "token", event.token))
                return
            if event.error is None:
                self._queue(port, (request_id, "end", event.finish))
            loop.call_soon_threadsafe(settle, event)

        engine.submit(prompt_ids, params, sink, request_id)
        event = await done
        if event.error is not None:
            raise event.error
        return cast(str, event.finish)

    def _queue(self, port: Port[Any], item: tuple[str, str, Any]) -> None:
        with self._outbox_lock:
            self._outbox.setdefault(port.ref, (port, []))[1].append(item)

    def _flush(self) -> None:
        """After each step (engine thread): one message per caller port with all its requests' events."""
        with self._outbox_lock:
            box, self._outbox = self._outbox, {}
        for port, items in box.values():
            port.send(items)

    @endpoint
    async def cancel(self, request_id: str) -> None:
        """Cancel a request (rank 0); its slot is free from the next step. Unknown ids are ignored."""
        self._driver().cancel(request_id)

    @endpoint
    async def stage_weights(self, version: int, weights: Weights) -> None:
        """Phase 1 of a swap, on every rank: read (a path) and check the new weights, keep them beside the old.

        Raises ValueError if they do not fit this rank's chunk; then nothing is staged.
        """
        if self.replica is None:
            raise RuntimeError("stage_weights before setup(): use spawn_llm_server")
        if weights is None:
            raise ValueError("weights must be a state dict or a path to a weights file, got None")
        replica = self.replica
        state = await asyncio.to_thread(_read_if_path, weights)
        await asyncio.to_thread(check_weights, [replica.chunk], state)
        with self._staged_lock:
            self._staged = {version: state}  # one swap at a time: a newer staging replaces an older one

    @endpoint
    async def commit_weights(self, version: int, drain: bool = False, timeout_s: float = 300.0) -> None:
        """Phase 2, on rank 0 once every rank staged ``version``: swap all ranks between two steps.

        ``drain=True`` lets the running requests finish on the old weights first
        (admissions pause meanwhile). Returns when every rank has the new weights.
        """
        engine = self._driver()
        await asyncio.to_thread(engine.update_weights, version, drain, timeout_s)

    def take_staged(self, version: int) -> Any:
        """The weights staged for ``version`` (engine or follower thread, at the swap)."""
        with self._staged_lock:
            if version not in self._staged:
                raise RuntimeError(f"rank {self.replica.rank if self.replica else '?'} has no weights staged for swap {version}: "
                                   "stage them on every rank (stage_weights) before commit_weights")
            return self._staged.pop(version)

    @endpoint
    async def info(self) -> dict[str, Any]:
        """This rank: max_context, vocab size, plan, stage boundaries, and (rank 0) the engine's counters."""
        return self._info()

    def _info(self) -> dict[str, Any]:
        r = self.replica
        import torch

        return {"rank": r.rank if r else None, "pid": os.getpid(), "torch_threads": torch.get_num_threads(), "max_context": r.max_context if r else None,
                "vocab_size": r.vocab_size if r else None, "plan": self.plan.describe(), "stages": r.stages if r else None,
                "stats": self.engine.stats() if self.engine is not None else None,
                "follower_error": repr(self._follower_error) if self._follower_error else None}

    def _driver(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("this LLMServer rank is not the replica's rank 0 (or setup() has not run): "
                               "send requests through LLMServerClient, which calls rank 0")
        return self.engine

    async def __cleanup__(self, exc: Exception | None) -> None:
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        from ..spmd import destroy_process_group

        if self.engine is not None:
            try:
                self.engine.close(timeout_s=30.0)  # broadcasts "stop" to the followers
            except TimeoutError:
                return  # a step is stuck in a collective: leave the process group to die with the proc
        if self._follower is not None:
            self._follower.join(30.0)
            if self._follower.is_alive():
                return
        if self.replica is not None and self.replica.distributed:
            destroy_process_group()


def _read_if_path(weights: Any) -> Any:
    from ..parallel import read_weights

    return read_weights(weights) if isinstance(weights, (str, os.PathLike)) else weights


def spawn_llm_server(procs: ProcMesh, model_fn: Callable[[], Any], plan: Plan | None = None, *, weights: Weights = None,
                     stages: Sequence[range] | str | None = None, max_slots: int = 32, max_context: int | None = None,
                     seed: int = 0, name: str = "llm", timeout: float = 300.0, pg_timeout_s: float = 300.0) -> ActorMesh[LLMServer]:
    """Start one generation replica on ``procs`` (``len(procs) == plan.tp * plan.pp``) and set it up.

    ``model_fn()`` builds the model (``functools.partial(hf_causal_lm, config)``
    or ``partial(gpt, ...)``); ``weights`` is a full state dict (HF names are
    accepted for HF models), a path every rank reads, or None for the seeded
    initial weights (``torch.manual_seed(seed)``). ``stages``: pipeline stage
    boundaries (None: equal split; ``"memory"``: the partitioner balances
    parameter bytes; or ``range``s). Raises PlanError for a plan that does not
    fit the procs or the model.

    Example::

        from functools import partial
        from actormesh.serve import LLMServerClient, spawn_llm_server

        server = spawn_llm_server(procs, partial(hf_causal_lm, cfg), Plan(tp=2))
        client = LLMServerClient(server)
        async for tok in client.generate([1, 2, 3], SamplingParams(max_tokens=8)): ...
    """
    from ..parallel import check_inference_plan
    from ..spmd import setup_torch_elastic_env

    plan = Plan() if plan is None else plan
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an actormesh.parallel.Plan, got {type(plan).__name__}")
    if not isinstance(procs, ProcMesh):
        raise TypeError(f"spawn_llm_server needs a ProcMesh (this_host().spawn_procs(...)), got {type(procs).__name__}")
    check_inference_plan(plan)
    plan.check_world(len(procs))
    if len(procs) > 1:
        setup_torch_elastic_env(procs, timeout=min(timeout, 120.0))
    server = cast("ActorMesh[LLMServer]", procs.spawn(name, LLMServer, model_fn, plan, weights, stages, max_slots,
                                                      max_context, seed, pg_timeout_s))
    try:
        server.setup.call().get(timeout=timeout)
    except BaseException:
        server.stop("setup failed").get(timeout=60)
        raise
    return server
