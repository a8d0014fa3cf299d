"""Background threads with an owner: started through a group, joined when it closes.

A runtime owns one :class:`ThreadGroup`. Work that must leave the loop thread
because it may block (a user's fault hook, stopping what a failed async actor
owned) runs on a thread of that group, never on an ownerless daemon thread:
``ProcRuntime.close`` joins the group with a deadline and names what is still
running then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("actormesh.runtime")

__all__ = ["ThreadGroup"]


class ThreadGroup:
    """Threads one owner started. Thread-safe.

    Example::

        >>> group = ThreadGroup("demo")
        >>> _ = group.start(print, "hello from a worker", name="greeter")
        hello from a worker
        >>> group.join(timeout_s=5.0)
        []
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def start(self, target: Callable[..., Any], *args: Any, name: str) -> threading.Thread:
        """Run ``target(*args)`` on a new daemon thread of this group."""

        def run() -> None:
            try:
                target(*args)
            finally:
                with self._lock:
                    self._threads.discard(thread)

        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()
        return thread

    def running(self) -> list[str]:
        """Names of the threads still running."""
        with self._lock:
            return sorted(t.name for t in self._threads)

    def join(self, timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s`` in all for the group's threads (not the caller's
        own); return the names of those still running then (logged)."""
        deadline = time.monotonic() + timeout_s
        me = threading.current_thread()
        with self._lock:
            threads = [t for t in self._threads if t is not me]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        late = [t.name for t in threads if t.is_alive()]
        if late:
            log.warning("%s: %d background thread(s) still running after %.1fs, left behind: %s", self.owner, len(late), timeout_s, ", ".join(late))
        return late
