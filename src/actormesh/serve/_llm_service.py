"""``LLMService``: a :class:`Service` of ``LLMServer`` replicas, seen as one TokenGenerator.

Theory of operation. The service builds each replica (``tp * pp`` procs) and
rebuilds a dead one in the background; it knows nothing of the replica's
collective ``setup()``. So a watcher thread of this object looks at the
service's replica table every ``poll_s`` and, for each incarnation that is healthy
and not yet set up, gives its procs torchrun's environment and calls
``setup()`` on all its ranks. A request the router sends to an incarnation
that is still being set up waits for it there (``ServedLLM.generate``, bounded
by ``setup_timeout_s``).

A request is one long ``generate`` call routed by the service (so admission
limits, least-loaded routing and failure handling are the service's); tokens
come back through one port of this object, one message per replica step
(``LLMServer``'s protocol), which a receiver thread hands to each request's
stream. If the replica dies mid-request the call fails with
``ReplicaFailed`` ("may or may not have run") at once. Closing the token
stream early sends ``cancel`` to every replica's rank 0 (an unknown request id
is ignored there), which frees the slot of the one that has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ..parallel import Plan
from ..runtime import Channel, Port, concurrent_endpoint, endpoint
from ._errors import ReplicaFailed
from ._llm_client import Sinks, dispatch_batch, receive_batches, stream_tokens
from ._llm_server import LLMServer, Weights
from ._scheduler import check_prompt
from ._service import Service
from ._types import SamplingParams

log = logging.getLogger(__name__)


class ServedLLM(LLMServer):
    """An ``LLMServer`` that a ``Service`` builds: requests that arrive before ``setup()``
    has finished wait for it (at most ``setup_timeout_s``)."""

    setup_timeout_s = 300.0
    _setup_error: BaseException | None = None
    _serving = False  #: set up without error

    @endpoint
    async def setup(self, weights: Weights = None, version: int = 0) -> dict[str, Any]:
        """``LLMServer.setup`` with the service's current ``weights`` (None: those given at
        creation) as ``version``, remembering a failure so that requests fail at once."""
        if weights is not None:
            self.weights = weights
        try:
            info = await super().setup()
        except BaseException as exc:
            self._setup_error = exc
            raise
        assert self.replica is not None
        self.replica.version = version
        self._serving = True
        return info

    @endpoint
    async def stage_weights(self, version: int, weights: Weights) -> bool:
        """``LLMServer.stage_weights``; False (nothing staged) on a replica not set up: its
        ``setup()`` is given the service's current weights instead."""
        if not self._serving:
            return False
        await super().stage_weights(version, weights)
        return True

    @endpoint
    async def commit_weights(self, version: int, drain: bool = False, timeout_s: float = 300.0) -> bool:
        """``LLMServer.commit_weights``; False on a replica not set up (see ``stage_weights``)."""
        if not self._serving:
            return False
        await super().commit_weights(version, drain, timeout_s)
        return True

    @endpoint
    async def drop_staged(self) -> None:
        """Forget weights staged for a swap that was called off (frees their memory)."""
        with self._staged_lock:
            self._staged = {}

    @endpoint
    async def check_version(self, version: int, timeout_s: float = 60.0) -> None:
        """Wait until this rank holds weights ``version`` (followers load them just after rank 0);
        raise if it does not within ``timeout_s`` or its follower loop failed."""
        if not self._serving:
            return  # not set up: its setup() is given the current weights
        deadline = time.monotonic() + timeout_s
        while self.replica is None or self.replica.version != version:
            held = self.replica.version if self.replica is not None else None
            if self._follower_error is not None or time.monotonic() > deadline:
                raise RuntimeError(f"this rank holds weights version {held}, not {version} "
                                   f"(follower error: {self._follower_error!r})")
            await asyncio.sleep(0.01)  # the follower thread's load finishes within a step

    @concurrent_endpoint
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, port: Port[Any]) -> str:
        """``LLMServer.generate``, once this replica is set up."""
        deadline = time.monotonic() + self.setup_timeout_s
        while self.engine is None:
            if self._setup_error is not None:
                raise RuntimeError(f"this replica's setup failed: {self._setup_error!r}")
            if self.replica is not None and self.replica.rank != 0:
                raise RuntimeError("generate reached a rank other than 0 of an LLM replica")
            if time.monotonic() > deadline:
                raise RuntimeError(f"this replica was not set up within {self.setup_timeout_s}s")
            await asyncio.sleep(0.05)  # set-up is a once-per-incarnation event; polling it costs nothing per token
        return await super().generate(request_id, prompt_ids, params, port)

    @endpoint
    async def cancel(self, request_id: str) -> None:
        """Cancel a request if this replica has it (ids it never saw are ignored)."""
        if self.engine is not None:
            self.engine.cancel(request_id)


class LLMService:
    """``replicas`` LLM replicas of ``plan.tp * plan.pp`` procs each, behind a Service.

    A :class:`~actormesh.serve.TokenGenerator`. ``model_fn``, ``weights`` and
    ``stream_interval_s`` are as for :func:`spawn_llm_server`. ``service_options`` go to
    :class:`Service` (``max_queue``, ``router``, ``max_rebuilds``, ``hosts``...).

    Example::

        llm = LLMService(partial(hf_causal_lm, cfg), Plan(tp=2), replicas=2, weights="/models/tiny")
        llm.ready(timeout_s=300)
        async for tok in llm.generate([1, 2, 3], SamplingParams(max_tokens=8)): ...
        llm.stop()
    """

    def __init__(
        self,
        model_fn: Callable[[], Any],
        plan: Plan | None = None,
        *,
        replicas: int = 1,
        weights: Weights = None,
        max_slots: int = 16,
        max_context: int | None = None,
        seed: int = 0,
        token_timeout_s: float = 300.0,
        poll_s: float = 0.1,
        stream_interval_s: float = 0.005,
        **service_options: Any,
    ) -> None:
        self.plan = plan = Plan() if plan is None else plan
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be an actormesh.parallel.Plan, got {type(plan).__name__}")
        if not stream_interval_s >= 0:
            raise ValueError(f"stream_interval_s must be >= 0 seconds, got {stream_interval_s!r}")
        options: dict[str, Any] = {"name": "llm", "max_concurrency": max_slots,
                   "all_members": ("setup", "stage_weights", "drop_staged", "check_version")}
        options.update(service_options)
        self.service: Service[ServedLLM] = Service(
            {"gpus": plan.world_size}, replicas, ServedLLM, model_fn, plan, weights, None, max_slots, max_context, seed,
            300.0, 1.0, stream_interval_s, replicas * plan.world_size, **options,
        )
        self.token_timeout_s = token_timeout_s
        self.max_context: int = 0  # known once a replica is set up (ready())
        self.vocab_size: int | None = None
        self._poll_s = poll_s
        self._set_up: set[tuple[int, int]] = set()
        self._failed: dict[tuple[int, int], BaseException] = {}
        self._weights: Weights = None  #: the weights replicas are set up with (None: those given here)
        self._version = 0
        self._weights_lock = threading.Lock()  # a swap and a replica's set-up never interleave
        self._first = threading.Event()
        self._closing = threading.Event()
        self._sinks: Sinks = {}  # request id -> its stream's loop and queue
        self._port, self._receiver = Channel.open()
        self._receiver_thread = threading.Thread(target=self._receive, name="llm-service-receiver", daemon=True)
        self._receiver_thread.start()
        self._watcher = threading.Thread(target=self._watch, name="llm-service-setup", daemon=True)
        self._watcher.start()

    # -- replica set-up -------------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closing.wait(self._poll_s):
            for info in self.service.replicas():
                key = (info.slot, info.generation)
                if info.state != "healthy" or info.mesh is None or key in self._set_up or key in self._failed:
                    continue
                try:
                    with self._weights_lock:  # the current weights, never ones a swap is replacing
                        self._setup(info.procs, info.mesh)
                except Exception as exc:  # the replica is broken; supervision rebuilds it if its procs die
                    log.warning("setting up LLM replica %d (incarnation %d) failed: %r", info.slot, info.generation, exc)
                    self._failed[key] = exc
                    continue
                self._set_up.add(key)

    def _setup(self, procs: Any, mesh: Any) -> None:
        from ..spmd import setup_torch_elastic_env

        if len(procs) > 1:
            setup_torch_elastic_env(procs, timeout=120.0)
        infos = list(mesh.setup.call(self._weights, self._version).get(timeout=ServedLLM.setup_timeout_s).values())
        head = next(i for i in infos if i["rank"] == 0)
        self.max_context, self.vocab_size = int(head["max_context"]), head["vocab_size"]
        self._first.set()

    def ready(self, timeout_s: float = 600.0) -> LLMService:
        """Wait until every replica is up and at least one is set up; raise what failed."""
        self.service.ready().get(timeout=timeout_s)
        if not self._first.wait(timeout_s):
            raise TimeoutError(f"no LLM replica was set up within {timeout_s}s: {self.setup_failures() or 'no error yet'}")
        return self

    def setup_failures(self) -> dict[tuple[int, int], BaseException]:
        """``(slot, incarnation) -> error`` for replicas whose ``setup()`` failed."""
        return dict(self._failed)

    @property
    def max_sequences(self) -> int:
        """The most requests (sequences) it holds at once, running and queued (``Service.capacity``)."""
        return self.service.capacity()

    def healthy(self) -> bool:
        """Whether at least one replica is healthy and set up (for ``GET /health``)."""
        return any(
            i.state == "healthy" and (i.slot, i.generation) in self._set_up for i in self.service.replicas()
        )

    # -- weight swap ----------------------------------------------------------------------------------------
    def update_weights(self, weights: Weights, drain: bool = False, timeout_s: float = 300.0) -> dict[int, str]:
        """Swap the weights of every replica, with no request lost; returns each replica's outcome.

        ``weights``: a full state dict (kept on the controller while it is the
        current one) or a path each replica reads. Each replica double-buffers
        (``drain=False``: running requests continue on the new weights from the
        next step) or drains (``drain=True``: they finish on the old ones).
        Every healthy replica first checks and stages them; if one refuses
        them, nothing is swapped anywhere and ValueError says which and why.
        Then each swaps; a replica that fails to (or whose ranks do not all
        hold the new version) is restarted, and a replica (re)built later loads
        the new weights. Outcomes by slot: ``"swapped"``, ``"restarted ..."``,
        ``"set up later with the new weights"`` (being built or rebuilt), or
        ``"not serving: its set-up failed ..."``.
        ``timeout_s`` bounds each replica's swap (with ``drain``, the wait for its
        running requests); staging may take 60 s more (reading a path).
        Raises ServiceUnavailable (nothing changed) when no replica is healthy.
        """
        if weights is None or not (isinstance(weights, (str, os.PathLike)) or hasattr(weights, "keys")):
            raise TypeError(f"weights must be a state dict or a path each replica reads, got {type(weights).__name__}")
        with self._weights_lock:
            version = self._version + 1
            staged = self._fan("stage_weights", timeout_s + 60, version, weights)
            refused = {slot: err for slot, (_, _, err) in staged.items() if err is not None and not isinstance(err, ReplicaFailed)}
            if refused:
                self._fan("drop_staged", 60.0)
                slot, first = min(refused.items())
                raise ValueError(f"the new weights were refused by replica {slot} ({len(refused)} of {len(staged)} "
                                 f"replicas refused them); no replica was swapped, the old weights keep serving: {first}") from first
            self._weights, self._version = weights, version  # from here, replicas set up later load these
            committed = self._fan("commit_weights", timeout_s + 30, version, drain, timeout_s)
            outcomes = {slot: self._restart(slot, gen, version, err) for slot, (gen, _, err) in committed.items() if err}
            # then every rank of the others must hold the new version (restarted ones are out of the fan-out)
            checked = self._fan("check_version", 90.0, version) if len(outcomes) < len(committed) else {}
            for slot, (gen, swapped, _) in committed.items():
                if slot in outcomes:
                    continue
                gen_now, _, err = checked.get(slot, (gen, None, None))
                if err is not None and gen_now == gen:
                    outcomes[slot] = self._restart(slot, gen, version, err)
                elif swapped:
                    outcomes[slot] = "swapped"
                elif (slot, gen) in self._failed:
                    outcomes[slot] = f"not serving: its set-up failed ({self._failed[(slot, gen)]!r})"
                else:
                    outcomes[slot] = "set up later with the new weights"
            return dict(sorted(outcomes.items()))

    def _restart(self, slot: int, generation: int, version: int, error: BaseException) -> str:
        """A replica whose swap failed might serve old or mixed weights: rebuild it (with the new ones)."""
        self.service.restart_replica(slot, generation, f"weight swap {version} failed there: {error!r}")
        log.warning("LLM replica %d failed weight swap %d; restarted it: %r", slot, version, error)
        return f"restarted (it loads the new weights): {error!r}"

    def _fan(self, endpoint: str, timeout_s: float, *args: Any) -> dict[int, tuple[int, Any, BaseException | None]]:
        """``endpoint`` on every healthy replica: ``slot -> (incarnation, value, error)``."""
        deadline = time.monotonic() + timeout_s
        out: dict[int, tuple[int, Any, BaseException | None]] = {}
        for slot, gen, fut in self.service.endpoint(endpoint).fanout_each(*args):
            try:
                out[slot] = (gen, fut.get(timeout=max(0.0, deadline - time.monotonic())), None)
            except Exception as exc:
                out[slot] = (gen, None, exc)
        return out

    # -- generation -----------------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[int]:
        """Stream new token ids; ValueError at once for a prompt over the context (TokenGenerator).

        With ``params.logprobs``, ``(token id, log-probability)`` pairs.
        """
        if not self.max_context:
            raise RuntimeError("the LLMService is not ready: call ready() first")
        ids = check_prompt(list(prompt_ids), params, self.max_context, self.vocab_size)
        return self._stream(ids, params)

    def _receive(self) -> None:
        """Receiver thread: each message is one replica step's ``(request_id, kind, value)`` items."""
        receive_batches(self._receiver, self._dispatch)

    def _dispatch(self, batch: list[tuple[str, str, Any]]) -> None:
        dispatch_batch(self._sinks, batch)

    async def _stream(self, ids: list[int], params: SamplingParams) -> AsyncIterator[int]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        rid = f"req-{uuid.uuid4().hex[:16]}"

        def on_call_done(call: asyncio.Future[Any]) -> None:
            if not call.cancelled() and call.exception() is not None:
                queue.put_nowait(("failed", call.exception()))

        self._sinks[rid] = (loop, queue)
        try:
            # route() raises at once when the service cannot take it (overloaded, stopped): it never ran
            self.service.generate.route(rid, ids, params, self._port).as_asyncio().add_done_callback(on_call_done)
            async with contextlib.aclosing(
                # replicas that do not have the request ignore the cancel
                stream_tokens(queue, self.token_timeout_s, "LLM replica", lambda: self.service.cancel.fanout(rid))
            ) as tokens:
                async for token in tokens:
                    yield token
        finally:
            self._sinks.pop(rid, None)

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop the watcher and the service (every replica's procs)."""
        self._closing.set()
        self._watcher.join(timeout_s)
        try:
            self.service.stop(drain_timeout_s=5.0).get(timeout=timeout_s)
        finally:
            self._receiver.close()
            self._receiver_thread.join(10.0)

    def __enter__(self) -> LLMService:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
