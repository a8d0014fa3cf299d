"""The runtime's verbs: one method per message kind a process originates (see
_messages.py for their fields); the mesh layer calls these and builds no envelope.
Elsewhere only the handshake (``Hello``, _peers.py and _gateway.py), a tree node
re-addressing a ``Cast`` (_cast.py) and the stand-ins for a message whose payload
was lost (_lost.py) build messages.

Ordering lives here too: a message to an actor (``Call``, ``StopActor``, each member
of a ``Cast``) is numbered as it leaves, chained per destination actor, so the
destination releases one sender's messages in send order whatever path they
took (_ordering.py).
A peer already known dead gets no number: the message fails its reply port at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..transport import Segment
from . import _messages as M
from ._cast import CastPlan
from ._messages import ActorRef, PortRef
from ._numbering import SeqOut
from ._routes import LocalRoute, Route, order_key

__all__ = ["Verbs"]

#: ``(seq, prev)`` of a message to a peer known dead: it fails its port at once, unread.
_UNNUMBERED: tuple[None, None] = (None, None)


class Verbs:
    """Sending half of :class:`~actormesh.runtime.ProcRuntime`. Every verb may be
    called from any thread; none blocks beyond handing the frame to its route."""

    address: str
    root_address: str
    seq_out: SeqOut
    _routes: dict[str, Route | LocalRoute]

    def route(self, address: str) -> Route | LocalRoute:  # pragma: no cover - ProcRuntime's
        raise NotImplementedError

    def send(self, address: str, env: M.Message, payload: Sequence[Segment] = ()) -> None:
        """Hand a message, as it is, to the route to ``address``."""
        r = self._routes.get(address)
        if r is None:
            r = self.route(address)
        r.send(env, payload, order_key(env))

    def call_actor(self, address: str, actor: str, endpoint: str, reply: PortRef | None, index: int,
                   labels: tuple[str, ...], sizes: tuple[int, ...], payload: Sequence[Segment]) -> None:
        """Run ``endpoint`` of ``actor`` at ``address`` as member ``index`` of a mesh
        of shape ``labels``/``sizes``; its reply goes to ``reply`` as ``index``."""
        r = self._routes.get(address)
        if r is None:
            r = self.route(address)
        seq, prev = self.seq_out.next(address, actor) if r.dead is None else _UNNUMBERED
        # The hottest path: the wire form of an M.Call, the plain tuple, with no NamedTuple
        # copy on the way (the receiver's decode gives it its type; see messages.typed).
        r.send((M.CALL, actor, endpoint, reply, index, labels, sizes, self.address, seq, prev), payload, actor)

    def cast(self, actor: str, endpoint: str, reply: PortRef | None, labels: tuple[str, ...], sizes: tuple[int, ...],
             plan: CastPlan, payload: Sequence[Segment], whole: bool) -> None:
        """Call ``endpoint`` of ``actor`` on every member of ``plan`` (member ``i`` at
        ``plan.addresses[i]``) along a tree (see _cast.py); ``plan.owed[i]`` is the
        subtree root that owes reply ``i``. ``whole``: the plan covers every member of
        ``actor``, which numbers the cast in O(1) (see _numbering, rule 3).

        The sender's work is O(fanout) sends plus O(members that got a message since the
        last whole cast), or since the last cast to the same slice (_numbering, rule 4).
        A subtree's addresses go to its root once per connection; later casts name
        them by table id (_cast.CastTables), so the bytes sent are O(fanout) too."""
        routes = []
        for root in plan.roots:
            r = self._routes.get(root)
            routes.append(r if r is not None else self.route(root))
        # A dead root's subtree gets no numbers: its members keep their chains, and the
        # message fails its port at once (the port waits on that root).
        dead = [c for c, r in enumerate(routes) if r.dead is not None]
        chunks = plan.chunks
        if whole:
            t, prev, exceptions = self.seq_out.cast_all(actor, plan.addresses, [a for c in dead for a in chunks[c][1]])
        else:
            if dead:
                live = [a for c, (_, sub) in enumerate(chunks) if c not in dead for a in sub]
                t, prev, exceptions = self.seq_out.cast_some(actor, live)
            else:
                t, prev, exceptions = self.seq_out.cast_some(actor, plan.addresses, plan.members)
        per_chunk = plan.exceptions_by_chunk(exceptions) if exceptions else None
        sender, tables, sent_on = self.address, plan.tables, plan.sent_on
        for c, (lo, sub) in enumerate(chunks):
            exc = per_chunk[c] if per_chunk is not None else None
            r = routes[c]
            # What carries frames to this root in order: its connection (None while
            # dialling: then the addresses go again), or the local route itself.
            carrier = getattr(r, "conn", r)
            if carrier is not None and sent_on[c] is carrier:
                r.send(M.Cast(M.CAST, actor, endpoint, reply, labels, sizes, sender, lo, None, tables[c], t, prev, exc), payload, actor)
            else:  # first on this connection: the addresses, which the root keeps under the table id
                r.send(M.Cast(M.CAST, actor, endpoint, reply, labels, sizes, sender, lo, sub, tables[c], t, prev, exc), payload, actor)
                sent_on[c] = carrier

    def spawn_actor(self, address: str, actor: str, rank: int, labels: tuple[str, ...], sizes: tuple[int, ...],
                    owner: ActorRef | None, reply: PortRef | None, display: str, is_async: bool,
                    payload: Sequence[Segment]) -> None:
        """Create member ``rank`` of the actor mesh ``actor`` at ``address`` (the payload
        holds class and arguments); ``reply`` hears when its ``__init__`` has run."""
        self.send(address, M.Spawn(M.SPAWN, actor, rank, labels, sizes, owner, reply, display, is_async), payload)

    def stop_actor(self, address: str, actor: str, reply: PortRef | None, index: int) -> None:
        """Stop ``actor`` at ``address`` after what it has queued; it answers ``reply`` as ``index``."""
        r = self._routes.get(address)
        if r is None:
            r = self.route(address)
        seq, prev = self.seq_out.next(address, actor) if r.dead is None else _UNNUMBERED
        r.send(M.StopActor(M.STOP_ACTOR, actor, reply, index, self.address, seq, prev), (), actor)

    def stop_proc(self, address: str, reply: PortRef | None = None) -> None:
        """Ask the process at ``address`` to exit."""
        self.send(address, M.StopProc(M.STOP_PROC, reply))

    def reply(self, port: PortRef | None, index: int, status: int, payload: Sequence[Segment]) -> None:
        """Send a reply to a port reference (no-op for None)."""
        if port is not None:
            r = self._routes.get(port[0])
            if r is None:
                r = self.route(port[0])
            # The wire form of an M.Reply, as in call_actor.
            r.send((M.REPLY, port[1], index, status, self.address), payload, port[1])

    def reply_many(self, port: PortRef, entries: tuple[tuple[int, int, int], ...], payload: Sequence[Segment]) -> None:
        """Send a subtree's replies as one message: ``entries`` are ``(index, status, nseg)``."""
        self.send(port[0], M.ReplyMulti(M.REPLY_MULTI, port[1], entries, self.address), payload)

    def report_failure(self, owner: ActorRef, mesh_name: str, rank: int, cause: Any, display: str) -> None:
        """Tell the owner of ``mesh_name`` that its member ``rank`` failed."""
        self.send(owner[0], M.Failure(M.FAILURE, owner[1], mesh_name, rank, cause, display, self.address))

    def ask_singleton(self, name: str, reply: PortRef, payload: Sequence[Segment]) -> None:
        """Ask the controller for its process-wide singleton ``name`` (get_or_spawn_controller)."""
        self.send(self.root_address, M.Singleton(M.SINGLETON, name, reply), payload)

    def ask_stats(self, address: str, reply: PortRef) -> None:
        """Ask the process at ``address`` for its telemetry snapshot."""
        self.send(address, M.Stats(M.STATS, reply))

    def announce(self, controller: str, hostname: str, pid: int) -> None:
        """A host agent tells ``controller`` it is up (JOIN)."""
        self.send(controller, M.Join(M.JOIN, self.address, hostname, pid))
