"""Casting along a tree: each node delivers to its own members and forwards the
rest of its subtree to at most ``fanout`` children, so the sender sends
O(fanout) messages for a mesh of any size and depth grows as log_fanout(N).

Replies of a ``call`` travel back up the same tree: every node relays one
``REPLY_MULTI`` holding its whole subtree's replies to its parent. A node that
dies fails exactly the replies of its subtree (its parent waits on it as a
peer), so no caller waits forever.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from bisect import bisect_right
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..transport import Segment, dumps
from . import _messages as M

if TYPE_CHECKING:
    from ._proc import ProcRuntime

__all__ = ["split", "ranges", "width", "CastPlan", "CastTables", "subtree_addresses", "handle_cast", "RelayPort", "tree_stats"]

log = logging.getLogger("actormesh.cast")

T = TypeVar("T")

#: Table ids, unique in this process (a plan made again gets new ones).
_table_ids = itertools.count()
#: Tables a subtree root keeps per sender: well above the plans a sender keeps
#: (mesh._views: 256), so a table is dropped here only after its sender dropped its plan.
MAX_TABLES_PER_SENDER = 1024


def width(n: int, fanout: int) -> int:
    """How many subtrees ``n`` members are cut into: the fewest that keep the tree
    as shallow as ``fanout`` allows. With ``d`` the least depth such that
    ``fanout ** d >= n``, the least ``k`` with ``k ** d >= n`` (at most ``fanout``).
    So 64 members under fan-out 16 make 8 subtrees of 8, not 16 of 4: two levels
    either way, and the sender, the controller most of all, sends half the messages."""
    if n <= fanout or fanout < 2:
        return min(n, max(1, fanout))
    depth, reach = 1, fanout
    while reach < n:
        depth, reach = depth + 1, reach * fanout
    k = max(2, int(round(n ** (1.0 / depth))) - 1)
    while k**depth < n:
        k += 1
    return min(k, fanout)


def ranges(n: int, fanout: int) -> list[tuple[int, int]]:
    """Cut ``0..n-1`` into :func:`width` contiguous, near-equal ``[lo, hi)`` ranges."""
    if n <= 0:
        return []
    k = width(n, max(1, fanout))
    base, extra = divmod(n, k)
    out, pos = [], 0
    for c in range(k):
        size = base + (1 if c < extra else 0)
        out.append((pos, pos + size))
        pos += size
    return out


def split(members: Sequence[T], fanout: int) -> list[list[T]]:
    """Cut ``members`` into at most ``fanout`` contiguous, near-equal chunks."""
    return [list(members[lo:hi]) for lo, hi in ranges(len(members), fanout)]


class CastPlan:
    """How a cast to one mesh view leaves the sender: its top-level subtrees.

    Built once per view (the mesh layer caches it), so a cast costs the sender
    O(fanout): one message per subtree, each carrying its slice of ``addresses``
    as a tuple made here, and no work per member (see Verbs.cast).
    """

    __slots__ = ("addresses", "members", "chunks", "roots", "owed", "tables", "sent_on", "_los", "_index_of")

    def __init__(self, addresses: Sequence[str], fanout: int) -> None:
        addrs = tuple(addresses)
        self.addresses = addrs
        #: The view's addresses as a set: the key under which the sender numbers casts to it (_numbering).
        self.members = frozenset(addrs)
        #: ``(lo, addresses of members lo, lo + 1, ...)`` per subtree; the first address is its root.
        self.chunks = [(lo, addrs[lo:hi]) for lo, hi in ranges(len(addrs), fanout)]
        self.roots = tuple(sub[0] for _, sub in self.chunks)
        #: Per subtree, ``(table id, size)``: its root keeps the subtree's addresses under that id.
        self.tables = [(next(_table_ids), len(sub)) for _, sub in self.chunks]
        #: Per subtree, what carried its addresses to its root (a connection, whose frames
        #: arrive in order): while the route still uses it, casts name the table only.
        self.sent_on: list[object] = [None] * len(self.chunks)
        #: Per member, the address of the subtree root that owes its reply.
        self.owed = tuple(root for (_, sub), root in zip(self.chunks, self.roots) for _ in sub)
        self._los = [lo for lo, _ in self.chunks]
        self._index_of: dict[str, int] | None = None  # built the first time a cast has exceptions

    def __len__(self) -> int:
        return len(self.addresses)

    def exceptions_by_chunk(self, by_address: dict[str, int]) -> list[dict[int, int] | None]:
        """Per subtree, ``{member index: prev}`` of the members of ``by_address`` in it
        (addresses not in the view are dropped). O(len(by_address))."""
        index_of = self._index_of
        if index_of is None:
            index_of = self._index_of = {a: i for i, a in enumerate(self.addresses)}
        out: list[dict[int, int] | None] = [None] * len(self.chunks)
        for address, prev in by_address.items():
            i = index_of.get(address)
            if i is None:
                continue
            c = bisect_right(self._los, i) - 1
            d = out[c]
            if d is None:
                d = out[c] = {}
            d[i] = prev
        return out


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


class CastTables:
    """A subtree root's copy of each sender's subtree addresses, by table id, so a
    cast names its subtree in O(1) bytes (loop thread only). Bounded per sender
    (least recently used goes first); a sender's tables go when it does."""

    def __init__(self) -> None:
        self._by_sender: dict[str, OrderedDict[int, tuple[str, ...]]] = {}

    def put(self, sender: str, table: int, addrs: tuple[str, ...]) -> None:
        tables = self._by_sender.get(sender)
        if tables is None:
            tables = self._by_sender[sender] = OrderedDict()
        tables[table] = addrs
        tables.move_to_end(table)
        if len(tables) > MAX_TABLES_PER_SENDER:
            tables.popitem(last=False)

    def get(self, sender: str, table: int) -> tuple[str, ...] | None:
        tables = self._by_sender.get(sender)
        if tables is None:
            return None
        addrs = tables.get(table)
        if addrs is not None:
            tables.move_to_end(table)
        return addrs

    def forget(self, sender: str) -> None:
        self._by_sender.pop(sender, None)

    def __len__(self) -> int:
        """Senders with tables here."""
        return len(self._by_sender)


def subtree_addresses(rt: ProcRuntime, env: M.Cast) -> tuple[str, ...] | None:
    """The addresses of a cast's subtree: as sent (kept, if it names a table), or
    the table it names. None: a table this node never got (a bug, logged)."""
    addrs, table = env.addrs, env.table
    if addrs is not None:
        if table is not None:
            rt.cast_tables.put(env.sender, table[0], addrs)
        return addrs
    assert table is not None, "a cast names its subtree's addresses or a table of them"
    addrs = rt.cast_tables.get(env.sender, table[0])
    if addrs is None:
        log.error("a cast from %s to %s names subtree table %d, unknown here: its %d members fail", env.sender, env.actor, table[0], table[1])
    return addrs


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
    """Deliver this node's member of a cast and forward the rest of its subtree (loop thread).

    The subtree is the members ``env.lo, env.lo + 1, ...`` at ``env.addrs``; the
    first is ours, the others are cut into at most ``fanout`` contiguous subtrees."""
    actor, reply, sender, lo, exceptions = env.actor, env.reply, env.sender, env.lo, env.exceptions
    addrs = subtree_addresses(rt, env)
    if addrs is None:
        if reply is not None and env.table is not None:
            cause = dumps(f"cast subtree table {env.table[0]} unknown at {rt.address}")
            for index in range(lo, lo + env.table[1]):
                rt.reply(reply, index, M.SUPERVISION, cause)
        return
    here = rt.address
    children = [(lo + 1 + a, addrs[1 + a : 1 + b]) for a, b in ranges(len(addrs) - 1, rt.config.max_cast_fanout)]
    reply_here = None
    if reply is not None:
        owed_by = {lo: here}
        for clo, sub in children:
            root = sub[0]
            for i in range(clo, clo + len(sub)):
                owed_by[i] = root
        relay = RelayPort(rt, reply, range(lo, lo + len(addrs)), owed_by)
        reply_here = (here, relay.port_id)
    for clo, sub in children:
        mine = None
        if exceptions:
            chi = clo + len(sub)
            mine = {i: p for i, p in exceptions.items() if clo <= i < chi} or None
        rt.send(sub[0], env._replace(reply=reply_here, lo=clo, addrs=sub, table=None, exceptions=mine), payload)  # keeps its numbers
    if children and len(payload) > 1:
        # Forwarded buffers may still be in flight: the local actor gets its own copy.
        payload = [payload[0], *(bytearray(s) for s in payload[1:])]
    seq = env.seq
    prev = exceptions.get(lo, env.prev) if exceptions else env.prev
    call = M.Call(M.CALL, actor, env.endpoint, reply_here, lo, env.labels, env.sizes, sender, seq, prev)
    rt._reorder.push((sender, actor), seq, call, payload, prev)
