"""A service's periodic background work (autoscaling, health checks): one owned thread
each, woken every period, that the service stops and joins when it stops."""

from __future__ import annotations

import threading

__all__ = ["PeriodicThread"]


class PeriodicThread:
    """Calls :meth:`tick` every ``period_s`` on a thread of its own until :meth:`stop`,
    or until ``tick`` returns False. Subclasses set their state before ``__init__``."""

    def __init__(self, name: str, period_s: float) -> None:
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            if self.tick() is False:
                return

    def tick(self) -> bool | None:  # pragma: no cover - each subclass has its own
        """One period's work; False ends the thread."""
        raise NotImplementedError

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread (it wakes at once) and wait for it."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
