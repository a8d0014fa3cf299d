"""The sending half of per-sender FIFO: chained message numbers (see ``_ordering``).

Every message from this process to any member of actor mesh ``A`` takes the
next number of one counter per ``A``. A message to member ``m`` also carries
``prev``, the number of the last message sent to ``m`` (-1 for none), so ``m``
releases a chain, each message once its ``prev`` was released
(``_ordering.ReorderBuffer``). Contiguous per-member numbers would make the
sender count every member of every cast; with chains, members that got the same
messages share one ``prev``, and a cast names one number plus the exceptions.

Rules (``prev(m)`` is the newest of what applies to ``m``):

1. ``last_all`` is the last message cast to every member of ``A``; ``since``
   holds the members that got a message after it by a direct call or stop,
   each with that message's number.
2. A direct message to ``m`` (:meth:`SeqOut.next`): ``prev`` is ``prev(m)``;
   then ``since[m]`` is the new number. O(1), plus one set lookup per *view*
   (rule 4) held.
3. A cast to every member (:meth:`SeqOut.cast_all`): one ``prev`` for all
   (``last_all``) and, as exceptions, the members whose ``prev`` differs; then
   ``since`` and the views empty. O(1) plus the exceptions, each paid for by
   the message that made it.
4. A cast to a slice (:meth:`SeqOut.cast_some`) given its member set, the
   *view*: the first cast to a view numbers each member and keeps the view
   with the cast's number; while it is kept, its members' ``prev`` is at least
   that number, and a later cast to the same view names it as the one ``prev``,
   with as exceptions only the members that got something else since (a direct
   call, or a cast to an overlapping view: each paid for by that message). So
   casting to the same slices, pipeline stages or hosts, costs O(1) each. At
   most ``MAX_VIEWS`` views are kept per mesh (the oldest is written out into
   ``since``); a whole cast drops them all.
5. A peer gone for good (:meth:`SeqOut.forget`) starts a new chain: the views
   that hold it are written out, then it is put in ``since`` with -1 (a new
   process at that address has seen nothing).

Special ``since`` values (-1 above, and a member that must get no number
because its peer is known dead keeps its old ``prev``) are only ever set with
no view holding that member, so ``prev(m) = max(since.get(m, last_all), the
numbers of the views holding m)`` is always right. Thread-safe: any thread may
send.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

__all__ = ["MAX_VIEWS", "SeqOut"]

#: Slice views kept per actor mesh (rule 4): a direct call checks each.
MAX_VIEWS = 8


class _View:
    """A slice cast to, while kept (rule 4)."""

    __slots__ = ("members", "t", "dirty", "overlaps")

    def __init__(self, members: frozenset[str], t: int) -> None:
        self.members = members
        self.t = t  # the number of the last cast to it
        #: Members that got something else after ``t``: the next cast's exceptions.
        self.dirty: set[str] = set()
        #: Shared members with each other view, by that view's member set (computed once per pair).
        self.overlaps: dict[frozenset[str], frozenset[str]] = {}

    def overlap(self, other: frozenset[str]) -> frozenset[str]:
        ov = self.overlaps.get(other)
        if ov is None:
            small, big = (self.members, other) if len(self.members) <= len(other) else (other, self.members)
            ov = self.overlaps[other] = frozenset(a for a in small if a in big)
        return ov


class _MeshNumbers:
    """What one sender has numbered for one actor mesh."""

    __slots__ = ("next", "last_all", "since", "members", "all_known", "gone", "views")

    def __init__(self) -> None:
        self.next = 0  # the number the next message to any member gets
        self.last_all = -1  # the last message sent to every member (-1: none yet)
        self.since: dict[str, int] = {}  # rule 1
        #: Addresses of the members numbered so far, and which of them are gone for
        #: good: once all are, the mesh's numbers are dropped (no table grows per spawn).
        self.members: set[str] = set()
        self.all_known = False  # whether a whole cast put every member in ``members``
        self.gone: set[str] = set()
        self.views: dict[frozenset[str], _View] = {}  # rule 4, oldest first

    def prev_of(self, address: str) -> int:
        p = self.since.get(address, self.last_all)
        for v in self.views.values():
            if v.t > p and address in v.members:
                p = v.t
        return p

    def write_out(self, view: _View) -> None:
        """Stop keeping ``view``: its members' numbers go into ``since``. O(members)."""
        since, last_all, t = self.since, self.last_all, view.t
        for a in view.members:
            if since.get(a, last_all) < t:
                since[a] = t
        del self.views[view.members]


class SeqOut:
    """Message numbers for actor-directed messages, as ``(number, previous)`` pairs (module docstring)."""

    def __init__(self) -> None:
        self._meshes: dict[str, _MeshNumbers] = {}
        self._lock = threading.Lock()

    def _mesh(self, actor: str) -> _MeshNumbers:
        s = self._meshes.get(actor)
        if s is None:
            s = self._meshes[actor] = _MeshNumbers()
        return s

    def next(self, address: str, actor: str) -> tuple[int, int]:
        """``(number, prev)`` for one message to ``actor`` at ``address`` (rule 2)."""
        # Number and chain move together (two threads, one member). acquire/release,
        # not ``with``: half the cost, on every call's path.
        lock = self._lock
        lock.acquire()
        try:
            s = self._meshes.get(actor)
            if s is None:
                s = self._meshes[actor] = _MeshNumbers()
            t = s.next
            s.next = t + 1
            since = s.since
            prev = since.get(address)
            if prev is None:  # its first message since the last whole cast
                prev = s.last_all
                s.members.add(address)
            elif prev < 0 and s.gone:
                s.gone.discard(address)  # forgotten, and back (a revived peer): a member again
            if s.views:
                for v in s.views.values():
                    if address in v.members:
                        if v.t > prev:
                            prev = v.t
                        v.dirty.add(address)
            since[address] = t
        finally:
            lock.release()
        return t, prev

    def cast_all(self, actor: str, members: Sequence[str], skipped: Sequence[str] = ()) -> tuple[int, int, dict[str, int]]:
        """Number a cast to every member of ``actor`` (rule 3): ``(number, prev, exceptions)``,
        ``exceptions`` mapping the address of each member whose ``prev`` differs.
        ``members``: their addresses (noted by the first whole cast only, not per cast).
        ``skipped``: members that will not get it (behind a dead peer): they keep their chain."""
        with self._lock:
            s = self._mesh(actor)
            if not s.all_known:  # any whole cast names every member: once is enough
                s.members.update(members)
                s.all_known = True
            t = s.next
            s.next = t + 1
            prev, exceptions = s.last_all, s.since
            for v in s.views.values():  # each member here was paid for by the slice cast that put it here
                for a in v.members:
                    p = s.prev_of(a)
                    if p != prev:
                        exceptions[a] = p
            s.views.clear()
            s.last_all, s.since = t, {}
            for address in skipped:
                s.since[address] = exceptions.get(address, prev)
            if s.gone:  # those sent this one are back (revived peers): members again
                s.gone = {a for a in s.gone if a in skipped}
        return t, prev, exceptions

    def cast_some(self, actor: str, addresses: Sequence[str],
                  view: frozenset[str] | None = None) -> tuple[int, int, dict[str, int]]:
        """Number a cast to some members of ``actor``, in the form of :meth:`cast_all`.

        ``view``: the set of ``addresses``, the same object for every cast to this
        slice (rule 4: O(1) from its second cast on); None numbers each member."""
        with self._lock:
            s = self._mesh(actor)
            t = s.next
            s.next = t + 1
            kept = s.views.get(view) if view is not None else None
            if kept is not None:
                prev = kept.t
                exceptions = {a: p for a in kept.dirty if (p := s.prev_of(a)) != prev}
                kept.dirty = set()
                del s.views[kept.members]  # re-added below: the newest last
            else:
                prev = s.last_all
                exceptions = {a: p for a in addresses if (p := s.prev_of(a)) != prev}
                s.members.update(addresses)
            if s.gone:  # as in cast_all
                s.gone = {a for a in s.gone if a not in (view or addresses)}
            if view is None:
                for a in addresses:
                    s.since[a] = t
                    for v in s.views.values():
                        if a in v.members:
                            v.dirty.add(a)
                return t, prev, exceptions
            self._keep(s, view, kept, t)
        return t, prev, exceptions

    @staticmethod
    def _keep(s: _MeshNumbers, members: frozenset[str], kept: _View | None, t: int) -> None:
        """Keep the view ``members`` as last cast at ``t``; the views it overlaps note its members."""
        for v in s.views.values():
            ov = v.overlap(members)
            if ov:
                v.dirty.update(ov)
        if kept is None:
            if len(s.views) >= MAX_VIEWS:
                s.write_out(next(iter(s.views.values())))
            kept = _View(members, t)
        kept.t = t
        s.views[members] = kept

    def forget(self, address: str) -> None:
        """A destination process is gone for good: its next message starts a new chain (rule 5)."""
        with self._lock:
            for actor, s in list(self._meshes.items()):
                if address in s.members:
                    for v in [v for v in s.views.values() if address in v.members]:
                        s.write_out(v)
                    s.since[address] = -1
                    s.gone.add(address)
                    if len(s.gone) >= len(s.members):
                        del self._meshes[actor]

    def __len__(self) -> int:
        """Actor meshes numbered here."""
        return len(self._meshes)
