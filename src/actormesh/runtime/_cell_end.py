"""How a :class:`~._cell.Cell` ends: its owned meshes stopped, then ``__cleanup__`` within its deadline.

A sync ``__cleanup__`` runs on the actor's own thread; when it overruns, a timer
thread declares the actor done (logged) and the cleanup is left to run on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._actor import _message_rank, _overrides

if TYPE_CHECKING:
    from ._proc import ProcRuntime

log = logging.getLogger("actormesh.actor")

__all__ = ["CellEnding"]


class CellEnding:
    """Mixin of :class:`~._cell.Cell` (uses its state)."""

    runtime: ProcRuntime
    name: str
    display: str
    instance: Any
    status: str
    stop_deadline: float | None
    rank_raw: Any

    def _stop_owned(self, reason: str) -> None:
        from ._supervision import stop_owned

        try:
            stop_owned(self.runtime, self.name, reason)
        except Exception:
            log.exception("stopping meshes owned by %s failed", self.display)

    def _cleanup(self, exc: BaseException | None, finished: Callable[[], None] | None = None) -> None:
        """Stop owned meshes, then run a sync ``__cleanup__`` (on this, the actor's
        thread) within its deadline; ``finished`` runs once, when the cleanup
        returns or when its deadline passes (then from a timer thread, the
        cleanup left running: the actor counts as done all the same)."""
        self._stop_owned("its owner stopped" if exc is None else "its owner failed")
        once = threading.Lock()

        def finish() -> None:
            if once.acquire(blocking=False) and finished is not None:
                finished()

        if self.instance is None or not _overrides(type(self.instance), "__cleanup__"):
            finish()
            return
        budget = self.cleanup_budget()

        def overran() -> None:
            log.warning("__cleanup__ of %s did not finish within %.1fs (cleanup_timeout); going on without it", self.display, budget)
            finish()

        timer = threading.Timer(budget, overran)
        timer.daemon = True
        timer.start()
        # A stop is not a message to one point: the cleanup sees the actor's own rank.
        token = _message_rank.set(self.rank_raw)
        try:
            self.instance.__cleanup__(exc)
        except Exception:
            log.exception("__cleanup__ of %s raised", self.display)
        finally:
            _message_rank.reset(token)
            timer.cancel()
            finish()

    def cleanup_budget(self) -> float:
        """Seconds ``__cleanup__`` may still take: up to the stop deadline, else cleanup_timeout."""
        timeout = self.runtime.config.cleanup_timeout
        if self.stop_deadline is None or self.status == "failed":
            return timeout
        return max(0.0, min(timeout, self.stop_deadline - time.monotonic()))
