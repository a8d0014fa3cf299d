"""``@batched``: gather concurrent calls of an endpoint into one call with a list.

Ray Serve's ``@serve.batch`` semantics, on an async actor. The decorated method
takes a list and returns a list of the same length; callers call it with one
item and get back their own result::

    class Model(Actor):
        @batched(max_batch_size=16, max_wait_ms=5)
        async def predict(self, xs: list[float]) -> list[float]:
            return [2 * x for x in xs]

    svc.predict.route(3.0).get()   # 6.0, computed in a batch with concurrent calls

A batch starts when ``max_batch_size`` calls are waiting, or ``max_wait_ms``
after the first of them arrived. Batches of one method run one at a time, in
arrival order; calls that arrive meanwhile form the next batch. If the method
raises, every call of that batch raises that error; an element of the returned
list that is an exception instance is raised to that one caller only. A result
that is not a list of the batch's length fails the whole batch with TypeError.
``@batched`` makes the method a concurrent endpoint (use it instead of
``@endpoint``); the method must be ``async def`` and take one argument.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any

from ..runtime import EndpointProperty

__all__ = ["batched"]


def batched(max_batch_size: int = 8, max_wait_ms: float = 10.0) -> Callable[[Callable[..., Any]], EndpointProperty[Any]]:
    """Make an ``async def method(self, items: list)`` an endpoint called with one item."""
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
    if isinstance(max_wait_ms, bool) or not isinstance(max_wait_ms, (int, float)) or max_wait_ms < 0:
        raise ValueError(f"max_wait_ms must be a number >= 0, got {max_wait_ms!r}")

    def wrap(fn: Callable[..., Any]) -> EndpointProperty[Any]:
        if isinstance(fn, EndpointProperty):
            raise TypeError(f"{fn.name!r} is already an endpoint: use @batched(...) instead of @endpoint, not both")
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"@batched needs an async def method; {fn.__name__!r} is not (the actor must be async)")
        params = list(inspect.signature(fn).parameters.values())
        if len(params) != 2 or params[1].kind not in (params[1].POSITIONAL_ONLY, params[1].POSITIONAL_OR_KEYWORD):
            raise TypeError(f"@batched method {fn.__name__!r} must take exactly one argument besides self: the list of items")
        key = f"_actormesh_batcher_{fn.__name__}"

        @functools.wraps(fn)
        async def one(self: Any, item: Any) -> Any:
            batcher = self.__dict__.get(key)
            if batcher is None:
                batcher = self.__dict__[key] = _Batcher(fn, self, max_batch_size, max_wait_ms / 1000.0)
            return await batcher.submit(item)

        one.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        prop: EndpointProperty[Any] = EndpointProperty(one, concurrent=True)
        prop.max_batch_size = max_batch_size  # type: ignore[attr-defined]
        prop.max_wait_ms = max_wait_ms  # type: ignore[attr-defined]
        return prop

    return wrap


class _Batcher:
    """The waiting calls of one batched method on one actor (lives on the actor's loop)."""

    def __init__(self, fn: Callable[..., Any], obj: Any, size: int, wait_s: float) -> None:
        self._fn = fn
        self._obj = obj
        self._size = size
        self._wait_s = wait_s
        self._pending: list[tuple[Any, asyncio.Future[Any], float]] = []
        self._arrived = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None

    async def submit(self, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((item, fut, loop.time()))
        self._arrived.set()
        if self._worker is None or self._worker.done():
            # Started on demand and ends when nothing waits: no task outlives the work.
            self._worker = loop.create_task(self._work())
        return await fut

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            first = self._pending[0][2]
            while len(self._pending) < self._size:
                remaining = first + self._wait_s - loop.time()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            batch = [(item, fut) for item, fut, _ in self._pending[: self._size] if not fut.done()]  # skip cancelled callers
            del self._pending[: self._size]
            if batch:
                await self._run(batch)

    async def _run(self, batch: list[tuple[Any, asyncio.Future[Any]]]) -> None:
        try:
            results = await self._fn(self._obj, [item for item, _ in batch])
            if not isinstance(results, (list, tuple)) or len(results) != len(batch):
                got = f"a {type(results).__name__} of length {len(results)}" if isinstance(results, (list, tuple)) else repr(type(results).__name__)
                raise TypeError(f"batched method {self._fn.__name__!r} must return a list of {len(batch)} results (one per item), got {got}")
        except Exception as exc:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, fut), result in zip(batch, results):
            if fut.done():
                continue
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)
