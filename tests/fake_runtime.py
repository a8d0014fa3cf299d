"""A FakeRuntime: the mesh layer's view of ``ProcRuntime``, with no process behind it.

Why: the mesh layer (adverbs, slicing, gathering, the cast tree, spawn/stop
bookkeeping) is logic over a handful of runtime verbs. Testing it through real
procs costs seconds per test and makes failure orders hard to pin down. Here
every verb the mesh layer calls is recorded as a :class:`Sent` (plain data, the
arguments already decoded), and the test answers what it chooses, in the order
it chooses: a value, a raised exception, a supervision verdict, or a lost peer.

Theory of operation:

1. Sending. ``call_actor``, ``cast``, ``spawn_actor``, ``stop_actor``,
   ``stop_proc`` and ``reply`` append one :class:`Sent` to ``fake.sent`` and do
   nothing else: there are no routes, no sequence numbers and no sockets.
2. Ports. The mesh layer's reply ports (``OnePort``, ``GatherPort``,
   ``StreamPort``, the stop waiter) register with ``register_port`` and list the
   peers they wait on with ``await_peer``, as on a real runtime; the fake keeps
   both tables so a test can check nothing is left behind.
3. Answering. ``answer``/``answer_error``/``answer_gone`` hand a reply to the
   port a :class:`Sent` names, synchronously, in the caller's thread, exactly as
   the runtime's loop thread would (``Reply`` to a port, or, for a member of a
   cast, a one-entry ``ReplyMulti`` from its subtree root); ``answer_cast``
   sends one ``ReplyMulti`` per subtree, as the real tree does.
4. Loss. ``lose_peer`` is ``ProcRuntime.peer_gone``: the peer is marked dead and
   every port waiting on it hears ``peer_lost`` at once. A port that starts
   waiting on a peer already dead hears it on the next loop turn (``run_ready``),
   as ``ProcRuntime.await_peer`` schedules it.
5. Time. ``loop`` is a :class:`FakeLoop` with a virtual clock: ``call_later``
   deadlines (a stop's) run only when the test calls ``advance``.

Inject it with :func:`install` (``ActorMesh._runtime`` and what ``ProcMesh.spawn``
imports), or build an ``ActorMesh`` from its constructor with :func:`actor_mesh`.

What it cannot do: run actors (no endpoint body ever executes), check message
order along the tree (no ``SeqOut``/``Reorder``), relay through tree nodes,
spawn or kill procs (``ProcMesh.stop``, ``HostMesh`` need real children), or
fail a reply port that is not ``await_peer``-ed when its peer is lost (a real
route's undeliverable reply).
"""

from __future__ import annotations

import heapq
import itertools
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from actormesh.errors import Cause, CauseKind
from actormesh.mesh import ActorMesh, Extent, Shape
from actormesh.runtime import CastPlan
from actormesh.runtime import messages as M
from actormesh.transport import dumps, loads

__all__ = ["FakeLoop", "FakeRuntime", "Sent", "actor_mesh", "install"]

PortRef = tuple[str, int]


@dataclass(frozen=True)
class Sent:
    """One verb call of the mesh layer, as plain data.

    ``member`` is the message index (the reply's slot) for a call, a spawn's rank
    or a stop's index; None for a cast, whose members are ``members`` (their
    addresses in index order), sent as one message per subtree root (``roots``),
    ``owed[i]`` being the root that answers for member ``i``. ``args``/``kwargs``
    are the decoded endpoint (or ``__init__``) arguments; ``cls`` a spawn's class.
    """

    verb: str
    address: str
    actor: str | None = None
    endpoint: str | None = None
    member: int | None = None
    reply: PortRef | None = None
    labels: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    cls: type | None = None
    members: tuple[str, ...] = ()
    roots: tuple[str, ...] = ()
    owed: tuple[str, ...] = ()
    whole: bool = False
    status: int | None = None


class FakeLoop:
    """The runtime's loop, in virtual time: callbacks run only in ``run_ready``/``advance``.

    Why: a real loop runs on its own thread; here the test decides when a loop
    turn happens, so deferred effects (a dead peer's ``peer_lost``, a stop's
    deadline) are observable before and after, deterministically.
    """

    def __init__(self) -> None:
        self._now = 0.0
        self._timers: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._order = itertools.count()

    def time(self) -> float:
        return self._now

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.call_later(0.0, fn, *args)

    call_soon_threadsafe = call_soon

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> SimpleNamespace:
        heapq.heappush(self._timers, (self._now + max(0.0, delay), next(self._order), fn, args))
        return SimpleNamespace(cancel=lambda: None)  # nothing here cancels

    def run_ready(self) -> int:
        """Run every callback due by now (including ones they schedule); return how many ran."""
        ran = 0
        while self._timers and self._timers[0][0] <= self._now:
            _, _, fn, args = heapq.heappop(self._timers)
            fn(*args)
            ran += 1
        return ran

    def advance(self, seconds: float) -> int:
        """Move the clock on by ``seconds``, running each callback at its own time (what is
        ready now first, so a timer it arms counts from now); return how many ran."""
        target = self._now + seconds
        ran = self.run_ready()
        while self._timers and self._timers[0][0] <= target:
            self._now = self._timers[0][0]
            ran += self.run_ready()
        self._now = target
        return ran


class FakeRuntime:
    """Stands in for ``ProcRuntime`` as the mesh layer uses it; see the module docstring."""

    def __init__(self, address: str = "fake:controller") -> None:
        self.address = address
        self.root_address = address
        self.name = "fake"
        self.loop = FakeLoop()
        self.sent: list[Sent] = []
        self.ports: dict[int, Any] = {}
        self.owned_meshes: dict[str, Any] = {}
        self.children: dict[str, Any] = {}  # no procs of its own: kill_proc falls back to stop_proc
        self.dead: dict[str, Cause] = {}
        self.expected_gone: set[str] = set()
        self._waiting_on: dict[str, set[Any]] = {}
        self._port_ids = itertools.count(1)
        self.closed = False

    def __repr__(self) -> str:
        return f"<FakeRuntime {self.address}: {len(self.sent)} sent, {len(self.ports)} ports open>"

    # -- the verbs the mesh layer calls ------------------------------------------------------
    def call_actor(self, address: str, actor: str, endpoint: str, reply: PortRef | None, index: int,
                   labels: tuple[str, ...], sizes: tuple[int, ...], payload: Sequence[Any]) -> None:
        args, kwargs = _decode_call(payload)
        self.sent.append(Sent("call_actor", address, actor, endpoint, index, reply, labels, sizes, args, kwargs))

    def cast(self, actor: str, endpoint: str, reply: PortRef | None, labels: tuple[str, ...], sizes: tuple[int, ...],
             plan: CastPlan, payload: Sequence[Any], whole: bool) -> None:
        args, kwargs = _decode_call(payload)
        self.sent.append(Sent("cast", plan.roots[0] if plan.roots else "", actor, endpoint, None, reply, labels, sizes,
                              args, kwargs, members=plan.addresses, roots=plan.roots, owed=plan.owed, whole=whole))

    def spawn_actor(self, address: str, actor: str, rank: int, labels: tuple[str, ...], sizes: tuple[int, ...],
                    owner: Any, reply: PortRef | None, display: str, is_async: bool, payload: Sequence[Any]) -> None:
        cls, args, kwargs = loads(payload)
        self.sent.append(Sent("spawn_actor", address, actor, None, rank, reply, labels, sizes, tuple(args), kwargs, cls))

    def stop_actor(self, address: str, actor: str, reply: PortRef | None, index: int) -> None:
        self.sent.append(Sent("stop_actor", address, actor, None, index, reply))

    def stop_proc(self, address: str, reply: PortRef | None = None) -> None:
        self.sent.append(Sent("stop_proc", address, reply=reply))

    def reply(self, port: PortRef | None, index: int, status: int, payload: Sequence[Any]) -> None:
        if port is not None:
            self.sent.append(Sent("reply", port[0], member=index, reply=port, args=(loads(payload),), status=status))

    # -- ports and peers, as ProcRuntime keeps them -----------------------------------------
    def register_port(self, handler: Any) -> int:
        pid = next(self._port_ids)
        self.ports[pid] = handler
        return pid

    def unregister_port(self, port_id: int) -> None:
        self.ports.pop(port_id, None)

    def await_peer(self, address: str, handler: Any) -> None:
        cause = self.dead.get(address)
        if cause is not None:
            self.loop.call_soon_threadsafe(handler.peer_lost, address, cause)  # as ProcRuntime: next loop turn
            return
        self._waiting_on.setdefault(address, set()).add(handler)

    def unawait_peer(self, address: str, handler: Any) -> None:
        s = self._waiting_on.get(address)
        if s is not None:
            s.discard(handler)

    def peer_dead(self, address: str) -> str | None:
        return self.dead.get(address)

    def expect_gone(self, address: str) -> None:
        self.expected_gone.add(address)

    def in_loop(self) -> bool:
        return False  # the test's thread is never the loop's: loop work goes through call_soon_threadsafe

    # -- what a test does ------------------------------------------------------------------------
    def of(self, verb: str, endpoint: str | None = None) -> list[Sent]:
        """The recorded calls of ``verb`` (and ``endpoint``), in the order they were made."""
        return [s for s in self.sent if s.verb == verb and (endpoint is None or s.endpoint == endpoint)]

    def waiting(self) -> dict[str, int]:
        """Peers some port still waits on, with how many ports: ``{}`` once every reply is in."""
        return {a: len(s) for a, s in self._waiting_on.items() if s}

    def answer(self, sent: Sent, value: Any, member: int | None = None) -> bool:
        """``sent``'s member answers ``value`` (OK). False if its port is gone (the reply is dropped)."""
        return self._deliver(sent, M.OK, dumps(value), member)

    def answer_error(self, sent: Sent, exc: BaseException, member: int | None = None) -> bool:
        """``sent``'s member raised ``exc`` in its endpoint (ERROR, with a traceback)."""
        formatted = "".join(traceback.format_exception(exc))
        return self._deliver(sent, M.ERROR, dumps((exc, formatted)), member)

    def answer_gone(self, sent: Sent, cause: Cause, member: int | None = None) -> bool:
        """A peer that knew why answers that ``sent``'s member is gone (SUPERVISION)."""
        return self._deliver(sent, M.SUPERVISION, dumps(cause), member)

    def answer_cast(self, sent: Sent, values: Sequence[Any]) -> None:
        """Every member of the cast ``sent`` answers ``values[i]``: one ``ReplyMulti``
        per subtree, from its root, as the tree gathers them."""
        port = sent.reply
        assert sent.verb == "cast" and port is not None and len(values) == len(sent.members)
        by_root: dict[str, list[int]] = {}
        for i, root in enumerate(sent.owed):
            by_root.setdefault(root, []).append(i)
        for root, indices in by_root.items():
            payload: list[Any] = []
            entries = []
            for i in indices:
                segs = dumps(values[i])
                entries.append((i, M.OK, len(segs)))
                payload.extend(segs)
            env = M.ReplyMulti(M.REPLY_MULTI, port[1], tuple(entries), root)
            self._to_port(port, lambda h: h.deliver_many(env, payload))

    def lose_peer(self, address: str, cause: Cause | None = None) -> None:
        """The peer at ``address`` is gone (``ProcRuntime.peer_gone``): every port waiting
        on it fails what it owed, now. Default cause: unreachable."""
        cause = cause if cause is not None else Cause(f"the connection to {address} was lost", CauseKind.UNREACHABLE)
        self.dead[address] = cause
        for handler in list(self._waiting_on.pop(address, ())):
            handler.peer_lost(address, cause)

    def close(self) -> None:
        """As ``ProcRuntime.close``: every port still open is aborted (its waiters fail)."""
        self.closed = True
        for handler in list(self.ports.values()):
            abort = getattr(handler, "abort", None)
            if abort is not None:
                abort(Cause(f"the runtime of {self.address} was shut down", CauseKind.STOPPED))
        self.ports.clear()

    def _deliver(self, sent: Sent, status: int, payload: list[Any], member: int | None) -> bool:
        if sent.reply is None:
            raise ValueError(f"{sent.verb} to {sent.address} asked for no reply")
        if sent.verb == "cast":
            if member is None:
                raise ValueError("a cast's reply needs the member that answers")
            env = M.ReplyMulti(M.REPLY_MULTI, sent.reply[1], ((member, status, len(payload)),), sent.owed[member])
            return self._to_port(sent.reply, lambda h: h.deliver_many(env, payload))
        slot = sent.member if member is None else member
        assert slot is not None
        reply = M.Reply(M.REPLY, sent.reply[1], slot, status, sent.address)
        return self._to_port(sent.reply, lambda h: h.deliver(reply, payload))

    def _to_port(self, port: PortRef, give: Callable[[Any], None]) -> bool:
        if port[0] != self.address:
            raise ValueError(f"port {port} is not on this runtime ({self.address})")
        handler = self.ports.get(port[1])
        if handler is None:
            return False  # as ProcRuntime._dispatch: a reply to a closed port is dropped
        give(handler)
        return True


def _decode_call(payload: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """An endpoint payload's ``(args, kwargs)`` (a traced call carries a third item)."""
    decoded = loads(payload)
    return tuple(decoded[0]), dict(decoded[1])


_mesh_names = itertools.count()


def actor_mesh(cls: type, labels: Sequence[str], sizes: Sequence[int], name: str = "w") -> ActorMesh[Any]:
    """An ActorMesh of ``cls`` over fake addresses ``fake:p0``, ``fake:p1``... (one per
    rank, row-major), a reference (no owner record), under a fresh mesh name: the cast
    plan cache is process-wide and keyed by it."""
    n = 1
    for s in sizes:
        n *= s
    addresses = [f"fake:p{i}" for i in range(n)]
    extent = Extent(tuple(labels), tuple(sizes))
    display = f"<root>.<{cls.__module__}.{cls.__qualname__} {name}"
    return ActorMesh(cls, name, f"{name}-fake{next(_mesh_names)}", addresses, Shape.row_major(labels, sizes), display, extent)


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeRuntime | None = None) -> FakeRuntime:
    """Make the mesh layer find ``fake`` (a new one by default) as its runtime, for this test:
    actor meshes and their views (``ActorMesh._runtime``), and ``ProcMesh.spawn``
    (its ``current_runtime`` and, for the owner's name, ``context``)."""
    from actormesh.mesh import _proc_mesh

    fake = fake if fake is not None else FakeRuntime()
    monkeypatch.setattr(ActorMesh, "_runtime", staticmethod(lambda: fake))
    monkeypatch.setattr(_proc_mesh, "current_runtime", lambda: fake)
    client = SimpleNamespace(actor_instance=SimpleNamespace(is_actor=False, name="client", display="<root>"))
    monkeypatch.setattr(_proc_mesh, "context", lambda: client)
    return fake
