"""One replica slot of a service, and the actor that owns every replica's procs.

A replica is an actor mesh on its own proc mesh (one proc, or a group such as a
TP pair). The procs are spawned by :class:`ServiceOwner`, an async actor the
service starts in the controller's own process (``this_proc()``): as their
spawner it is their supervision owner, so a replica that dies (proc killed,
actor failed) reaches its ``__supervise__`` at once, and the service marks the
replica unhealthy and rebuilds it. Deliberate stops (scale down, service stop)
are not failures and reach nobody.

The owner runs the slow work (spawning, waiting for ``__init__``, stopping
procs) as concurrent endpoints on its own event loop, so the request path never
waits on it and ``__supervise__`` runs between them without delay.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from ..mesh import ProcMesh
from ..runtime import Actor, Future, MeshFailure, concurrent_endpoint, endpoints_of
from ._metrics import ReplicaStats

if TYPE_CHECKING:
    from ._core import ServiceCore

__all__ = ["Replica", "ServiceOwner", "register_core", "unregister_core"]

log = logging.getLogger("actormesh.serve")

#: Services of this process by key, so the owner actor (same process) finds its core.
_cores: dict[str, ServiceCore] = {}

STARTING, HEALTHY, DRAINING, FAILED, STOPPED = "starting", "healthy", "draining", "failed", "stopped"


def register_core(key: str, core: ServiceCore) -> None:
    """Make ``core`` reachable by its owner actor."""
    _cores[key] = core


def unregister_core(key: str) -> None:
    """Forget a stopped service."""
    _cores.pop(key, None)


class Replica:
    """One replica slot: its current incarnation (procs, mesh), load and counters.

    Mutated only under the service's lock. ``generation`` grows with every
    rebuild, so replies and failures of an earlier incarnation are told apart.
    """

    __slots__ = ("slot", "state", "generation", "procs", "mesh", "mesh_name", "in_flight", "queue", "stats",
                 "senders", "build_failures", "up", "gone", "drained")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.state = STARTING
        self.generation = 0
        self.procs: ProcMesh | None = None
        self.mesh: Any = None
        self.mesh_name = ""
        self.in_flight = 0
        self.queue: deque[Any] = deque()
        self.stats = ReplicaStats()
        #: endpoint name -> (adverb to call, whether the reply is a ValueMesh to take rank 0 from)
        self.senders: dict[str, tuple[Any, bool]] = {}
        self.build_failures = 0
        self.up: Future[None] = Future._create()  # completes when first healthy (or failed to start)
        self.gone: Future[None] | None = None  # completes when a removed replica's procs stopped
        self.drained: Future[None] | None = None  # completes when a draining replica has nothing in flight

    @property
    def queued(self) -> int:
        """Requests waiting in its queue."""
        return len(self.queue)

    @property
    def load(self) -> int:
        """``in_flight + queued`` (what least-loaded routing compares)."""
        return self.in_flight + len(self.queue)

    def attach(self, procs: ProcMesh, mesh: Any) -> None:
        """Make ``mesh`` (on ``procs``) this slot's live incarnation."""
        self.procs = procs
        self.mesh = mesh
        self.mesh_name = mesh._mesh_name
        self.senders = {}

    def sender(self, endpoint: str, to_all: bool) -> tuple[Any, bool]:
        """The adverb that sends ``endpoint`` to this replica: ``call_one`` on its
        rank-0 member, or ``call`` on every member (rank 0's value is kept)."""
        found = self.senders.get(endpoint)
        if found is None:
            mesh = self.mesh
            if to_all and len(mesh) > 1:
                found = (getattr(mesh, endpoint).call, True)
            else:
                one = mesh if len(mesh) == 1 else mesh.slice(**{label: 0 for label in mesh.sizes})
                found = (getattr(one, endpoint).call_one, False)
            self.senders[endpoint] = found
        return found


class ServiceOwner(Actor):
    """Spawns, supervises and stops the replicas of one service (runs in the
    process that created the service). Not for direct use."""

    def __init__(self, key: str) -> None:
        self._core = _cores[key]
        self._endpoints = endpoints_of(self._core.spec.actor_class)

    async def __supervise__(self, failure: MeshFailure) -> bool:
        # Every mesh this actor owns is a replica (or an abandoned incarnation of one).
        self._core.on_replica_failure(failure.mesh_name, failure.cause)
        return True

    @concurrent_endpoint
    async def route(self, endpoint: str, args: tuple[Any, ...], kwargs: dict[str, Any], session: str | None) -> Any:
        """A request from a :class:`~._handle.ServiceHandle` in another process, routed as
        ``svc.endpoint.route`` would route it here; its value (or error) goes back."""
        self._endpoints[endpoint].bind_check(args, kwargs)
        return await self._core.submit(endpoint, args, kwargs, session).as_asyncio()

    @concurrent_endpoint
    async def fanout(self, endpoint: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """``svc.endpoint.fanout`` for a handle in another process."""
        self._endpoints[endpoint].bind_check(args, kwargs)
        return await self._core.fanout(endpoint, args, kwargs).as_asyncio()

    @concurrent_endpoint
    async def build(self, slot: int, generation: int, delay_s: float) -> None:
        """Start incarnation ``generation`` of replica ``slot`` after ``delay_s``."""
        core = self._core
        spec = core.spec
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if not core.wants(slot, generation):
            return
        procs = None
        try:
            # On a thread (with this actor's context: it stays the owner): spawning on
            # remote hosts waits for their agents, and this loop must stay free for
            # __supervise__ meanwhile.
            procs = await asyncio.to_thread(spec.hosts.spawn_procs, per_host=dict(spec.per_host), name=f"{spec.name}-r{slot}")
            mesh = procs.spawn(spec.name, spec.actor_class, *spec.args, **spec.kwargs)
            core.building(slot, generation, mesh._mesh_name)
            await asyncio.wait_for(mesh.initialized.as_asyncio(), spec.build_timeout_s)
        except Exception as exc:
            if procs is not None:
                await _stop(procs)
            core.build_failed(slot, generation, exc)
            return
        if not core.replica_up(slot, generation, procs, mesh):
            await _stop(procs)  # the slot was removed or the service stopped meanwhile

    @concurrent_endpoint
    async def retire(self, slot: int, generation: int, drain_s: float) -> None:
        """Stop replica ``slot`` once nothing is in flight there (at most ``drain_s``)."""
        core = self._core
        drained = core.drained_future(slot, generation)
        if drained is not None:
            try:
                await asyncio.wait_for(drained.as_asyncio(), drain_s)
            except asyncio.TimeoutError:
                log.warning("replica %d of %s still had requests in flight after %.1fs of draining; stopping it", slot, core.spec.name, drain_s)
        await _stop(core.take_procs(slot, generation))
        core.retired(slot, generation)

    @concurrent_endpoint
    async def stop_procs(self, token: int) -> None:
        """Stop the procs of an abandoned incarnation (a replica that died)."""
        await _stop(self._core.take_abandoned(token))

    @concurrent_endpoint
    async def shutdown(self, drain_s: float) -> None:
        """Stop every replica: wait up to ``drain_s`` for requests in flight, then stop all procs."""
        core = self._core
        drains = [f.as_asyncio() for f in core.all_drained()]
        if drains:
            done, pending = await asyncio.wait(drains, timeout=drain_s)
            if pending:
                log.warning("%s: %d replica(s) still had requests in flight after %.1fs; stopping them", core.spec.name, len(pending), drain_s)
        await asyncio.gather(*(_stop(p) for p in core.take_all_procs()))


async def _stop(procs: ProcMesh | None) -> None:
    if procs is None:
        return
    try:
        await procs.stop("its service replica was removed").as_asyncio()
    except Exception:
        log.exception("stopping the procs of a replica failed")
