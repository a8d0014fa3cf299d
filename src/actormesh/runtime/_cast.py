"""Casting along a tree: each node delivers to its own members and forwards the
rest of its subtree to at most ``fanout`` children, so the sender sends
O(fanout) messages for a mesh of any size and depth grows as log_fanout(N).

Replies of a ``call`` travel back up the same tree: every node relays one
``REPLY_MULTI`` holding its whole subtree's replies to its parent. A node that
dies fails exactly the replies of its subtree (its parent waits on it as a
peer), so no caller waits forever.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..transport import Segment, dumps
from . import _messages as M

if TYPE_CHECKING:
    from ._proc import ProcRuntime

__all__ = ["split", "handle_cast", "RelayPort", "tree_stats"]

Member = tuple[int, str, int]  # (message index, address, sequence number)
T = TypeVar("T")


def split(members: Sequence[T], fanout: int) -> list[list[T]]:
    """Cut ``members`` into at most ``fanout`` contiguous, near-equal chunks."""
    n = len(members)
    if n == 0:
        return []
    k = min(fanout, n)
    base, extra = divmod(n, k)
    chunks, pos = [], 0
    for c in range(k):
        size = base + (1 if c < extra else 0)
        chunks.append(list(members[pos : pos + size]))
        pos += size
    return chunks


def tree_stats(n: int, fanout: int) -> dict[str, Any]:
    """Messages sent per node and depth of the cast tree over ``n`` members
    (a pure simulation of what :func:`handle_cast` does, one member per proc)."""
    sends: dict[int, int] = {}
    depth = 0
    stack: list[tuple[int, list[int], int]] = [(-1, list(range(n)), 0)]  # (sender, subtree, level)
    while stack:
        sender, members, level = stack.pop()
        chunks = split([(m, str(m), 0) for m in members], fanout) if sender == -1 else split([(m, str(m), 0) for m in members[1:]], fanout)
        sends[sender] = sends.get(sender, 0) + len(chunks)
        for chunk in chunks:
            root = chunk[0][0]
            depth = max(depth, level + 1)
            stack.append((root, [m for m, _, _ in chunk], level + 1))
    return {
        "members": n,
        "fanout": fanout,
        "sender_messages": sends.get(-1, 0),
        "max_messages_per_node": max(sends.values()) if sends else 0,
        "total_messages": sum(sends.values()),
        "depth": depth,
    }


class RelayPort:
    """Collects the replies of one node's subtree and sends them up as one message."""

    def __init__(self, runtime: ProcRuntime, parent: tuple[str, int], indices: Sequence[int], owed_by: dict[int, str]) -> None:
        self.runtime = runtime
        self.parent = parent
        self._missing = set(indices)
        self._owed_by = owed_by  # index -> address of the child that owes it
        self._entries: list[tuple[int, int, Sequence[Segment]]] = []
        self._lock = threading.Lock()
        self.port_id = runtime.register_port(self)
        for addr in set(owed_by.values()):
            runtime.await_peer(addr, self)

    def _add(self, index: int, status: int, payload: Sequence[Segment]) -> bool:
        if index not in self._missing:
            return False
        self._missing.discard(index)
        self._entries.append((index, status, payload))
        return not self._missing

    def deliver(self, env: M.Reply, payload: Sequence[Segment]) -> None:
        with self._lock:
            done = self._add(env.slot, env.status, payload)
        if done:
            self._finish()

    def deliver_many(self, env: M.ReplyMulti, payload: Sequence[Segment]) -> None:
        done = False
        with self._lock:
            pos = 0
            for index, status, nseg in env.entries:
                done = self._add(index, status, payload[pos : pos + nseg]) or done
                pos += nseg
        if done:
            self._finish()

    def peer_lost(self, address: str, reason: str) -> None:
        done = False
        with self._lock:
            for index, addr in self._owed_by.items():
                if addr == address:
                    done = self._add(index, M.SUPERVISION, dumps(reason)) or done
        if done:
            self._finish()

    def _finish(self) -> None:
        rt = self.runtime
        rt.unregister_port(self.port_id)
        for addr in set(self._owed_by.values()):
            rt.unawait_peer(addr, self)
        entries: list[tuple[int, int, int]] = []
        segments: list[Segment] = []
        for index, status, payload in self._entries:
            entries.append((index, status, len(payload)))
            segments.extend(payload)
        rt.reply_many(self.parent, tuple(entries), segments)


def handle_cast(rt: ProcRuntime, env: M.Cast, payload: Sequence[Segment]) -> None:
    """Deliver this node's members of a cast and forward the rest (loop thread)."""
    actor, reply, sender, members = env.actor, env.reply, env.sender, env.members
    here = rt.address
    mine = [m for m in members if m[1] == here]
    rest = [m for m in members if m[1] != here]
    chunks = split(rest, rt.config.max_cast_fanout)
    reply_here = None
    if reply is not None:
        owed_by = {m[0]: chunk[0][1] for chunk in chunks for m in chunk}
        for m in mine:
            owed_by[m[0]] = here
        relay = RelayPort(rt, reply, [m[0] for m in members], owed_by)
        reply_here = (here, relay.port_id)
    for chunk in chunks:
        rt.send(chunk[0][1], env._replace(reply=reply_here, members=tuple(chunk)), payload)  # keeps its numbers
    if mine and len(payload) > 1:
        # Forwarded buffers may still be in flight: the local actor gets its own copy.
        payload = [payload[0], *(bytearray(s) for s in payload[1:])]
    for index, _, seq in mine:
        rt._reorder.push((sender, actor), seq, M.Call(M.CALL, actor, env.endpoint, reply_here, index, env.labels, env.sizes, sender, seq), payload)
