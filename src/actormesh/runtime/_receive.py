"""Receiving half of :class:`~actormesh.runtime.ProcRuntime`: frames in, messages to
their handlers. Loop thread only; every handler here is short and never blocks.

A connection's first frame must be a ``Hello`` (nothing else is read from a peer
that has not said who it is). A ``Call`` or ``StopActor`` goes through the reorder
buffer (_ordering.py) and reaches its actor in its sender's order; a call for an
actor whose ``Spawn`` came by another connection and has not arrived yet waits
for it, until ``message_delivery_timeout``. Replies go to their port's handler;
the other kinds to the process's :class:`~._handlers.Handlers`.
"""

from __future__ import annotations

import logging
import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from ..config import Config
from ..transport import Connection, LostPayload, Segment, dumps
from . import _messages as M
from ._gateway import refuse_relay
from ._handlers import Handlers
from ._lost import Lost, error_payload, payload_lost, reply_port
from ._ordering import Reorder
from ._peers import hello
from ._verbs import Verbs

if TYPE_CHECKING:
    from ._proc import ProcRuntime

log = logging.getLogger("actormesh.runtime")

__all__ = ["Receiving"]

Envelope = Any  # a Message of any kind: code here branches on its .kind, which a type checker cannot narrow
_SEQUENCED = frozenset({M.CALL, M.STOP_ACTOR})
_decode = M.decode
_from_wire = M.from_wire
_BATCHED = M.BATCHED


class Receiving(Verbs):
    """Receiving half of ProcRuntime; its state is made in ``ProcRuntime.__init__``."""

    config: Config
    loop: asyncio.AbstractEventLoop
    actors: dict[str, Any]
    ports: dict[int, Any]
    _reorder: Reorder
    _early: dict[str, list[tuple[Envelope, Sequence[Segment]]]]
    #: What the process's parts do with the kinds that are neither calls nor replies.
    handlers: Handlers

    def _whole(self) -> ProcRuntime:
        """This object as the ProcRuntime it is part of (for helpers that take one)."""
        return cast("ProcRuntime", self)

    def undeliverable(self, env: Envelope, address: str, reason: str) -> None:
        """A message could not reach ``address``: fail the reply it asked for."""
        if env[0] == M.BATCH:  # relayed by a gateway as one message: each asked for its own reply
            for t, _ in env[1]:
                self.undeliverable(t, address, reason)
            return
        port, index = reply_port(M.typed(env))
        if port is not None and port[0] != address:
            self.reply(port, index, M.SUPERVISION, dumps(reason))

    def _fail_reply(self, env: Envelope, status: int, payload: Sequence[Segment]) -> None:
        """Answer the reply port an envelope names (if any) with ``status``."""
        port, index = reply_port(env)
        if port is not None:
            self.reply(port, index, status, payload)

    def _on_frame(self, conn: Connection, segments: list[Segment]) -> None:
        try:
            env = _decode(segments[0])
        except Exception as exc:
            log.warning("closing connection from %s: bad envelope (%s)", conn.peer_name, exc)
            conn.abort()  # a protocol error: nothing more is read from this peer
            return
        if conn.tag is None:
            if env.kind != M.HELLO:
                log.warning("closing connection from %s: first frame was not HELLO", conn.peer_name)
                conn.abort()
                return
            conn.tag = env.address
            handlers = self.handlers
            if env.extra is not None and env.extra != M.RESTART:  # asks to be relayed: a gateway takes the connection over
                return (handlers.relay or refuse_relay)(conn, env)
            if handlers.hello is not None and handlers.hello(conn, env):
                return
            hello(self._whole(), conn, env)
            return
        if len(segments) == 2 and type(segments[1]) is LostPayload:
            payload_lost(self, env, segments[1].error)
            return
        self._dispatch(env, segments[1:], conn)

    def _dispatch_batch(self, batch: M.Batch, conn: Connection | None) -> None:
        """A busy peer's small calls and replies, one frame for many (_routes.Route._coalesce)."""
        items: list[tuple[Any, tuple[bytes, ...]]] = []
        try:  # all checked before any is dispatched: a bad batch delivers nothing
            for t, p in batch.items:
                env = _from_wire(t)
                if env.kind not in _BATCHED or (p is not None and type(p) is not bytes):
                    raise ValueError("a batch holds only calls and replies with at most one bytes payload")
                items.append((env, () if p is None else (p,)))
        except (ValueError, TypeError) as exc:
            log.warning("closing connection from %s: bad batch (%s)", conn.peer_name if conn else "?", exc)
            if conn is not None:
                conn.abort()
            return
        dispatch = self._dispatch
        for env, payload in items:
            dispatch(env, payload, conn)

    def _dispatch(self, env: Envelope, payload: Sequence[Segment], conn: Connection | None) -> None:
        kind = env.kind
        if kind == M.REPLY:  # the commonest kind first
            handler = self.ports.get(env.port)
            if handler is not None:
                handler.deliver(env, payload)
        elif kind in _SEQUENCED:
            self._reorder.push((env.sender, env.actor), env.seq, env, payload, env.prev)
        elif kind == M.SPAWN:
            if self.handlers.spawn is not None:
                self.handlers.spawn(env, payload)
            for early_env, early_payload in self._early.pop(env.actor, ()):
                self._release(early_env, early_payload)  # already in order: skip the reorder buffer
        elif kind == M.CAST:
            self._cast(env, payload)
        elif kind == M.REPLY_MULTI:
            handler = self.ports.get(env.port)
            if handler is not None:
                handler.deliver_many(env, payload)
        elif kind == M.STOP_PROC:
            if self.handlers.stop_proc is not None:
                self.handlers.stop_proc(env)
        elif kind == M.FAILURE:
            if self.handlers.failure is not None:
                self.handlers.failure(env)
        elif kind == M.SINGLETON:
            if self.handlers.singleton is not None:
                self.handlers.singleton(env, payload)
            else:  # answered, so that the asker fails instead of waiting for ever
                self._fail_reply(env, M.ERROR, error_payload(RuntimeError(
                    f"get_or_spawn_controller({env.name!r}): the process at {self.address} serves no singletons "
                    "(it spawned no procs through a host mesh, nor is it a host agent)")))
        elif kind == M.PING:
            if conn is not None:
                conn.send([M.PONG_BYTES])
        elif kind == M.JOIN:
            for hook in list(self.handlers.join):
                hook(env.address, env.hostname, env.pid)
        elif kind == M.STATS:
            if self.handlers.stats is not None:
                self.handlers.stats(env)
        elif kind == M.BATCH:
            self._dispatch_batch(env, conn)
        elif kind in (M.HELLO, M.PONG):
            pass
        else:
            log.warning("dropping message of unknown kind %r", kind)

    def _release(self, env: Envelope, payload: Sequence[Segment]) -> None:
        """A sequenced message whose turn has come (loop thread)."""
        if payload and type(payload[0]) is Lost:
            self._fail_reply(env, M.ERROR, error_payload(payload[0].error))
            return
        cell = self.actors.get(env.actor)
        if env.kind == M.CALL:
            if cell is not None:
                cell.post(env, payload)
            else:
                self._hold_early(env, payload)
        elif cell is not None:  # STOP_ACTOR
            cell.stop(env.reply, env.slot)
        else:
            self.reply(env.reply, env.slot, M.OK, dumps(None))

    def _cast(self, env: Envelope, payload: Sequence[Segment]) -> None:
        from ._cast import handle_cast

        handle_cast(self._whole(), env, payload)

    def _hold_early(self, env: Envelope, payload: Sequence[Segment]) -> None:
        """A call for an actor whose spawn message has not arrived yet (it came by
        another connection). Hold it until the spawn arrives or a deadline passes."""
        name = env.actor
        held = self._early.setdefault(name, [])
        held.append((env, payload))
        if len(held) == 1:

            def expire() -> None:
                for e, _ in self._early.pop(name, ()):
                    self.undeliverable(e, "", f"no actor named {name!r} on {self.address}")

            self.loop.call_later(self.config.message_delivery_timeout, expire)
