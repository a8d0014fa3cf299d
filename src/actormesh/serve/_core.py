"""The request path of a service: admission, dispatch, completion, failure.

Theory of operation
-------------------
All state (replicas, their queues and counters, sessions) sits behind one
lock. ``submit`` runs on the caller's thread: under the lock it picks a replica
(session, then router) and either takes one of its ``max_concurrency`` slots or
appends to its queue (at most ``max_queue``); with no room anywhere it raises
``ServiceOverloaded`` at once. The message itself is sent after the lock is
released, with the replica mesh's own ``call_one`` (or ``call``) adverb, and a
done-callback on its future does the rest on the runtime's loop thread: count,
complete the caller's future, send the next queued request. No thread or hop
is added per request.

A reply that is a ``SupervisionError`` means the replica died (the runtime
fails every call in flight to a dead actor); so does ``__supervise__`` on the
owner actor, whichever comes first. The replica's ``generation`` then grows:
in-flight requests of the old incarnation fail with ``ReplicaFailed`` (may or
may not have run) or are retried elsewhere when the endpoint is idempotent;
its queued requests, which never ran, move to other replicas; the owner
rebuilds the slot on fresh procs. Work that must not run under the lock
(sending, completing futures, asking the owner) is collected as ``actions``
and run after it is released.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from time import perf_counter
from typing import Any, cast

from ..errors import ActorError, SupervisionError
from ..runtime import Future
from ._errors import ReplicaFailed, ServiceError, ServiceOverloaded, ServiceStopped, ServiceUnavailable, UnknownSession
from ._lifecycle import Actions, ReplicaLifecycle
from ._metrics import ServiceMetrics, replica_snapshot, service_snapshot
from ._replica import DRAINING, HEALTHY, STARTING, Replica
from ..runtime import gather
from ._request import Request, ServiceSpec
from ._router import Router

__all__ = ["ServiceCore"]

Sender = tuple[Callable[..., Future[Any]], bool]


class ServiceCore(ReplicaLifecycle):
    """State and request path of one service (see the module docstring)."""

    def __init__(self, spec: ServiceSpec, router: Router) -> None:
        self.spec = spec
        self.router = router
        self.owner: Any = None  # the ServiceOwner actor mesh, set by Service
        self._lock = threading.Lock()
        self._replicas: list[Replica] = []  # slots in order, removed ones dropped
        self._by_mesh: dict[str, Replica] = {}
        self._next_slot = 0
        self._sessions: dict[str, int | None] = {}
        self.stopped: str | None = None
        self._overloaded = 0
        self._abandoned: dict[int, Any] = {}
        self._token = 0

    # -- admission --------------------------------------------------------------------
    def submit(self, endpoint: str, args: tuple[Any, ...], kwargs: dict[str, Any], session: str | None) -> Future[Any]:
        """Admit one request (caller's thread); raises at once when it cannot be admitted."""
        req = Request(endpoint, args, kwargs, session)
        with self._lock:
            if self.stopped is not None:
                raise ServiceStopped(f"service {self.spec.name} was stopped ({self.stopped}); create a new one", service=self.spec.name)
            replica = self._choose(endpoint, session)
            sender = self._admit(replica, req)
        if sender is not None:
            self._dispatch(replica, req, sender)
        return req.future

    def _choose(self, endpoint: str, session: str | None) -> Replica:
        """The replica for a request (under the lock); raises when none can take it."""
        spec = self.spec
        if session is not None:
            if session not in self._sessions:
                raise UnknownSession(f"session {session!r} is not open on service {spec.name} (never opened, or closed); open one with svc.session()", service=spec.name)
            bound = self._slot(self._sessions[session])
            if bound is not None and bound.state in (HEALTHY, STARTING):
                if self._has_room(bound):
                    return bound
                self._overloaded += 1
                raise ServiceOverloaded(f"replica {bound.slot} of {spec.name}, which serves session {session!r}, is full ({bound.in_flight} in flight, {bound.queued} queued)", service=spec.name)
        maxc, maxq = spec.max_concurrency, spec.max_queue
        eligible = [r for r in self._replicas if r.state == HEALTHY and (r.in_flight < maxc or len(r.queue) < maxq)]
        if not eligible:
            eligible = [r for r in self._replicas if r.state == STARTING and len(r.queue) < maxq]
        if not eligible:
            if not any(r.state == HEALTHY for r in self._replicas) and any(r.state == STARTING for r in self._replicas):
                self._overloaded += 1
                raise ServiceOverloaded(
                    f"service {spec.name} has no replica up yet ({self._states()}) and their queues ({maxq} each) are full; "
                    "wait for svc.ready() or raise max_queue", service=spec.name)
            if any(r.state == HEALTHY for r in self._replicas):
                self._overloaded += 1
                raise ServiceOverloaded(
                    f"service {spec.name} is overloaded: every replica has {maxc} requests in flight and {maxq} queued; "
                    "retry later, or raise max_concurrency/max_queue, or add replicas with svc.scale(n)", service=spec.name)
            raise ServiceUnavailable(f"service {spec.name} has no replica that can take requests ({self._states()})", service=spec.name)
        replica = cast(Replica, self.router.pick(eligible, endpoint))  # routers hand back one of ``eligible``
        if session is not None:
            self._sessions[session] = replica.slot
        return replica

    def _has_room(self, r: Replica) -> bool:
        if r.state == HEALTHY and r.in_flight < self.spec.max_concurrency:
            return True
        return len(r.queue) < self.spec.max_queue

    def _admit(self, r: Replica, req: Request) -> Sender | None:
        """Take a concurrency slot (returns how to send it now) or queue the request (None).

        Under the lock, so the sender belongs to the incarnation the slot was taken on."""
        if r.state == HEALTHY and r.in_flight < self.spec.max_concurrency:
            r.in_flight += 1
            req.generation = r.generation
            return r.sender(req.endpoint, self.spec.to_all(req.endpoint))
        r.queue.append(req)
        return None

    def _slot(self, slot: int | None) -> Replica | None:
        for r in self._replicas:
            if r.slot == slot:
                return r
        return None

    def _states(self) -> str:
        return ", ".join(f"replica {r.slot}: {r.state}" for r in self._replicas) or "no replicas"

    # -- dispatch and completion --------------------------------------------------------
    def _dispatch(self, r: Replica, req: Request, sender: Sender) -> None:
        """Send an admitted request to its replica (never under the lock)."""
        send, rank0 = sender
        try:
            fut = send(*req.args, **req.kwargs)
        except Exception as exc:  # e.g. an argument that cannot be pickled: it did not run
            self._finished(r, req, None, exc)
            return
        fut._add_done_callback(lambda f: self._on_reply(r, req, f, rank0))

    def _on_reply(self, r: Replica, req: Request, fut: Future[Any], rank0: bool) -> None:
        """The replica answered (runtime's loop thread, or the caller's if it failed at once)."""
        try:
            value = fut.get()
            if rank0:
                value = value.values()[0]
        except ActorError as exc:  # the endpoint raised (even a relayed SupervisionError): the replica lives
            self._finished(r, req, None, exc)
        except SupervisionError as exc:
            self._lost(r, req, exc)
        except BaseException as exc:
            self._finished(r, req, None, exc)
        else:
            self._finished(r, req, value, None)

    def _finished(self, r: Replica, req: Request, value: Any, exc: BaseException | None) -> None:
        """A value or the endpoint's own error: count it, settle the caller's future,
        start what it made room for. The hot path: keep it short."""
        actions: Actions | None = None
        drained = None
        with self._lock:
            stats = r.stats
            stats.requests += 1
            if exc is not None:
                stats.errors += 1
            stats.latency.add(perf_counter() - req.start)
            if req.generation == r.generation:
                r.in_flight -= 1
                actions = self._pull(r)  # its own queue, or a busier replica's
            if r.drained is not None and r.in_flight == 0 and r.state == DRAINING:
                drained = r.drained
        if exc is None:
            req.future._set_result(value)
        else:
            req.future._set_exception(exc)
        if actions:
            for act in actions:
                act()
        if drained is not None:
            drained._set_result(None)

    def _lost(self, r: Replica, req: Request, exc: BaseException) -> None:
        """The replica died (or was stopped) with ``req`` in flight: retry it if its
        endpoint is idempotent, else fail it as may-have-run. Either way the
        replica's incarnation is over (``_died`` acts once per incarnation)."""
        spec = self.spec
        with self._lock:
            stats = r.stats
            if req.generation == r.generation:
                r.in_flight -= 1
            stats.failed_in_flight += 1
            retry = req.endpoint in spec.idempotent and not req.fanout and req.attempts <= spec.max_retries and self.stopped is None
            if retry:
                stats.retried += 1
            else:
                stats.errors += 1
                stats.requests += 1
            actions = self._died(r, req.generation, str(exc))
            if r.drained is not None and r.in_flight == 0 and r.state == DRAINING:
                actions.append(partial(r.drained._set_result, None))
        if retry:
            req.attempts += 1
            self._resubmit(req, exc)
        else:
            err = ReplicaFailed(
                f"request {req.endpoint}() to replica {r.slot} of service {spec.name} failed: the replica died or was stopped "
                f"while the request was in flight, so it may or may not have run. Cause: {exc}", endpoint=req.endpoint, replica=r.slot)
            err.__cause__ = exc
            req.future._set_exception(err)
        for act in actions:
            act()

    def _pull(self, r: Replica) -> Actions:
        """Move queued requests into free concurrency slots (under the lock): first ``r``'s
        own, then those waiting on busier replicas (a replica just built, or one that went
        idle, takes on a backlog that routing left elsewhere)."""
        actions: Actions = []
        while r.state == HEALTHY and r.in_flight < self.spec.max_concurrency:
            nxt = r.queue.popleft() if r.queue else self._steal(r)
            if nxt is None:
                break
            r.in_flight += 1
            nxt.generation = r.generation
            sender = r.sender(nxt.endpoint, self.spec.to_all(nxt.endpoint))
            actions.append(partial(self._dispatch, r, nxt, sender))
        return actions

    def _steal(self, r: Replica) -> Request | None:
        """The oldest request that may run anywhere (no session, not a fanout's) queued on
        the replica with the longest queue other than ``r``; None if there is none."""
        for other in sorted((o for o in self._replicas if o is not r and o.queue), key=lambda o: -len(o.queue)):
            for req in other.queue:
                if req.session is None and not req.fanout:
                    other.queue.remove(req)
                    return req
        return None

    def _resubmit(self, req: Request, cause: BaseException | None) -> None:
        """Route a request again (it never ran, or it is idempotent); fail it if no replica has room."""
        with self._lock:
            try:
                if self.stopped is not None:
                    raise ServiceStopped(f"service {self.spec.name} was stopped before the request could run", service=self.spec.name)
                replica = self._choose(req.endpoint, req.session)
            except ServiceError as exc:
                error: BaseException | None = exc
            else:
                error = None
                sender = self._admit(replica, req)
        if error is not None:
            error.__cause__ = cause
            req.future._set_exception(error)
        elif sender is not None:
            self._dispatch(replica, req, sender)

    # -- sessions, fanout, metrics ---------------------------------------------------------
    def open_session(self, session: str) -> None:
        """Open (or join) a session id."""
        with self._lock:
            if self.stopped is not None:
                raise ServiceStopped(f"service {self.spec.name} was stopped ({self.stopped})", service=self.spec.name)
            self._sessions.setdefault(session, None)

    def close_session(self, session: str) -> None:
        """Forget a session; later use of its id raises UnknownSession."""
        with self._lock:
            self._sessions.pop(session, None)

    def fanout(self, endpoint: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future[list[Any]]:
        """Send to every healthy replica now (no admission limits); values in slot order."""
        return gather([fut for _, _, fut in self.fanout_each(endpoint, args, kwargs)])

    def fanout_each(self, endpoint: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[int, int, Future[Any]]]:
        """``fanout``, one ``(slot, incarnation, future)`` per healthy replica, in slot order."""
        with self._lock:
            if self.stopped is not None:
                raise ServiceStopped(f"service {self.spec.name} was stopped ({self.stopped}); create a new one", service=self.spec.name)
            targets = [r for r in self._replicas if r.state == HEALTHY]
            if not targets:
                raise ServiceUnavailable(f"service {self.spec.name} has no healthy replica to fan out to ({self._states()})", service=self.spec.name)
            sent = []
            for r in targets:
                req = Request(endpoint, args, kwargs, None, fanout=True)
                r.in_flight += 1
                req.generation = r.generation
                sent.append((r, req, r.sender(endpoint, self.spec.to_all(endpoint))))
        for r, req, sender in sent:
            self._dispatch(r, req, sender)
        return [(r.slot, req.generation, req.future) for r, req, _ in sent]

    def senders_of(self, endpoint: str) -> list[tuple[int, int, Callable[[], Future[Any]]]]:
        """``(slot, incarnation, send)`` for every healthy replica: ``send()`` calls ``endpoint``
        there with no arguments, past admission and the request counts (health checks)."""
        with self._lock:
            out = []
            for r in self._replicas:
                if r.state == HEALTHY:
                    adverb, _ = r.sender(endpoint, self.spec.to_all(endpoint))
                    out.append((r.slot, r.generation, adverb))
            return out

    def metrics(self) -> ServiceMetrics:
        """A snapshot of every replica's counters."""
        with self._lock:
            reps = [replica_snapshot(r.slot, r.state, r.in_flight, len(r.queue), r.stats) for r in self._replicas]
            lat = [v for r in self._replicas for v in r.stats.latency.values()]
            return service_snapshot(self.spec.name, reps, lat, self._overloaded)

    def replicas(self) -> list[Replica]:
        """The replica slots (live objects: read, do not change)."""
        with self._lock:
            return list(self._replicas)
