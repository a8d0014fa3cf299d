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
pays one message per step, not one per token. When steps are shorter than
``stream_interval_s``, the tokens of consecutive steps travel together
(at most that long after the first of them was sampled); a request's first
token and its end always go at once.

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
from ..parallel import Plan, PublishedWeights, StepPlan, check_weights
from ..runtime import Actor, Port, concurrent_endpoint, endpoint
from ._engine import LLMEngine
from ._llm_replica import _Replica, _ReplicaBackend, _seeded_weights
from ._scheduler import Event
from ._types import SamplingParams

__all__ = ["LLMServer", "spawn_llm_server"]

#: a state dict, a path each rank reads, or weights a trainer published (each rank fetches them over rdma)
Weights = Mapping[str, Any] | str | os.PathLike[str] | PublishedWeights | None


class LLMServer(Actor):
    """One replica's rank: its model chunk; on rank 0 also the batching engine.

    Endpoints: ``setup()`` (all ranks), ``generate(request_id, prompt_ids,
    params, port)``, ``generate_many(requests, port)`` and
    ``cancel(request_id)`` (rank 0), ``stage_weights``
    (all ranks) then ``commit_weights`` (rank 0) to swap weights, ``info()``.

    ``host_procs``: how many procs of replicas like this one share its host; each
    gives torch's CPU kernels its share of the host's cores (unless
    ``OMP_NUM_THREADS`` is set). None: the replica's own ranks on the host.
    """

    _clock = staticmethod(time.monotonic)  #: replaced by tests (virtual time)

    def __init__(self, model_fn: Callable[[], Any], plan: Plan | None = None, weights: Weights = None,
                 stages: Sequence[range] | str | None = None, max_slots: int = 32, max_context: int | None = None,
                 seed: int = 0, pg_timeout_s: float = 300.0, idle_s: float = 1.0,
                 stream_interval_s: float = 0.005, host_procs: int | None = None) -> None:
        if not stream_interval_s >= 0:
            raise ValueError(f"stream_interval_s must be >= 0 seconds, got {stream_interval_s!r}")
        self.model_fn, self.plan = model_fn, plan or Plan()
        self.weights, self.stages, self.max_slots, self.max_context = weights, stages, max_slots, max_context
        self.seed, self.pg_timeout_s, self.idle_s = seed, pg_timeout_s, idle_s
        self.host_procs = host_procs
        self.replica: _Replica | None = None
        self.engine: LLMEngine | None = None
        self._follower: threading.Thread | None = None
        self._follower_error: BaseException | None = None
        self._staged: dict[int, Any] = {}  #: weights staged for a swap, by version
        self._outbox: dict[Any, tuple[Port[Any], list[Any]]] = {}
        self._outbox_lock = threading.Lock()
        self.stream_interval_s = stream_interval_s
        self._oldest = 0.0  #: when the oldest unsent event was queued
        self._urgent = False  #: an unsent event must go after this step (a first token, an end)
        self._streaming: set[str] = set()  #: requests whose first token was sent
        self._staged_lock = threading.Lock()

    @endpoint
    async def setup(self) -> dict[str, Any]:
        """Build this rank's chunk, load the weights, start the engine (rank 0) or the follower loop."""
        self.replica = replica = _Replica(self.model_fn, self.plan, self.stages, self.max_slots, self.max_context,
                                          self.seed, self.pg_timeout_s, self.host_procs)
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
        event = await self._submit(request_id, prompt_ids, params, port, errors_to_port=False)
        if event.error is not None:
            raise event.error
        return cast(str, event.finish)

    @concurrent_endpoint
    async def generate_many(self, requests: list[tuple[str, list[int], SamplingParams]], port: Port[Any]) -> None:
        """Generate for several requests sent together (rank 0), so they join the batch at the same step.

        Events go to ``port`` as for :meth:`generate`; a request's error is an
        item ``(request_id, "failed", exception)`` there. Returns when every
        request has ended.
        """
        engine = self._driver()
        loop = asyncio.get_running_loop()
        done = [loop.create_future() for _ in requests]
        sinks = [self._sink(port, rid, loop, fut, errors_to_port=True) for (rid, _, _), fut in zip(requests, done)]
        good: list[tuple[str, list[int], SamplingParams, Callable[[Event], None]]] = []
        refused: list[tuple[str, str, BaseException]] = []
        for (rid, ids, params), sink, fut in zip(requests, sinks, done):
            try:
                engine.check(ids, params)
                good.append((rid, ids, params, sink))
            except ValueError as exc:  # this request only
                refused.append((rid, "failed", exc))
                fut.set_result(Event(error=exc))
        try:  # all at once, so they join the same step
            engine.submit_many(good)
        except Exception as exc:  # the engine is closed: none was queued
            refused += [(rid, "failed", exc) for rid, _, _, _ in good]
            for fut in done:
                if not fut.done():
                    fut.set_result(Event(error=exc))
        if refused:
            port.send(refused)
        await asyncio.gather(*done)

    def _submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, port: Port[Any],
                errors_to_port: bool) -> asyncio.Future[Event]:
        """Queue one request on the engine; the future gets its final event."""
        engine = self._driver()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Event] = loop.create_future()
        engine.submit(prompt_ids, params, self._sink(port, request_id, loop, done, errors_to_port), request_id)
        return done

    def _sink(self, port: Port[Any], request_id: str, loop: asyncio.AbstractEventLoop, done: asyncio.Future[Event],
              errors_to_port: bool) -> Callable[[Event], None]:
        """A request's events (on the engine thread) into the port's outbox; the last one also settles ``done``."""
        def settle(event: Event) -> None:
            if not done.done():
                done.set_result(event)

        def sink(event: Event) -> None:
            if event.prompt is not None:
                self._queue(port, (request_id, "prompt", event.prompt))
                return
            if event.token is not None:
                if event.logprob is None:
                    self._queue(port, (request_id, "token", event.token))
                elif event.top is None:
                    self._queue(port, (request_id, "token", (event.token, event.logprob)))
                else:
                    self._queue(port, (request_id, "token", (event.token, event.logprob, event.top)))
                return
            if event.error is None:
                self._queue(port, (request_id, "end", event.finish))
            elif errors_to_port:
                self._queue(port, (request_id, "failed", event.error))
            else:  # the error goes back as the call's reply
                with self._outbox_lock:
                    self._streaming.discard(request_id)
            loop.call_soon_threadsafe(settle, event)

        return sink

    def _queue(self, port: Port[Any], item: tuple[str, str, Any]) -> None:
        request_id, kind = item[0], item[1]
        with self._outbox_lock:
            if not self._outbox:
                self._oldest = self._clock()
            self._outbox.setdefault(port.ref, (port, []))[1].append(item)
            if kind == "token":
                if request_id not in self._streaming:  # time to first token is not delayed
                    self._streaming.add(request_id)
                    self._urgent = True
            elif kind != "prompt":  # the end of a request (a scored prompt comes with its first token)
                self._streaming.discard(request_id)
                self._urgent = True

    def _flush(self, next_step_s: float | None = None) -> None:
        """After each step (engine thread): one message per caller port with all its requests' events.

        Held back for one more step (``next_step_s``: how long it is expected
        to take, None if not short) when nothing urgent is queued and the
        oldest event would still leave within ``stream_interval_s``: on a
        fast model a message per step costs both sides more than the step.
        """
        with self._outbox_lock:
            if not self._outbox:
                return
            if (next_step_s is not None and not self._urgent
                    and self._clock() + next_step_s - self._oldest < self.stream_interval_s):
                return
            box, self._outbox, self._urgent = self._outbox, {}, False
        for port, items in box.values():
            port.send(items)

    @endpoint
    async def cancel(self, request_id: str) -> None:
        """Cancel a request (rank 0); its slot is free from the next step. Unknown ids are ignored."""
        self._driver().cancel(request_id)

    @endpoint
    async def stage_weights(self, version: int, weights: Weights) -> None:
        """Phase 1 of a swap, on every rank: read (a path) or fetch (published weights, into the
        replica's spare set) and check the new weights, keep them beside the old.

        Raises ValueError if they do not fit this rank's chunk; then nothing is staged.
        """
        if self.replica is None:
            raise RuntimeError("stage_weights before setup(): use spawn_llm_server")
        if weights is None:
            raise ValueError("weights must be a state dict or a path to a weights file, got None")
        replica = self.replica
        state: Any
        if isinstance(weights, PublishedWeights):  # checked, then read straight into the spare set (no copy at the swap)
            state = await asyncio.to_thread(replica.staging.stage, weights)
        else:
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
    from ..parallel import resolve_weights

    return resolve_weights(weights)  # a path is read, published weights are fetched from the trainer


def spawn_llm_server(procs: ProcMesh, model_fn: Callable[[], Any], plan: Plan | None = None, *, weights: Weights = None,
                     stages: Sequence[range] | str | None = None, max_slots: int = 32, max_context: int | None = None,
                     seed: int = 0, name: str = "llm", timeout: float = 300.0, pg_timeout_s: float = 300.0,
                     stream_interval_s: float = 0.005) -> ActorMesh[LLMServer]:
    """Start one generation replica on ``procs`` (``len(procs) == plan.tp * plan.pp``) and set it up.

    ``model_fn()`` builds the model (``functools.partial(hf_causal_lm, config)``
    or ``partial(gpt, ...)``); ``weights`` is a full state dict (HF names are
    accepted for HF models), a path every rank reads, or None for the seeded
    initial weights (``torch.manual_seed(seed)``). ``stages``: pipeline stage
    boundaries (None: equal split; ``"memory"``: the partitioner balances
    parameter bytes; or ``range``s). ``stream_interval_s``: the tokens of
    steps shorter than this travel to the caller together, at most this long
    after the first of them (0: a message after every step); first tokens
    and ends go at once. Raises PlanError for a plan that does not fit the
    procs or the model.

    Example::

        from functools import partial
        from actormesh.serve import LLMServerClient, spawn_llm_server

        server = spawn_llm_server(procs, partial(hf_causal_lm, cfg), Plan(tp=2))
        client = LLMServerClient(server)
        async for tok in client.generate([1, 2, 3], SamplingParams(max_tokens=8)): ...
    """
    from ..parallel import check_inference_plan
    from ..spmd import setup_torch_elastic_env

    if not stream_interval_s >= 0:
        raise ValueError(f"stream_interval_s must be >= 0 seconds, got {stream_interval_s!r}")
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
                                                      max_context, seed, pg_timeout_s,
                                                      stream_interval_s=stream_interval_s))
    try:
        server.setup.call().get(timeout=timeout)
    except BaseException:
        server.stop("setup failed").get(timeout=60)
        raise
    return server
