"""Routers: which replica takes the next request.

A router sees only the replicas that can admit the request now (healthy, not
draining, with a free concurrency slot or room in their queue) and returns one
of them. It runs on the caller's thread under the service's lock, so it must be
quick and must not block or call into the service. Sessions are applied on top
of any router: a request in a session goes to the session's replica.

Write your own by implementing :class:`Router`::

    class Fewest(Router):
        def pick(self, replicas, endpoint):
            return min(replicas, key=lambda r: r.in_flight)

    svc = Service(1, 4, Model, router=Fewest())
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["ReplicaLoad", "Router", "RoundRobin", "LeastLoaded", "make_router"]


@runtime_checkable
class ReplicaLoad(Protocol):
    """What a router may read of a replica."""

    #: stable index of the replica in its service (survives rebuilds)
    slot: int
    #: requests sent to it and not yet answered
    in_flight: int

    @property
    def queued(self) -> int:
        """Requests waiting in its queue."""
        ...

    @property
    def load(self) -> int:
        """``in_flight + queued``."""
        ...


class Router:
    """Base class of routers: override :meth:`pick`."""

    #: the name used in ``Service(router=...)`` and in metrics
    name = "custom"

    def pick(self, replicas: Sequence[ReplicaLoad], endpoint: str) -> ReplicaLoad:
        """Return one of ``replicas`` (never empty) for a request to ``endpoint``."""
        raise NotImplementedError


class RoundRobin(Router):
    """Each request to the next replica in slot order, skipping those that cannot admit it."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, replicas: Sequence[ReplicaLoad], endpoint: str) -> ReplicaLoad:
        start = self._next
        best = None
        for r in replicas:  # the first slot at or after the cursor, else wrap around
            if r.slot >= start:
                best = r
                break
        if best is None:
            best = replicas[0]
        self._next = best.slot + 1
        return best


class LeastLoaded(Router):
    """The replica with the fewest requests in flight plus queued; ties go round-robin,
    so an idle service still spreads requests over every replica."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._tie = 0

    def pick(self, replicas: Sequence[ReplicaLoad], endpoint: str) -> ReplicaLoad:
        n = len(replicas)
        if n == 1:
            return replicas[0]
        start = self._tie % n  # scan from a rotating start: the first lowest load wins
        self._tie += 1
        best = replicas[start]
        low = best.load
        for i in range(1, n):
            r = replicas[(start + i) % n]
            load = r.load
            if load < low:
                best, low = r, load
        return best


_BUILTIN = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}


def make_router(router: str | Router) -> Router:
    """A router from its name (``"round_robin"``, ``"least_loaded"``) or a Router instance."""
    if isinstance(router, Router):
        return router
    if isinstance(router, str) and router in _BUILTIN:
        return _BUILTIN[router]()
    if hasattr(router, "pick") and callable(router.pick):  # duck-typed router
        return router  # type: ignore[return-value]
    raise ValueError(f"unknown router {router!r}: use one of {sorted(_BUILTIN)} or a Router instance (an object with pick(replicas, endpoint))")
