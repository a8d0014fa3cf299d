"""``Service``: N replicas of an actor class behind a router, from a controller script.

Example::

    from actormesh.actor import Actor, endpoint
    from actormesh.serve import Service

    class Model(Actor):
        def __init__(self, path: str): ...
        @endpoint
        def predict(self, x: float) -> float: ...

    svc = Service(1, 4, Model, "/ckpt")        # 4 replicas of one proc each
    svc.ready().get(timeout=120)                # or: await svc.ready()
    y = svc.predict.route(3.0).get()            # one replica, chosen by the router
    svc.predict.fanout(0.0).get()               # every healthy replica
    with svc.session():                         # sticky: same replica for the block
        svc.predict.route(1.0).get()
    print(svc.metrics())
    svc.stop().get()
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..mesh import this_host, this_proc
from ..runtime import Actor, Future
from ._autoscale import Autoscaler, Autoscaling, autoscale
from ._core import ServiceCore
from ._handle import ServiceHandle
from ._health import CHECK, HealthChecker
from ._metrics import ServiceMetrics
from ._replica import DRAINING, STOPPED, ServiceOwner, register_core, unregister_core
from ..runtime import gather
from ._request import ServiceSpec, check_class, check_int, endpoint_names, per_host
from ._router import Router, make_router

__all__ = ["Service", "ServiceEndpoint", "Session", "ReplicaInfo", "service"]

T = TypeVar("T")

#: The session of the current ``with svc.session():`` block: (service key, session id).
_current_session: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("actormesh_serve_session", default=None)


@dataclass(frozen=True)
class ReplicaInfo:
    """A snapshot of one replica slot: ``mesh`` is its actor mesh while it is up (else None)."""

    slot: int
    state: str
    generation: int
    mesh: Any
    procs: Any


class Service(Generic[T]):
    """``num_replicas`` replicas of ``actor_class``, each an actor mesh on its own
    proc mesh of ``procs_per_replica`` procs (an int, or a ``per_host`` dict such
    as ``{"gpus": 2}`` for a TP pair). Returns at once; ``ready()`` waits.

    Keyword options (everything else in ``**kwargs`` goes to the actor's ``__init__``;
    use ``actor_kwargs=`` for an actor argument named like an option):

    - ``name``: used in proc names, errors and metrics (default: the class name).
    - ``router``: ``"least_loaded"`` (default), ``"round_robin"`` or a :class:`Router`.
    - ``max_concurrency`` (16): requests in flight per replica; ``max_queue`` (64):
      requests waiting per replica. Beyond both on every replica, ``route`` raises
      ``ServiceOverloaded`` at once.
    - ``idempotent``: endpoint names that are retried on another replica (up to
      ``max_retries``, default 2) when their replica dies with them in flight; other
      endpoints fail then with ``ReplicaFailed`` (may or may not have run).
    - ``all_members``: endpoint names (or True for all) that go to every member
      of a multi-proc replica, rank 0's value returned; the others go to rank 0 only.
    - ``build_timeout_s`` (120): how long a replica may take to start;
      ``drain_timeout_s`` (30): how long a removed replica may finish its requests;
      ``max_rebuilds`` (3): failed rebuilds in a row before a dead replica is given up.
    - ``hosts``: the HostMesh to spawn replicas on (default ``this_host()``).
    - ``health_check_period_s`` (10): how often a class with a ``check_health`` endpoint
      (Ray Serve's name) is asked on every healthy replica; a check that raises
      restarts that replica, one not answered yet is waited for (busy is not dead).
    - ``autoscaling``: an :class:`Autoscaling` (Ray Serve's rule): the replica count
      then follows the load between its bounds (``num_replicas`` is where it starts),
      and ``scale`` by hand is refused.

    Raises TypeError/ValueError at once for a bad option, a class that is not an
    Actor, or arguments that do not fit its ``__init__``.
    """

    def __init__(self, procs_per_replica: int | Mapping[str, int], num_replicas: int, actor_class: type[T], *args: Any,
                 name: str | None = None, router: str | Router = "least_loaded", max_concurrency: int = 16, max_queue: int = 64,
                 idempotent: Iterable[str] = (), all_members: bool | Iterable[str] = (), max_retries: int = 2,
                 build_timeout_s: float = 120.0, drain_timeout_s: float = 30.0, max_rebuilds: int = 3, hosts: Any = None,
                 actor_kwargs: Mapping[str, Any] | None = None, autoscaling: Autoscaling | None = None, health_check_period_s: float = 10.0,
                 **kwargs: Any) -> None:
        eps = check_class(actor_class, args, {**kwargs, **(actor_kwargs or {})})
        check_int("num_replicas", num_replicas, 0)
        check_int("max_concurrency", max_concurrency, 1)
        check_int("max_queue", max_queue, 0)
        check_int("max_retries", max_retries, 0)
        check_int("max_rebuilds", max_rebuilds, 0)
        for label, value in (("build_timeout_s", build_timeout_s), ("drain_timeout_s", drain_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{label} must be a number of seconds > 0, got {value!r}")
        if isinstance(health_check_period_s, bool) or not isinstance(health_check_period_s, (int, float)) \
                or not 0 < health_check_period_s < float("inf"):
            raise ValueError(f"health_check_period_s must be a finite number of seconds > 0, got {health_check_period_s!r}")
        if autoscaling is not None and (not isinstance(autoscaling, Autoscaling) or autoscaling.clamp(num_replicas) != num_replicas):
            raise ValueError(f"autoscaling must be an actormesh.serve.Autoscaling whose bounds hold num_replicas={num_replicas}, got {autoscaling!r}")
        name = name or actor_class.__name__
        if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"name must be a non-empty str of letters, digits, '-' and '_', got {name!r}")
        spec = ServiceSpec(
            name=name, actor_class=actor_class, args=tuple(args), kwargs={**kwargs, **(actor_kwargs or {})},
            per_host=per_host(procs_per_replica), hosts=hosts if hosts is not None else this_host(),
            max_concurrency=max_concurrency, max_queue=max_queue, idempotent=endpoint_names("idempotent", idempotent, eps, actor_class),
            all_members=frozenset("*") if all_members is True else endpoint_names("all_members", all_members or (), eps, actor_class),
            max_retries=max_retries, build_timeout_s=float(build_timeout_s), drain_timeout_s=float(drain_timeout_s), max_rebuilds=max_rebuilds,
        )
        self._key = f"{name}-{os.urandom(6).hex()}"
        self._endpoints = eps
        self._core = core = ServiceCore(spec, make_router(router))
        self._stopping: Future[None] | None = None
        register_core(self._key, core)
        core.owner = this_proc().spawn(f"{name}_owner", ServiceOwner, self._key)
        self._ready = gather([r.up for r in core.add_replicas(num_replicas)]).then(lambda _: None)
        self.autoscaler = autoscale(core, autoscaling) if autoscaling is not None else None
        self.health = HealthChecker(core, float(health_check_period_s)) if CHECK in eps else None

    @classmethod
    def deploy(cls, actor_class: type[T], *args: Any, **overrides: Any) -> Service[T]:
        """Start a service of a class marked with ``@service(...)``, its options
        overridden by ``overrides`` (``procs_per_replica`` and ``num_replicas`` too)."""
        options = dict(getattr(actor_class, "__actormesh_service__", {}))
        options.update(overrides)
        procs = options.pop("procs_per_replica", 1)
        replicas = options.pop("num_replicas", 1)
        return cls(procs, replicas, actor_class, *args, **options)

    # -- calls -------------------------------------------------------------------------
    def __getattr__(self, name: str) -> ServiceEndpoint[Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._endpoints:
            known = ", ".join(sorted(self._endpoints)) or "none"
            raise AttributeError(f"service {self._core.spec.name} ({self._core.spec.actor_class.__qualname__}) has no endpoint {name!r}; its endpoints: {known}")
        ep: ServiceEndpoint[Any] = ServiceEndpoint(self, name)
        self.__dict__[name] = ep
        return ep

    def endpoint(self, name: str) -> ServiceEndpoint[Any]:
        """``svc.endpoint("x")`` is ``svc.x``, also for an endpoint named like a Service method."""
        if name not in self._endpoints:
            return self.__getattr__(name)  # raises the AttributeError that lists the endpoints
        return ServiceEndpoint(self, name)

    def session(self, session_id: str | None = None) -> Session:
        """Open a sticky session (a new id, or join ``session_id``): requests in it
        go to one replica. Use as ``with svc.session(): ...`` (closed at exit when
        this call opened it) or pass ``session.id`` to ``route_session``."""
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise TypeError(f"session_id must be a non-empty str, got {session_id!r}")
        sid = session_id or os.urandom(8).hex()
        opened = sid not in self._core._sessions
        self._core.open_session(sid)
        return Session(self, sid, opened)

    # -- lifecycle -----------------------------------------------------------------------
    def ready(self) -> Future[None]:
        """Completes when every replica asked for at creation is up; raises a
        ``ServiceError`` naming the replica (with its ``__init__`` error as cause)
        when one failed to start. ``svc.ready().get(timeout=60)`` or ``await svc.ready()``."""
        return self._ready

    def scale(self, num_replicas: int) -> Future[None]:
        """Grow or shrink to ``num_replicas`` at run time. New replicas are built in
        the background; removed ones stop taking requests at once, their queued
        requests move to the others, and they stop after their requests in flight
        finish (at most ``drain_timeout_s``). The future completes when all is done."""
        check_int("num_replicas", num_replicas, 0)
        if self.autoscaler is not None:
            cfg = self.autoscaler.decider.config
            raise ValueError(f"service {self.name} autoscales between {cfg.min_replicas} and {cfg.max_replicas} replicas; "
                             "it is not scaled by hand (create it without autoscaling= to do that)")
        return self._core.scale(num_replicas)

    def stop(self, drain_timeout_s: float | None = None) -> Future[None]:
        """Stop the service: new calls fail at once (``ServiceStopped``), queued ones
        fail (they did not run), those in flight get up to ``drain_timeout_s``
        (default: the service's) to finish; then every proc is stopped. Idempotent."""
        if self._stopping is not None:
            return self._stopping
        for thread in (self.autoscaler, self.health):
            if thread is not None:
                thread.stop()
        core = self._core
        drain = core.spec.drain_timeout_s if drain_timeout_s is None else float(drain_timeout_s)
        done: Future[None] = Future._create()
        self._stopping = done
        core.begin_stop("stopped by its controller")

        def finish(_: Any) -> None:
            core.closed()
            unregister_core(self._key)
            done._set_result(None)

        def owner_done(_: Any) -> None:
            core.owner.stop("its service was stopped")._add_done_callback(finish)

        core.owner.shutdown.call_one(drain)._add_done_callback(owner_done)
        return done

    def metrics(self) -> ServiceMetrics:
        """Counters per replica and for the service: requests, errors, in flight,
        queued, restarts, latency p50/p99 (ms)."""
        return self._core.metrics()

    def restart_replica(self, slot: int, generation: int | None = None, reason: str = "restarted by its controller") -> bool:
        """Stop replica ``slot`` now and rebuild it, as if it had failed (its requests in
        flight fail with ``ReplicaFailed``, its queued ones move to other replicas).
        ``generation`` pins the incarnation meant (see :meth:`replicas`): a newer one is
        left alone. Returns False when that incarnation is not healthy (already gone)."""
        check_int("slot", slot, 0)
        return self._core.restart(slot, generation, reason)

    def capacity(self) -> int:
        """How many requests the service takes at once before ``ServiceOverloaded``:
        ``max_concurrency + max_queue`` for each replica it keeps (one draining away
        after ``scale`` does not count). A batch of more can never be in it whole."""
        spec = self._core.spec
        kept = sum(1 for r in self._core.replicas() if r.state not in (DRAINING, STOPPED))
        return kept * (spec.max_concurrency + spec.max_queue)

    def replicas(self) -> list[ReplicaInfo]:
        """A snapshot of every replica slot (state, incarnation, mesh while up)."""
        return [ReplicaInfo(r.slot, r.state, r.generation, r.mesh, r.procs) for r in self._core.replicas()]

    @property
    def name(self) -> str:
        """The service's name."""
        return self._core.spec.name

    @property
    def endpoint_names(self) -> tuple[str, ...]:
        """The names of its endpoints, sorted."""
        return tuple(sorted(self._endpoints))

    def __enter__(self) -> Service[T]:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop().get(timeout=self._core.spec.drain_timeout_s + 60)

    async def __aenter__(self) -> Service[T]:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    def __reduce__(self) -> Any:
        # Sent to another process (an endpoint's or a constructor's argument), a service is a
        # handle that routes through this process's owner actor (see _handle.py).
        return (ServiceHandle, (self._core.owner, self.name, frozenset(self._endpoints)))

    def __repr__(self) -> str:
        return f"<Service {self.name} of {self._core.spec.actor_class.__qualname__}: {len(self._core.replicas())} replicas>"


class ServiceEndpoint(Generic[T]):
    """An endpoint of a service (``svc.method``): ``route`` and ``fanout``."""

    __slots__ = ("_svc", "_name", "_prop")

    def __init__(self, svc: Service[Any], name: str) -> None:
        self._svc = svc
        self._name = name
        self._prop = svc._endpoints[name]

    def route(self, *args: Any, **kwargs: Any) -> Future[T]:
        """Send one request to one replica (the session's, else the router's pick);
        the future holds its result (rank 0's for a multi-proc replica).

        Raises at once: TypeError (arguments that do not fit), ServiceOverloaded,
        ServiceUnavailable, ServiceStopped. The future raises the endpoint's own
        error (``ActorError``), or ``ReplicaFailed`` when the replica died with the
        request in flight (it may or may not have run)."""
        self._prop.bind_check(args, kwargs)
        svc = self._svc
        current = _current_session.get()
        session = current[1] if current is not None and current[0] == svc._key else None
        return svc._core.submit(self._name, args, kwargs, session)

    def route_session(self, session_id: str, *args: Any, **kwargs: Any) -> Future[T]:
        """``route`` within an open session given by id (``UnknownSession`` if it is not open)."""
        self._prop.bind_check(args, kwargs)
        return self._svc._core.submit(self._name, args, kwargs, session_id)

    def fanout(self, *args: Any, **kwargs: Any) -> Future[list[T]]:
        """Send to every healthy replica now, past the admission limits (e.g. new
        weights); the future holds their values in replica order, or raises the
        first error after all answered."""
        self._prop.bind_check(args, kwargs)
        return self._svc._core.fanout(self._name, args, kwargs)

    def fanout_each(self, *args: Any, **kwargs: Any) -> list[tuple[int, int, Future[T]]]:
        """``fanout`` with one outcome per replica: ``(slot, incarnation, future)`` for
        every healthy replica, in slot order (one replica's error does not hide the others')."""
        self._prop.bind_check(args, kwargs)
        return self._svc._core.fanout_each(self._name, args, kwargs)

    def __repr__(self) -> str:
        return f"<ServiceEndpoint {self._svc.name}.{self._name}>"


class Session:
    """A sticky session of a service: its requests go to one replica (chosen by
    the router on first use, chosen again if that replica is removed or gave up).
    A context manager that makes it the current session of its thread or task."""

    def __init__(self, svc: Service[Any], session_id: str, opened: bool) -> None:
        self._svc = svc
        self.id = session_id
        self._opened = opened
        self._tokens: list[contextvars.Token[Any]] = []

    def close(self) -> None:
        """End the session; later use of its id raises ``UnknownSession``."""
        self._svc._core.close_session(self.id)

    def __enter__(self) -> Session:
        self._tokens.append(_current_session.set((self._svc._key, self.id)))
        return self

    def __exit__(self, *exc: Any) -> None:
        _current_session.reset(self._tokens.pop())
        if self._opened:
            self.close()

    def __repr__(self) -> str:
        return f"<Session {self.id} of {self._svc.name}>"


def service(procs_per_replica: int | Mapping[str, int] = 1, num_replicas: int = 1, **options: Any) -> Any:
    """Class decorator: default service options for an actor class, used by
    ``Service.deploy(Cls, *args, **overrides)``. The class stays a plain actor class.

    Example::

        @service(num_replicas=2, router="round_robin")
        class Echo(Actor): ...

        svc = Service.deploy(Echo)
    """

    def mark(cls: type[T]) -> type[T]:
        check_class(cls, None, None)
        cls.__actormesh_service__ = {"procs_per_replica": procs_per_replica, "num_replicas": num_replicas, **options}  # type: ignore[attr-defined]
        return cls

    return mark
