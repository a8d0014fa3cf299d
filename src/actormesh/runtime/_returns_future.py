"""``@returns_future``: an ``async def`` that returns an actormesh :class:`Future`.

Theory of operation (Monarch's rules for the decorator):

- Calling the decorated function runs no part of the body. It calls
  ``context()`` on the caller's thread (so the first call bootstraps the
  controller outside any loop made here) and copies the caller's context
  variables; the body later runs in that copy. If either fails, the coroutine
  is closed unstarted and the error is raised at the call.
- The first observer owns the body and starts it; it runs at most once. A
  future dropped unobserved closes its body unstarted.
- ``await fut`` / ``fut.as_asyncio()`` as first observer runs the body as a
  task on the awaiting loop; each awaiting observer waits on its own asyncio
  future, so cancelling one observer never cancels the body.
- ``fut.get(timeout)`` as first observer runs the body like ``asyncio.run``
  on a fresh loop in the calling thread, or, when that thread is already
  inside a running loop, on a short-lived helper thread with its own loop.
  A timeout publishes ``TimeoutError`` first and then cancels the body (an
  interrupt publishes ``CancelledError``): the first published outcome wins.
- Later observers wait for that outcome (their own timeouts cancel nothing).
  A ``get()`` on the very thread whose loop runs the body would wait forever,
  so it raises ``RuntimeError`` instead: ``await`` the future there.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from ._future import Future

__all__ = ["returns_future"]

P = ParamSpec("P")
T = TypeVar("T")

_take_lock = threading.Lock()
_running: set[asyncio.Task[Any]] = set()  # asyncio holds tasks weakly; we keep them until they end


class _BodyFuture(Future[T]):
    """A Future whose outcome is computed by a coroutine started by its first observer."""

    __slots__ = ("_coro", "_ctx", "_loop")
    _coro: Coroutine[Any, Any, T] | None  # the body, until its first observer takes it
    _ctx: contextvars.Context  # the caller's context variables, copied at the call
    _loop: asyncio.AbstractEventLoop | None  # the loop the body runs on, once started

    def _take(self) -> Coroutine[Any, Any, T] | None:
        with _take_lock:
            coro, self._coro = self._coro, None
            return coro

    def _publish_task(self, task: asyncio.Task[Any]) -> None:
        _running.discard(task)
        if task.cancelled():
            self._set_exception(asyncio.CancelledError("the body of this @returns_future call was cancelled"))
            return
        exc = task.exception()
        if exc is not None:
            self._set_exception(exc)
        else:
            self._set_result(task.result())

    def _start_on(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> asyncio.Task[Any]:
        self._loop = loop
        task = loop.create_task(coro, context=self._ctx)
        _running.add(task)
        task.add_done_callback(self._publish_task)
        return task

    def _drive(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> None:
        """Run the body to its end on a fresh loop in this thread (``asyncio.run``-like)."""
        loop = asyncio.new_event_loop()
        try:
            task = self._start_on(loop, coro)
            try:
                loop.run_until_complete(asyncio.wait([task], timeout=timeout))
            except BaseException:  # an interrupt: publish first, then clean up
                self._set_exception(asyncio.CancelledError("the .get() driving this @returns_future body was interrupted"))
                task.cancel()
                loop.run_until_complete(asyncio.wait([task]))
                raise
            if not task.done():
                self._set_exception(TimeoutError(f"the @returns_future body did not finish within {timeout}s; it was cancelled"))
                task.cancel()
                loop.run_until_complete(asyncio.wait([task]))
            leftovers = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in leftovers:
                t.cancel()
            if leftovers:
                loop.run_until_complete(asyncio.wait(leftovers))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    def get(self, timeout: float | None = None) -> T:
        """Run the body if nobody started it yet (see the module docstring); return its outcome."""
        _check_timeout(timeout)
        coro = None if self.done() else self._take()
        if coro is not None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                self._drive(coro, timeout)
            else:
                def helper() -> None:
                    try:
                        self._drive(coro, timeout)
                    except BaseException:  # already published as the outcome
                        pass

                thread = threading.Thread(target=helper, name="actormesh-returns-future", daemon=True)
                thread.start()
                thread.join()
            return super().get(0)
        loop = self._loop
        if not self.done() and loop is not None and _running_loop() is loop:
            raise RuntimeError("Future.get() would block the event loop that runs this @returns_future body; use `await fut`")
        return super().get(timeout)

    def as_asyncio(self) -> asyncio.Future[T]:
        """An asyncio future for this outcome; the first observer starts the body on the running loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError as exc:
            raise RuntimeError("as_asyncio() needs a running asyncio event loop") from exc
        coro = None if self.done() else self._take()
        if coro is not None:
            self._start_on(loop, coro)
        return super().as_asyncio()

    def __del__(self) -> None:
        coro = getattr(self, "_coro", None)
        if coro is not None:
            coro.close()  # never observed: the body never runs


def _check_timeout(timeout: float | None) -> None:
    import math

    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout) or timeout < 0 or math.isinf(timeout)):
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def returns_future(function: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Future[T]]:
    """Make an ``async def`` return an actormesh :class:`Future` instead of a coroutine.

    Synchronous callers use ``.get()``, asyncio callers ``await``; the body
    runs where it is first observed (see this module's docstring). Side
    effects that must happen at call time belong in a synchronous wrapper
    that calls the decorated function. Put ``@classmethod``/``@staticmethod``
    above ``@returns_future``. Example::

        @returns_future
        async def total(meshes):
            return sum([await m.value.call_one() for m in meshes])

        print(total(meshes).get(timeout=10))
    """
    if not inspect.iscoroutinefunction(function):
        raise TypeError(f"returns_future requires an async function (async def), got {function!r}")

    @functools.wraps(function)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> Future[T]:
        from ._context import context

        coro = function(*args, **kwargs)
        try:
            context()
            ctx = contextvars.copy_context()
        except BaseException:
            coro.close()
            raise
        fut: _BodyFuture[T] = _BodyFuture._create()
        fut._coro, fut._ctx, fut._loop = coro, ctx, None
        return fut

    return wrapped
