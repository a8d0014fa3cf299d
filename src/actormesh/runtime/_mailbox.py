"""An actor's mailbox: the loop thread puts, the actor's thread takes a batch at a time.

Theory of operation
-------------------
One class for sync and async actors; they differ only in how the taker sleeps
when the mailbox is empty (the *strategy*): a sync actor's thread blocks on a
bare lock (:class:`ThreadMailbox`), an async actor's event loop awaits an
``asyncio.Event`` that the loop thread sets with ``call_soon_threadsafe``
(:class:`LoopMailbox`).

Batching: the taker swaps out everything queued under one lock acquisition and
then pops from its own batch without locking; the putter wakes the taker only
when it sleeps. So a burst of N messages costs the actor one wake-up and one
lock round, not N. The order is the put order.

Closing (the actor's thread is ending) hands back what was never taken, the
rest of the current batch first, and refuses every later ``put``: the cell
answers those messages instead of leaving their callers waiting.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any, Generic, TypeVar

__all__ = ["LoopMailbox", "Mailbox", "ThreadMailbox"]

T = TypeVar("T")


class Mailbox(Generic[T]):
    """The state both strategies share; use :class:`ThreadMailbox` or :class:`LoopMailbox`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shared: deque[T] = deque()  # put here, under the lock
        self._batch: deque[T] = deque()  # the taker's own, no lock
        self._sleeping = False
        self._closed = False

    def __len__(self) -> int:
        """Messages waiting (a snapshot, for figures)."""
        return len(self._shared) + len(self._batch)

    def put(self, item: T) -> bool:
        """Queue ``item`` (any thread); False if the mailbox is closed (the caller refuses it)."""
        with self._lock:
            if self._closed:
                return False
            self._shared.append(item)
            if not self._sleeping:
                return True
            self._sleeping = False
        self._wake()
        return True

    def next_nowait(self) -> T | None:
        """The next item, or None if there is none (the taker's thread). Marks the taker
        asleep when it returns None, so the next ``put`` wakes it."""
        batch = self._batch
        if batch:
            return batch.popleft()
        with self._lock:
            if not self._shared:
                self._sleeping = True
                self._prepare_sleep()
                return None
            self._batch, self._shared = self._shared, batch
        return self._batch.popleft()

    def close(self) -> list[T]:
        """Refuse later puts; return what was never taken, in order."""
        with self._lock:
            self._closed = True
            left = [*self._batch, *self._shared]
            self._batch.clear()
            self._shared.clear()
        return left

    def _prepare_sleep(self) -> None:
        """Called under the lock when the taker is about to sleep."""

    def _wake(self) -> None:  # pragma: no cover - each strategy has its own
        raise NotImplementedError


class ThreadMailbox(Mailbox[T]):
    """A sync actor's mailbox: its thread blocks on a bare lock while empty."""

    def __init__(self) -> None:
        super().__init__()
        self._waiter = threading.Lock()
        self._waiter.acquire()

    def next(self) -> T:
        """The next item, blocking while there is none."""
        while True:
            item = self.next_nowait()
            if item is not None:
                return item
            self._waiter.acquire()

    def _wake(self) -> None:
        self._waiter.release()


class LoopMailbox(Mailbox[T]):
    """An async actor's mailbox: its event loop awaits :meth:`wait` while empty."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._loop = loop
        self._event: asyncio.Event | None = None

    async def wait(self) -> None:
        """Sleep until a put (after ``next_nowait`` returned None)."""
        event = self._event
        if event is None:
            event = self._event = asyncio.Event()
        await event.wait()  # cleared under the lock before the next sleep (_prepare_sleep)

    def _prepare_sleep(self) -> None:
        if self._event is not None:
            self._event.clear()

    def _wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._set)
        except RuntimeError:  # the actor's loop is closed: it takes nothing more
            pass

    def _set(self) -> None:
        if self._event is None:
            self._event = asyncio.Event()
        self._event.set()


def refuse_all(mailbox: Mailbox[Any], refuse: Any) -> None:
    """Close ``mailbox`` and pass each message it still held to ``refuse(env)``."""
    for env, _ in mailbox.close():
        refuse(env)
