"""Futures that only the runtime makes, waitable from threads and from asyncio.

A :class:`Future` is completed once, from any thread (usually the runtime's
loop thread), with a value, an exception, or a *thunk* that computes the value
on first use (replies are unpickled lazily, in the waiter's thread, not on the
loop thread). Waiting uses a bare ``threading.Lock`` held until completion: it
is the cheapest cross-thread wake-up CPython has.
"""

from __future__ import annotations

import asyncio
import math
import threading
import warnings
from collections.abc import Callable, Generator, Iterable
from typing import Any, Generic, Self, TypeVar

__all__ = ["Future", "Promise", "gather", "when_done"]

R = TypeVar("R")

_PENDING, _VALUE, _ERROR, _THUNK = 0, 1, 2, 3
_TOKEN = object()
_new_lock = threading.Lock
_object_new = object.__new__
# Guards state changes of all futures: critical sections are a few bytecodes,
# so one shared lock is cheaper than allocating one per future.
_guard = threading.Lock()


class Future(Generic[R]):
    """The result of a remote operation.

    ``get(timeout=None)`` blocks the calling thread; ``await fut`` works inside a
    running asyncio loop. A timeout raises ``TimeoutError`` and does not cancel:
    a later ``get()`` still sees the result. Results are cached, so many waiters
    and repeated waits are fine. Only the runtime creates futures.

    Example::

        fut = counter.value.call_one()
        print(fut.get(timeout=5))
    """

    __slots__ = ("_state", "_result", "_lock", "_callbacks", "_wedge", "__weakref__")

    def __init__(self, _token: object = None) -> None:
        if _token is not _TOKEN:
            raise TypeError("Future cannot be constructed directly; it is returned by endpoint adverbs")
        self._state = _PENDING
        self._result: Any = None
        self._lock = _new_lock()
        self._lock.acquire()
        self._callbacks: list[Callable[[Future[R]], None]] | None = None
        # Set on a call an actor made to itself: given "get" or "await", says why
        # that wait can never end here (or None where it can). See _selfwait.
        self._wedge: Callable[[str], str | None] | None = None

    @classmethod
    def _create(cls) -> Self:
        # __init__'s work without its call and token check: one per call made.
        fut = _object_new(cls)
        fut._state = _PENDING
        fut._result = None
        lock = fut._lock = _new_lock()
        lock.acquire()
        fut._callbacks = None
        fut._wedge = None
        return fut

    @classmethod
    def _completed(cls, value: Any) -> Future[Any]:
        fut = cls._create()
        fut._set(_VALUE, value)
        return fut

    @classmethod
    def _failed(cls, exc: BaseException) -> Future[Any]:
        fut = cls._create()
        fut._set(_ERROR, exc)
        return fut

    @classmethod
    def completed(cls, value: Any) -> Future[Any]:
        """A future that already holds ``value`` (for layers above the runtime)."""
        return cls._completed(value)

    @classmethod
    def failed(cls, exc: BaseException) -> Future[Any]:
        """A future that already holds the error ``exc``."""
        return cls._failed(exc)

    def then(self, fn: Callable[[R], Any], within: Callable[[], Any] | None = None) -> Future[Any]:
        """A future of ``fn(value)``: ``fn`` runs once, lazily, in the first waiter's
        thread; an error of this future (or raised by ``fn``) is the new one's.
        ``within()``, if given, is a context manager both the reply's decoding
        and ``fn`` run in."""
        out: Future[Any] = Future._create()

        def thunk(f: Future[R]) -> Any:
            if within is None:
                return fn(f._outcome())
            with within():
                return fn(f._outcome())

        def settle(f: Future[R]) -> None:
            out._set_thunk(lambda: thunk(f))

        self._add_done_callback(settle)
        return out

    # -- completion (runtime side, any thread) -------------------------------------------
    def _set(self, state: int, result: Any) -> bool:
        with _guard:
            if self._state != _PENDING:
                return False
            self._result = result
            self._state = state
            callbacks, self._callbacks = self._callbacks, None
        self._lock.release()
        if callbacks:
            for cb in callbacks:
                cb(self)
        return True

    def _set_result(self, value: Any) -> bool:
        return self._set(_VALUE, value)

    def _set_exception(self, exc: BaseException) -> bool:
        return self._set(_ERROR, exc)

    def _set_thunk(self, thunk: Callable[[], Any]) -> bool:
        """Complete with a function that yields the value (or raises) on first use."""
        return self._set(_THUNK, thunk)

    def _add_done_callback(self, cb: Callable[[Future[R]], None]) -> None:
        with _guard:
            if self._state == _PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(cb)
                return
        cb(self)

    def done(self) -> bool:
        """True once a value or an error is available."""
        return self._state != _PENDING

    # -- observing ------------------------------------------------------------------------
    def _outcome(self) -> R:
        state = self._state
        if state == _THUNK:
            # Run the thunk (unpickling) outside the shared lock; if two observers
            # race, both compute and the first stored outcome wins for everyone.
            with _guard:
                thunk = self._result if self._state == _THUNK else None
            if thunk is not None:
                try:
                    outcome = (_VALUE, thunk())
                except BaseException as exc:  # the thunk's error is the call's error
                    outcome = (_ERROR, exc)
                with _guard:
                    if self._state == _THUNK and self._result is thunk:
                        self._state, self._result = outcome
            state = self._state
        if state == _ERROR:
            raise self._result
        return self._result

    def get(self, timeout: float | None = None) -> R:
        """Block until done; return the value or raise the error.

        Raises ``TimeoutError`` after ``timeout`` seconds (the operation goes on).
        """
        if timeout is not None:
            # One chained comparison refuses NaN, negatives and infinity at once.
            if not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
                raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
        if self._state == _PENDING:
            if self._wedge is not None:
                self._refuse_wedge("get")
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass
            else:
                warnings.warn(
                    "Future.get() was called from within an active event loop; this blocks the loop. "
                    "Use `await fut` instead.",
                    UserWarning,
                    stacklevel=2,
                )
            if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError(f"result not available within {timeout}s (the operation was not cancelled)")
            self._lock.release()
        return self._outcome()

    def result(self, timeout: float | None = None) -> R:
        """Alias of :meth:`get`."""
        return self.get(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error the operation ended with, or None if it succeeded."""
        try:
            self.get(timeout)
        except TimeoutError:
            if not self.done():
                raise
            return self._result if self._state == _ERROR else None
        except BaseException as exc:
            return exc
        return None

    def as_asyncio(self) -> asyncio.Future[R]:
        """An asyncio future on the running loop that completes with this one."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError as exc:
            raise RuntimeError("as_asyncio() needs a running asyncio event loop") from exc
        afut: asyncio.Future[R] = loop.create_future()

        def transfer(_: Future[R]) -> None:
            def settle() -> None:
                if afut.done():
                    return
                try:
                    afut.set_result(self._outcome())
                except BaseException as exc:
                    afut.set_exception(exc)

            try:
                if loop.is_closed():
                    return
                loop.call_soon_threadsafe(settle)
            except RuntimeError:
                pass

        self._add_done_callback(transfer)
        return afut

    def __await__(self) -> Generator[Any, None, R]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise ValueError("await on a Future needs a running asyncio event loop; use .get() instead") from None
        if self.done():
            return self._outcome()
        if self._wedge is not None:
            self._refuse_wedge("await")
        return (yield from self.as_asyncio().__await__())

    def _refuse_wedge(self, how: str) -> None:
        why = self._wedge(how) if self._wedge is not None else None
        if why is not None:
            raise RuntimeError(why)

    def __repr__(self) -> str:
        state = {_PENDING: "pending", _VALUE: "done", _THUNK: "done", _ERROR: "failed"}[self._state]
        return f"<Future {state}>"


class Promise(Generic[R]):
    """The writing end of a :class:`Future`, for layers above the runtime that finish
    one themselves (a stop that waits on several parts, a pipe read to its end).

    The first outcome wins; a later one is ignored (the setter returns False). Whoever
    makes a promise keeps it on every path, errors included: its future has no
    other way to end.
    """

    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: Future[R] = Future._create()

    def set_result(self, value: R) -> bool:
        return self.future._set_result(value)

    def set_exception(self, exc: BaseException) -> bool:
        return self.future._set_exception(exc)

    def set_thunk(self, thunk: Callable[[], R]) -> bool:
        """Complete with a function that yields the value (or raises) in the first waiter's thread."""
        return self.future._set_thunk(thunk)


#: ``call_later(delay_s, fn)``: run ``fn`` once after ``delay_s`` seconds, callable
#: from any thread (e.g. ``runtime.loop_thread.call_later``).
Scheduler = Callable[[float, Callable[[], None]], Any]


def gather(
    futures: Iterable[Future[Any]],
    *,
    timeout_s: float | None = None,
    call_later: Scheduler | None = None,
    what: str = "gather",
) -> Future[list[Any]]:
    """One future for many: done when every one is done, with their values in order.

    Its error, if any, is the first error in order (every future is waited for
    first, so nothing still runs when it fails). With ``timeout_s`` (and a
    ``call_later`` to keep time with), it fails with ``TimeoutError`` if they are
    not all done by then; the futures themselves go on. No thread waits: the
    last future to complete (or the timer) completes it, on its own thread.

    Example::

        sizes = gather([a.size.call_one(), b.size.call_one()]).then(sum)
    """
    futures = list(futures)
    out: Future[list[Any]] = Future._create()
    if timeout_s is not None:
        if call_later is None:
            raise ValueError("gather(timeout_s=...) needs call_later to keep time with")
        if not (isinstance(timeout_s, (int, float)) and 0 <= timeout_s < math.inf):
            raise ValueError(f"timeout_s must be a finite number of seconds >= 0, got {timeout_s!r}")
    if not futures:
        out._set_result([])
        return out
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            out._set_thunk(lambda: [f._outcome() for f in futures])

    for f in futures:
        f._add_done_callback(one_done)
    if timeout_s is not None and not out.done():

        def expire() -> None:
            if not out.done():
                missing = sum(not f.done() for f in futures)
                out._set_exception(TimeoutError(f"{what}: {missing} of {len(futures)} not done within {timeout_s:g}s"))

        call_later(timeout_s, expire)  # type: ignore[misc]
    return out


def when_done(future: Future[Any], fn: Callable[[], Any]) -> Future[None]:
    """A future of running ``fn()`` once ``future`` is done, whatever its outcome.

    ``fn`` runs on the thread that completes ``future`` (keep it short and
    non-blocking: that may be the runtime's loop thread); its own error is the
    new future's.
    """
    out: Future[None] = Future._create()

    def run(_: Future[Any]) -> None:
        try:
            fn()
        except BaseException as exc:
            out._set_exception(exc)
        else:
            out._set_result(None)

    future._add_done_callback(run)
    return out
