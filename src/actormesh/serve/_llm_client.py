"""``LLMServerClient``: an ``LLMServer`` replica seen as a ``TokenGenerator`` by the caller.

The client opens one port and a receiver thread: after each decode step the
replica sends one message with the step's tokens for all of this client's
requests, and the thread hands each token to its request's stream (an
asyncio queue on the event loop that iterates it). Each request is also a
long call to the replica's rank 0 (``LLMServer.generate``) whose future is
watched: if the replica dies, supervision fails that future and the stream
raises at once, so a request never waits on a dead replica. Closing a
stream early sends a cancel, which frees its batch slot at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

from ..mesh import ActorMesh
from ..runtime import Channel
from ._scheduler import check_prompt
from ._types import SamplingParams

__all__ = ["LLMServerClient"]


async def stream_tokens(queue: asyncio.Queue[tuple[str, Any]], timeout_s: float, source: str,
                        cancel: Callable[[], Any]) -> AsyncGenerator[int, None]:
    """Yield the token ids a request's ``queue`` receives until ``("end", _)``;
    raise what ``("failed", exc)`` carries, or TimeoutError after ``timeout_s``
    without a token. ``cancel()`` (not awaited) when the stream ends before the
    request did: its consumer went away, or no token came in time."""
    finished = False
    try:
        while True:
            try:
                kind, value = queue.get_nowait() if not queue.empty() else await _get_within(queue, timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no token from the {source} within {timeout_s}s (request cancelled)") from None
            if kind == "token" or kind == "prompt":  # a scored prompt: its PromptLogprobs, before the first token
                yield value
                continue
            finished = True
            if kind == "end":
                return
            raise value  # the call failed: ValueError, RuntimeError, ReplicaFailed (may or may not have run), ...
    finally:
        if not finished:
            cancel()


async def _get_within(queue: asyncio.Queue[Any], timeout_s: float) -> Any:
    """``queue.get()`` or asyncio.TimeoutError after ``timeout_s`` (once per token: ``asyncio.timeout``
    where there is one, as ``wait_for`` makes a task per call)."""
    if _timeout is None:
        return await asyncio.wait_for(queue.get(), timeout_s)
    async with _timeout(timeout_s):
        return await queue.get()


_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+


def receive_batches(receiver: Any, handle: Callable[[Any], None]) -> None:
    """Receiver-thread loop shared by the replica clients: hand each message of
    ``receiver`` to ``handle`` until the port is closed (then return)."""
    fut = receiver.recv()
    while True:
        try:
            batch = fut.get(timeout=5.0)
        except TimeoutError:
            continue  # the same future keeps its place in the queue
        except Exception:  # the port was closed: the client is closing
            return
        fut = receiver.recv()
        handle(batch)


Sinks = dict[str, tuple[asyncio.AbstractEventLoop, "asyncio.Queue[tuple[str, Any]]"]]


def dispatch_batch(sinks: Sinks, batch: list[tuple[str, str, Any]]) -> None:
    """Hand one replica step's ``(request_id, kind, value)`` items to their streams' queues
    (``sinks``: request id -> its stream's loop and queue), waking each event loop once per
    step, not once per token."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], tuple[str, Any]]]] = {}
    for rid, kind, value in batch:
        sink = sinks.get(rid)
        if sink is not None:
            by_loop.setdefault(sink[0], []).append((sink[1], (kind, value)))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that loop is closed: its streams are gone
            pass


class LLMServerClient:
    """Call an ``LLMServer`` replica (from :func:`~actormesh.serve.spawn_llm_server`) as a TokenGenerator.

    ``token_timeout_s`` bounds the wait for each next token of a live
    replica (a dead one fails at once through supervision). Call
    :meth:`close` (or use ``with``) when done: it stops the receiver thread.

    Example::

        with LLMServerClient(server) as client:
            async for tok in client.generate([1, 2, 3], SamplingParams(max_tokens=16, temperature=0.7, seed=1)):
                print(tok)
            client.update_weights(new_state_dict)      # every rank stages, rank 0 swaps between steps
    """

    def __init__(self, server: ActorMesh[Any], token_timeout_s: float = 300.0, timeout_s: float = 60.0) -> None:
        if not isinstance(server, ActorMesh):
            raise TypeError(f"LLMServerClient needs the ActorMesh spawn_llm_server returned, got {type(server).__name__}")
        self.server = server
        self.driver = server.flatten("rank").slice(rank=0)
        info = self.driver.info.call_one().get(timeout=timeout_s)
        if info["max_context"] is None:
            raise RuntimeError("the LLMServer has not been set up: start it with spawn_llm_server")
        self.max_context: int = info["max_context"]
        self.vocab_size: int | None = info["vocab_size"]
        self.token_timeout_s = token_timeout_s
        self._versions = itertools.count(1)
        self._sinks: Sinks = {}
        self._pending: dict[asyncio.AbstractEventLoop, list[Any]] = {}  # requests not sent yet, per event loop
        self._port, self._receiver = Channel.open()
        self._thread = threading.Thread(target=self._receive, name="llm-client-receiver", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        """Receiver thread: dispatch each step's batch of ``(request_id, kind, value)`` to the streams."""
        receive_batches(self._receiver, self._dispatch)

    def _dispatch(self, batch: list[tuple[str, str, Any]]) -> None:
        dispatch_batch(self._sinks, batch)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[int]:
        """Stream new token ids; ValueError at once for a prompt over the context (TokenGenerator).

        With ``params.logprobs``, ``(token id, log-probability)`` pairs.
        """
        if not self._thread.is_alive():
            raise RuntimeError("this LLMServerClient is closed")
        ids = check_prompt(list(prompt_ids), params, self.max_context, self.vocab_size)
        return self._stream(ids, params)

    async def _stream(self, ids: list[int], params: SamplingParams) -> AsyncIterator[int]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        rid = f"req-{uuid.uuid4().hex[:16]}"

        self._sinks[rid] = (loop, queue)
        self._send(loop, (rid, ids, params), queue)
        try:
            async with contextlib.aclosing(
                stream_tokens(queue, self.token_timeout_s, "LLMServer", lambda: self._cancel(loop, rid))
            ) as tokens:
                async for token in tokens:
                    yield token
        finally:
            self._sinks.pop(rid, None)

    def _send(self, loop: asyncio.AbstractEventLoop, request: tuple[str, list[int], SamplingParams],
              queue: asyncio.Queue[tuple[str, Any]]) -> None:
        """Send a request with the others started in the same turn of ``loop``: they then reach the
        replica in one message and join its batch at the same step (fewer steps, fewer messages)."""
        pending = self._pending.get(loop)
        if pending is None:
            pending = self._pending[loop] = []
            loop.call_soon(self._send_pending, loop)
        pending.append((request, queue))

    def _cancel(self, loop: asyncio.AbstractEventLoop, rid: str) -> None:
        pending = self._pending.get(loop, [])
        for i, ((pending_rid, _, _), _) in enumerate(pending):
            if pending_rid == rid:  # not sent yet: a cancel would overtake it and the request run unread
                del pending[i]
                return
        self.driver.cancel.call_one(rid)

    def _send_pending(self, loop: asyncio.AbstractEventLoop) -> None:
        pending = self._pending.pop(loop, [])
        if not pending:  # every one was cancelled before it left
            return
        if len(pending) == 1:
            (rid, ids, params), _ = pending[0]
            call = self.driver.generate.call_one(rid, ids, params, self._port)
        else:
            call = self.driver.generate_many.call_one([request for request, _ in pending], self._port)
        queues = [queue for _, queue in pending]

        def on_call_done(call: asyncio.Future[Any]) -> None:
            # The replica died or refused the call: every stream of it that is still open fails
            # (one that already ended has left its queue behind: the item is never read).
            if not call.cancelled() and call.exception() is not None:
                for queue in queues:
                    queue.put_nowait(("failed", call.exception()))

        call.as_asyncio().add_done_callback(on_call_done)

    def update_weights(self, weights: Any, drain: bool = False, timeout_s: float = 300.0) -> None:
        """Swap the replica's weights with no request lost: a full state dict, or a path every rank reads.

        Double buffer by default (running requests continue on the new weights
        from the next step); ``drain=True`` finishes them on the old ones first.
        Raises ValueError (from the rank that found it) for weights that do not
        fit the model; the old weights then keep serving.
        """
        if not isinstance(weights, (str, os.PathLike)) and not hasattr(weights, "keys"):
            raise TypeError(f"weights must be a state dict or a path, got {type(weights).__name__}")
        version = (uuid.uuid4().int & 0xFFFF_FFFF) * 1000 + next(self._versions) % 1000
        # Every rank checks and stages first, so a swap happens on all ranks or on none.
        self.server.stage_weights.call(version, weights).get(timeout=timeout_s)
        self.driver.commit_weights.call_one(version, drain, timeout_s).get(timeout=timeout_s + 30)

    def stats(self, timeout_s: float = 30.0) -> dict[str, int]:
        """The engine's counters on rank 0 (running, waiting, free_slots, steps, tokens_generated)."""
        return self.driver.info.call_one().get(timeout=timeout_s)["stats"]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop receiving; streams still open wait no more than ``token_timeout_s``."""
        self._receiver.close()
        self._thread.join(timeout_s)

    def __enter__(self) -> LLMServerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
