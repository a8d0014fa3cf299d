"""Health checks a replica answers itself (Ray Serve's ``check_health``).

A replica that is up and answering may still be unfit to serve (its device
failed, its model state is corrupt), and only its own code can tell. When a
service's actor class has an endpoint named ``check_health``, the service's
:class:`HealthChecker` thread calls it on every healthy replica each
``health_check_period_s``, past the admission limits and outside the request
counts. A check that raises restarts that replica, as a death would (queued
requests move, those in flight fail as may-have-run or are retried when
idempotent). A check that has not answered yet is not a failure, busy is not
dead: that replica gets no new check until it answers, and a proc that hangs
is the runtime's liveness checks' business.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ._periodic import PeriodicThread

if TYPE_CHECKING:
    from ._core import ServiceCore

__all__ = ["CHECK", "HealthChecker"]

log = logging.getLogger("actormesh.serve")

#: the endpoint a replica answers health checks with (Ray Serve's name)
CHECK = "check_health"


class HealthChecker(PeriodicThread):
    """The thread that checks a service's replicas; owned by the service (``stop`` joins it)."""

    def __init__(self, core: ServiceCore, period_s: float) -> None:
        self._core = core
        self.rounds = 0  #: check rounds run so far
        self.failed: list[tuple[int, int, str]] = []  #: (slot, incarnation, error) of each check that raised
        self._pending: dict[int, tuple[int, Any]] = {}  # slot -> (incarnation, its check's future)
        super().__init__(f"health-{core.spec.name}", period_s)

    def tick(self) -> None:
        pending = self._pending
        for slot, (generation, fut) in list(pending.items()):
            if fut.done():
                del pending[slot]
                self._settle(slot, generation, fut)
        for slot, generation, send in self._core.senders_of(CHECK):
            if slot in pending and pending[slot][0] == generation:
                continue  # its last check has not answered: busy, not dead
            try:
                pending[slot] = (generation, send())
            except Exception as exc:  # the replica went away meanwhile: supervision has it
                log.debug("health check of replica %d not sent: %r", slot, exc)
        self.rounds += 1

    def _settle(self, slot: int, generation: int, fut: Any) -> None:
        try:
            fut.get(timeout=0)
        except Exception as exc:
            self.failed.append((slot, generation, repr(exc)))
            if self._core.restart(slot, generation, f"its {CHECK}() raised: {exc!r}"):
                log.warning("replica %d of %s failed its %s(); restarting it: %r", slot, self._core.spec.name, CHECK, exc)
