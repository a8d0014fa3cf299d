"""How a service's replicas come and go: failure, rebuild, scaling, draining, stop.

A mixin of :class:`~._core.ServiceCore` (it uses the core's lock, replicas and
request path). The slow work runs on the owner actor (``_replica.ServiceOwner``),
which calls back into the methods here; every such callback carries the slot's
``generation``, so news about an incarnation that was replaced meanwhile is
ignored. States of a slot::

    starting --up--> healthy --died--> starting (rebuild, same slot, generation + 1)
        |                |---scale down / stop--> draining --drained--> stopped
        +--build failed--> failed (a slot that served before is retried first)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from ..runtime import Future
from ._errors import ServiceError, ServiceStopped
from ._replica import DRAINING, FAILED, HEALTHY, STARTING, STOPPED, Replica
from ..runtime import gather
from ._request import Request, ServiceSpec

__all__ = ["ReplicaLifecycle"]

log = logging.getLogger("actormesh.serve")

Actions = list[Callable[[], Any]]


class ReplicaLifecycle:
    """Failure, rebuild, scale, drain and stop of the replica slots (mixin of ServiceCore)."""

    spec: ServiceSpec
    owner: Any
    stopped: str | None
    _lock: threading.Lock
    _replicas: list[Replica]
    _by_mesh: dict[str, Replica]
    _sessions: dict[str, int | None]
    _abandoned: dict[int, Any]
    _token: int
    _next_slot: int

    if TYPE_CHECKING:
        def _slot(self, slot: int | None) -> Replica | None: ...
        def _pull(self, r: Replica) -> Actions: ...
        def _resubmit(self, req: Request, cause: BaseException | None) -> None: ...

    # -- failure and rebuild ------------------------------------------------------------
    def on_replica_failure(self, mesh_name: str, cause: str) -> None:
        """The owner's ``__supervise__`` heard that a replica mesh failed (owner's thread)."""
        with self._lock:
            r = self._by_mesh.get(mesh_name)
            if r is None or r.mesh_name != mesh_name or r.state != HEALTHY:
                return  # an earlier incarnation, or a build that reports its own failure
            actions = self._died(r, r.generation, cause)
        for act in actions:
            act()

    def _died(self, r: Replica, generation: int, cause: str) -> Actions:
        """Mark incarnation ``generation`` of ``r`` dead, once (under the lock): move
        its queue elsewhere, stop its procs, rebuild it."""
        if r.generation != generation or r.state != HEALTHY:
            return []
        log.warning("replica %d of service %s failed; rebuilding it: %s", r.slot, self.spec.name, cause.strip().splitlines()[-1] if cause.strip() else cause)
        moved = list(r.queue)
        r.queue.clear()
        self._by_mesh.pop(r.mesh_name, None)
        token = self._abandon(r.procs)
        r.procs, r.mesh, r.senders = None, None, {}
        r.generation += 1
        r.in_flight = 0
        r.state = STARTING
        r.stats.restarts += 1
        gen = r.generation
        actions: Actions = [lambda: self._ask_owner("stop_procs", token), lambda: self._ask_owner("build", r.slot, gen, 0.0)]
        actions += [partial(self._resubmit, q, None) for q in moved]
        return actions

    def restart(self, slot: int, generation: int | None, cause: str) -> bool:
        """Treat incarnation ``generation`` (None: the current one) of ``slot`` as failed:
        stop its procs and rebuild it. False if it is not that incarnation or not healthy."""
        with self._lock:
            r = self._slot(slot)
            if r is None:
                return False
            actions = self._died(r, r.generation if generation is None else generation, cause)
        for act in actions:
            act()
        return bool(actions)

    def _abandon(self, procs: Any) -> int:
        self._token += 1
        self._abandoned[self._token] = procs
        return self._token

    def take_abandoned(self, token: int) -> Any:
        """The procs of a dead incarnation, for the owner to stop."""
        with self._lock:
            return self._abandoned.pop(token, None)

    def _ask_owner(self, method: str, *args: Any) -> None:
        """Have the owner actor run ``method(*args)``; a build it could not run counts as failed."""
        fut = getattr(self.owner, method).call_one(*args)

        def check(f: Future[Any]) -> None:
            err = f.exception(timeout=0)
            if err is None or self.stopped is not None:
                return
            log.error("service %s: the replica owner's %s%r failed: %s", self.spec.name, method, args, err)
            if method == "build":
                self.build_failed(args[0], args[1], err)

        fut._add_done_callback(check)

    # -- building (called by the owner actor) ---------------------------------------------
    def add_replicas(self, n: int) -> list[Replica]:
        """New slots, each being built; the caller waits on their ``up`` futures."""
        with self._lock:
            added = []
            for _ in range(n):
                r = Replica(self._next_slot)
                self._next_slot += 1
                self._replicas.append(r)
                added.append(r)
        for r in added:
            self._ask_owner("build", r.slot, r.generation, 0.0)
        return added

    def wants(self, slot: int, generation: int) -> bool:
        """Whether incarnation ``generation`` of ``slot`` should still be built."""
        with self._lock:
            r = self._slot(slot)
            return r is not None and r.generation == generation and r.state == STARTING and self.stopped is None

    def building(self, slot: int, generation: int, mesh_name: str) -> None:
        """The replica's actors were spawned as ``mesh_name`` (its failures are now ours)."""
        with self._lock:
            r = self._slot(slot)
            if r is not None and r.generation == generation:
                self._by_mesh[mesh_name] = r

    def replica_up(self, slot: int, generation: int, procs: Any, mesh: Any) -> bool:
        """Incarnation ``generation`` of ``slot`` is up; False: it is no longer wanted."""
        with self._lock:
            r = self._slot(slot)
            if r is None or r.generation != generation or r.state != STARTING or self.stopped is not None:
                return False
            r.attach(procs, mesh)
            self._by_mesh[r.mesh_name] = r
            r.state = HEALTHY
            r.build_failures = 0
            actions = self._pull(r)
        r.up._set_result(None)
        for act in actions:
            act()
        return True

    def build_failed(self, slot: int, generation: int, exc: BaseException) -> None:
        """A build raised or timed out: retry a slot that served before, else give it up."""
        with self._lock:
            r = self._slot(slot)
            if r is None or r.generation != generation or r.state != STARTING:
                return
            r.build_failures += 1
            retry = r.stats.restarts > 0 and r.build_failures <= self.spec.max_rebuilds and self.stopped is None
            if retry:
                r.generation += 1
                gen, delay = r.generation, 0.5 * 2 ** (r.build_failures - 1)
            else:
                r.state = FAILED
                moved = list(r.queue)
                r.queue.clear()
        if retry:
            log.warning("replica %d of service %s failed to start (attempt %d), retrying in %.1fs: %s", slot, self.spec.name, r.build_failures, delay, exc)
            self._ask_owner("build", slot, gen, delay)
            return
        log.error("replica %d of service %s failed to start; giving up on it: %s", slot, self.spec.name, exc)
        err = ServiceError(f"replica {slot} of service {self.spec.name} failed to start: {exc}", service=self.spec.name)
        err.__cause__ = exc
        r.up._set_exception(err)
        for q in moved:
            self._resubmit(q, err)

    # -- draining and stopping -------------------------------------------------------------
    def scale(self, n: int) -> Future[None]:
        """Grow or shrink to ``n`` live replicas; the future completes when done."""
        with self._lock:
            if self.stopped is not None:
                raise ServiceStopped(f"service {self.spec.name} was stopped ({self.stopped})", service=self.spec.name)
            self._replicas = [r for r in self._replicas if r.state != FAILED]  # given up: their procs are gone
            live = [r for r in self._replicas if r.state in (STARTING, HEALTHY)]
            victims = sorted(live, key=lambda r: (r.state == HEALTHY, -r.slot))[: max(0, len(live) - n)]
            waits: list[Future[None]] = []
            actions: Actions = []
            for v in victims:
                actions += [partial(self._resubmit, q, None) for q in v.queue]
                v.queue.clear()
                if v.state == STARTING:
                    v.generation += 1  # a build still running for it is discarded when it ends
                    v.state = STOPPED
                    self._replicas.remove(v)
                    actions.append(partial(v.up._set_result, None))  # no longer wanted: nobody waits for it
                    continue
                v.state = DRAINING
                v.gone, v.drained = Future._create(), Future._create()
                if v.in_flight == 0:
                    v.drained._set_result(None)
                waits.append(v.gone)
                actions.append(partial(self._ask_owner, "retire", v.slot, v.generation, self.spec.drain_timeout_s))
            grow = max(0, n - len(live))
        for act in actions:
            act()
        waits += [r.up for r in self.add_replicas(grow)]
        return gather(waits).then(lambda _: None)

    def drained_future(self, slot: int, generation: int) -> Future[None] | None:
        """Completes when the draining ``slot`` has nothing in flight."""
        with self._lock:
            r = self._slot(slot)
            return r.drained if r is not None and r.generation == generation else None

    def take_procs(self, slot: int, generation: int) -> Any:
        """Hand over a draining replica's procs for stopping; nothing is sent to it any more."""
        with self._lock:
            r = self._slot(slot)
            if r is None or r.generation != generation:
                return None
            procs, r.procs = r.procs, None
            return procs

    def retired(self, slot: int, generation: int) -> None:
        """A drained replica's procs were stopped: drop the slot."""
        with self._lock:
            r = self._slot(slot)
            if r is None or r.generation != generation:
                return
            r.state = STOPPED
            self._replicas.remove(r)
            self._by_mesh.pop(r.mesh_name, None)
            for sid, bound in self._sessions.items():
                if bound == slot:
                    self._sessions[sid] = None
        if r.gone is not None:
            r.gone._set_result(None)

    def begin_stop(self, reason: str) -> None:
        """Refuse new requests, fail the queued ones (they did not run), drain the rest."""
        with self._lock:
            if self.stopped is not None:
                return
            self.stopped = reason
            queued = [q for r in self._replicas for q in r.queue]
            for r in self._replicas:
                r.queue.clear()
                r.generation += 1 if r.state == STARTING else 0
                if r.state in (HEALTHY, STARTING, FAILED):
                    r.state = DRAINING
                if r.drained is None:
                    r.drained = Future._create()
                if r.in_flight == 0:
                    r.drained._set_result(None)
        err = ServiceStopped(f"service {self.spec.name} was stopped ({reason}) before this queued request ran", service=self.spec.name)
        for q in queued:
            q.future._set_exception(err)
        for r in list(self._replicas):
            if not r.up.done():
                r.up._set_exception(ServiceStopped(f"service {self.spec.name} was stopped while replica {r.slot} was starting", service=self.spec.name))

    def closed(self) -> None:
        """The service's procs are all stopped: complete every future still waiting on a replica."""
        with self._lock:
            replicas = list(self._replicas)
        for r in replicas:
            r.up._set_exception(ServiceStopped(f"service {self.spec.name} was stopped while replica {r.slot} was starting", service=self.spec.name))
            for fut in (r.gone, r.drained):
                if fut is not None:
                    fut._set_result(None)

    def all_drained(self) -> list[Future[None]]:
        """One future per replica, done when it has nothing in flight."""
        with self._lock:
            return [r.drained for r in self._replicas if r.drained is not None]

    def take_all_procs(self) -> list[Any]:
        """Every proc mesh still held (live replicas and dead incarnations), for the final stop."""
        with self._lock:
            procs = [r.procs for r in self._replicas if r.procs is not None] + [p for p in self._abandoned.values() if p is not None]
            for r in self._replicas:
                r.procs, r.state = None, STOPPED
            self._abandoned.clear()
            return procs
