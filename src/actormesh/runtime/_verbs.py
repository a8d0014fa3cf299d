"""The runtime's verbs: one method per message kind a process originates (see
_messages.py for their fields); the mesh layer calls these and builds no envelope.
Elsewhere only the handshake (``Hello``, _peers.py and _gateway.py), a tree node
re-addressing a ``Cast`` (_cast.py) and the stand-ins for a message whose payload
was lost (_lost.py) build messages.

Ordering lives here too: a message to an actor (``Call``, ``StopActor``, each member
of a ``Cast``) is numbered per destination actor as it leaves, so the destination
releases one sender's messages in send order whatever path they took (_ordering.py).
A peer already known dead gets no number: the message fails its reply port at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..transport import Segment
from . import _messages as M
from ._cast import split
from ._messages import ActorRef, PortRef
from ._ordering import SeqOut
from ._routes import LocalRoute, Route, order_key

__all__ = ["Verbs"]


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
        seq = self.seq_out.next(address, actor) if r.dead is None else None
        # The hottest path: the wire form of an M.Call, the plain tuple, with no NamedTuple
        # copy on the way (the receiver's decode gives it its type; see messages.typed).
        r.send((M.CALL, actor, endpoint, reply, index, labels, sizes, self.address, seq), payload, actor)

    def cast(self, actor: str, endpoint: str, reply: PortRef | None, labels: tuple[str, ...], sizes: tuple[int, ...],
             addresses: Sequence[str], payload: Sequence[Segment], fanout: int) -> list[str]:
        """Call ``endpoint`` of ``actor`` on every member, member ``i`` at ``addresses[i]``,
        along a tree of at most ``fanout`` children per node (see _cast.py). Returns,
        per member, the address of the subtree root that owes its reply."""
        owed = [""] * len(addresses)
        nxt = self.seq_out.next
        for chunk in split(range(len(addresses)), fanout):
            root = addresses[chunk[0]]
            r = self._routes.get(root)
            if r is None:
                r = self.route(root)
            # Numbered as they leave: the same sequence as direct calls. A dead root gets
            # no numbers (0): the cast fails at once, its port waits on that root.
            live = r.dead is None
            members = tuple((i, addresses[i], nxt(addresses[i], actor) if live else 0) for i in chunk)
            for i in chunk:
                owed[i] = root
            r.send(M.Cast(M.CAST, actor, endpoint, reply, labels, sizes, self.address, members), payload, actor)
        return owed

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
        seq = self.seq_out.next(address, actor) if r.dead is None else None
        r.send(M.StopActor(M.STOP_ACTOR, actor, reply, index, self.address, seq), (), actor)

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
