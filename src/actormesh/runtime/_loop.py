"""The event loop thread each process runs its I/O on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..config import get_config

T = TypeVar("T")

__all__ = ["new_event_loop", "LoopThread"]


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed and enabled (about 2 µs less per hand-off), else asyncio's."""
    if get_config().use_uvloop:
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:
            pass
    return asyncio.new_event_loop()


class LoopThread:
    """A daemon thread running one event loop forever (until ``stop``)."""

    def __init__(self, name: str) -> None:
        self.loop = new_event_loop()
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        self._started.wait()
        self.ident = self.thread.ident

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def in_loop(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.get_ident() == self.ident

    def call_later(self, delay_s: float, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on the loop after ``delay_s`` seconds; from any thread.
        Dropped if the loop is closed by then (the runtime is gone)."""
        if self.in_loop():
            self.loop.call_later(delay_s, fn)
            return
        try:
            self.loop.call_soon_threadsafe(self.loop.call_later, delay_s, fn)
        except RuntimeError:
            pass

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the loop and join the thread (no-op from the loop thread itself)."""
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:
            return
        if not self.in_loop():
            self.thread.join(timeout)
