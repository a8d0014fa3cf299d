"""Messages whose payload this process could not take in (out of descriptors or memory).

The transport hands such a frame up as ``[envelope, LostPayload]``: the
envelope says who waits for an answer. That one message fails with
``ResourceExhaustedError`` naming this process and the resource; the
connection and the process serve on. Sequenced messages still pass through
the reorder buffer in their turn, so the sender's later messages are not held
behind a gap.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import PortableException, ResourceExhaustedError
from ..transport import Segment, dumps
from . import _messages as M
from ._cast import subtree_addresses

if TYPE_CHECKING:
    from ._proc import ProcRuntime

log = logging.getLogger("actormesh.runtime")

__all__ = ["Lost", "payload_lost", "error_payload", "reply_port"]

Envelope = Any  # a Message of any kind: code here branches on its .kind, which a type checker cannot narrow
_SEQUENCED = frozenset({M.CALL, M.STOP_ACTOR})


class Lost:
    """The payload of a sequenced message that could not be taken in (see payload_lost)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def error_payload(exc: BaseException) -> Sequence[Segment]:
    return dumps((PortableException(exc), "".join(traceback.format_exception_only(exc))))


def reply_port(env: Any) -> tuple[Any, int]:
    """(reply port reference or None, reply index) of an envelope."""
    kind = env.kind
    if kind == M.CALL:
        return env.reply, env.member
    if kind == M.STOP_ACTOR:
        return env.reply, env.slot
    if kind in (M.SPAWN, M.STOP_PROC, M.SINGLETON):
        return env.reply, 0
    return None, 0


def payload_lost(rt: ProcRuntime, env: Envelope, error: Any) -> None:
    """A message arrived without its payload (we ran out of descriptors or
    memory taking it in): fail that one message, in its turn. Loop thread."""
    exc = ResourceExhaustedError(f"proc {rt.name} (pid {rt.pid}) {error}", getattr(error, "resource", ""))
    lost = [Lost(exc)]
    kind = env.kind
    if kind in _SEQUENCED:
        rt._reorder.push((env.sender, env.actor), env.seq, env, lost, env.prev)  # keeps the sender's order: no gap
    elif kind == M.CAST:
        actor, reply, sender = env.actor, env.reply, env.sender
        lo, seq, exceptions = env.lo, env.seq, env.exceptions
        addrs = subtree_addresses(rt, env)  # kept if it carries a table: later casts name it
        prev = exceptions.get(lo, env.prev) if exceptions else env.prev  # the first member is ours
        rt._reorder.push((sender, actor), seq, M.Call(M.CALL, actor, env.endpoint, reply, lo, env.labels, env.sizes, sender, seq, prev), lost, prev)
        size = len(addrs) if addrs is not None else env.table[1] if env.table is not None else 1
        if reply is not None:
            for index in range(lo + 1, lo + size):
                rt.reply(reply, index, M.ERROR, error_payload(exc))
        if reply is None:
            log.warning("a broadcast to %s lost its payload: %s", actor, exc)
    elif kind == M.REPLY:
        handler = rt.ports.get(env.port)
        if handler is not None:
            handler.deliver(env._replace(status=M.ERROR), error_payload(exc))
    elif kind == M.REPLY_MULTI:
        handler = rt.ports.get(env.port)
        if handler is not None:
            for index, _status, _n in env.entries:
                handler.deliver(M.Reply(M.REPLY, env.port, index, M.ERROR, env.sender), error_payload(exc))
    else:
        rt._fail_reply(env, M.ERROR, error_payload(exc))
        log.warning("a %r message lost its payload: %s", kind, exc)
