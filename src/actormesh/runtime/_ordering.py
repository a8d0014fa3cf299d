"""Per-sender FIFO when messages take different paths.

A message from process S to an actor in process D may go straight (``call_one``)
or through a cast tree (``broadcast``/``call`` on large meshes), so two messages
can arrive out of order. S numbers every actor-directed message, and each names
the number of S's previous message to the same actor (``SeqOut``: a chain per
destination actor, keyed by the actor's process and name); D releases them in
chain order per (sender, actor) (``Reorder``), holding early ones. This is
Monarch's scheme (sequence numbers allocated by the originating sender before
fan-out, a reorder buffer at the destination), with chains instead of
contiguous numbers so that a cast to a whole mesh is numbered in O(1).

Why per actor, not per process: the guarantee is per sender and actor, and a
large message to one actor may be passed on the wire by a small one to another
actor of the same process (see transport._outgoing); numbered per process, the
small one would wait here for the large one all the same.

A gap that never fills (a tree node died with messages for us) is skipped after
``gap_timeout_s``, so later messages are delayed, never lost for good. A message
of a skipped gap that arrives after all is delivered late (out of order) rather
than dropped: its caller waits on its reply and the sender is alive.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

log = logging.getLogger("actormesh.ordering")

__all__ = ["SeqOut", "ReorderBuffer", "Reorder"]


class _MeshNumbers:
    """What one sender has numbered for one actor mesh (see :class:`SeqOut`)."""

    __slots__ = ("next", "last_all", "since", "members", "all_known", "gone")

    def __init__(self) -> None:
        self.next = 0  # the number the next message to any member gets
        self.last_all = -1  # the last message sent to every member (-1: none yet)
        #: Members (by address) whose last message came after ``last_all``: its number.
        self.since: dict[str, int] = {}
        #: Addresses of the members numbered so far, and which of them are gone for
        #: good: once all are, the mesh's numbers are dropped (no table grows per spawn).
        self.members: set[str] = set()
        self.all_known = False  # whether a whole cast put every member in ``members``
        self.gone: set[str] = set()


class SeqOut:
    """Message numbers for actor-directed messages, as ``(number, previous)`` pairs.

    Theory of operation: every message from this process to any member of actor
    mesh ``A`` takes the next number of one counter per ``A``. A message to member
    ``m`` also carries ``prev``, the number of the last message sent to ``m``
    (-1 for none), so ``m`` releases a chain, each message once its ``prev`` was
    released (:class:`ReorderBuffer`). Contiguous per-member numbers would make the
    sender count every member of every cast; with chains, the members that got
    the same messages share one ``prev``:

    1. ``last_all`` is the last message cast to every member of ``A``; ``since``
       holds only the members that got a message after it (by a direct call, a
       stop, or a cast to a slice), each with that message's number.
    2. A direct message to ``m`` (:meth:`next`): ``prev`` is ``since[m]``, else
       ``last_all``; then ``since[m]`` is the new number. O(1).
    3. A cast to every member (:meth:`cast_all`): one ``prev`` for all
       (``last_all``) and, as exceptions, the members in ``since``; then
       ``since`` empties. O(1) plus the exceptions, each paid for by the direct
       message that made it, once.
    4. A cast to a slice (:meth:`cast_some`) is a direct message to each member.
    5. A peer gone for good (:meth:`forget`) starts a new chain: it is put in
       ``since`` with -1 (a new process at that address has seen nothing).

    A member that must get no number (its peer is known dead) keeps its ``prev``.
    Thread-safe: any thread may send.
    """

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
            s.last_all, s.since = t, {}
            for address in skipped:
                s.since[address] = exceptions.get(address, prev)
        return t, prev, exceptions

    def cast_some(self, actor: str, addresses: Sequence[str]) -> tuple[int, int, dict[str, int]]:
        """Number a cast to some members of ``actor`` (rule 4), in the form of :meth:`cast_all`."""
        with self._lock:
            s = self._mesh(actor)
            t = s.next
            s.next = t + 1
            since, last_all = s.since, s.last_all
            exceptions = {}
            for address in addresses:
                p = since.get(address, last_all)
                if p != last_all:
                    exceptions[address] = p
                since[address] = t
            s.members.update(addresses)
        return t, last_all, exceptions

    def forget(self, address: str) -> None:
        """A destination process is gone for good: its next message starts a new chain (rule 5)."""
        with self._lock:
            for actor, s in list(self._meshes.items()):
                if address in s.members:
                    s.since[address] = -1
                    s.gone.add(address)
                    if len(s.gone) >= len(s.members):
                        del self._meshes[actor]

    def __len__(self) -> int:
        """Actor meshes numbered here."""
        return len(self._meshes)


class _Stream:
    __slots__ = ("last", "held", "skipped")

    def __init__(self) -> None:
        self.last = -1  # the number of the last message released (-1: none yet)
        #: Early messages by the number they follow (their ``prev``): ``prev -> (seq, item)``.
        self.held: dict[int, tuple[int, Any]] = {}
        # Numbers given up on, as [lo, hi) ranges, each removed once it arrives:
        # what is at most ``last`` and not in here was released already.
        self.skipped: list[list[int]] = []

    def take_skipped(self, seq: int) -> bool:
        """Whether ``seq`` is one a skipped gap gave up on (and forget it)."""
        for i, (lo, hi) in enumerate(self.skipped):
            if lo <= seq < hi:
                if hi - lo == 1:
                    del self.skipped[i]
                elif seq == lo:
                    self.skipped[i][0] += 1
                elif seq == hi - 1:
                    self.skipped[i][1] -= 1
                else:
                    self.skipped[i : i + 1] = [[lo, seq], [seq + 1, hi]]
                return True
        return False


class ReorderBuffer:
    """Sans-I/O reorder buffer: per-sender release in chain order, with gap skipping.

    Each item carries its number ``seq`` and ``prev``, the number of the sender's
    previous item to this stream (-1: none; by default ``seq - 1``, contiguous
    numbers). An item is released once its ``prev`` was (see :class:`SeqOut`).
    The caller passes ``now`` (any monotonic clock), so the rules run in virtual
    time in tests. ``push`` returns the items whose turn has come, in order.
    While a sender has items held behind a gap, :meth:`next_expiry` says when to
    call :meth:`expire`; a gap older than ``gap_timeout_s`` is then skipped.

    Example::

        >>> buf = ReorderBuffer(gap_timeout_s=1.0)
        >>> buf.push("s", 1, "b", now=0.0)
        ()
        >>> buf.next_expiry()
        1.0
        >>> buf.push("s", 0, "a", now=0.5)
        ['a', 'b']
        >>> buf.push("s", 7, "d", now=0.6, prev=3), buf.expire(now=1.6)
        ((), ['d'])
    """

    __slots__ = ("_gap_timeout_s", "_streams", "_waiting")

    def __init__(self, gap_timeout_s: float) -> None:
        self._gap_timeout_s = gap_timeout_s
        #: Keyed by stream: a sender address, or the runtime's ``(sender address, actor name)``.
        self._streams: dict[Hashable, _Stream] = {}
        #: Senders with items held behind a gap -> when that gap was first seen.
        self._waiting: dict[Hashable, float] = {}

    def take_next(self, sender: Hashable, seq: int, prev: int | None = None) -> bool:
        """Accept ``seq`` if it follows the last released item from ``sender`` and
        nothing is held for it: then the caller releases the item at once (the
        common case, which needs no clock). Otherwise accept nothing: call :meth:`push`."""
        s = self._streams.get(sender)
        if s is None:
            s = self._streams[sender] = _Stream()
        if (seq - 1 if prev is None else prev) == s.last and not s.held:
            s.last = seq
            return True
        return False

    def push(self, sender: Hashable, seq: int, item: Any, now: float, prev: int | None = None) -> Sequence[Any]:
        """Accept number ``seq`` (following ``prev``) from ``sender``; return what may be released now."""
        if prev is None:
            prev = seq - 1
        s = self._streams.get(sender)
        if s is None:
            s = self._streams[sender] = _Stream()
        if prev == s.last:
            s.last = seq
            if not s.held:
                return (item,)
            out = [item]
            self._drain(s, out)
            if not s.held:
                del self._waiting[sender]
            return out
        if seq > s.last:
            if not s.held:
                self._waiting[sender] = now
            s.held[prev] = (seq, item)
            return ()
        if s.skipped and s.take_skipped(seq):
            log.warning("message %d from %s arrived after its gap was skipped; delivering it late", seq, sender)
            return (item,)
        return ()  # a duplicate of something already released

    def next_expiry(self) -> float | None:
        """When the oldest gap times out (None: nothing is held)."""
        if not self._waiting:
            return None
        return min(self._waiting.values()) + self._gap_timeout_s

    def expire(self, now: float) -> list[Any]:
        """Skip every gap older than ``gap_timeout_s``; return what that releases."""
        out: list[Any] = []
        for sender, since in list(self._waiting.items()):
            if now < since + self._gap_timeout_s:  # the very sum next_expiry() gives
                continue
            s = self._streams[sender]
            first = min(s.held)  # the earliest missing message's number
            log.warning("messages %d..%d from %s never arrived; skipping the gap", s.last + 1, first, sender)
            s.skipped.append([s.last + 1, first + 1])
            s.last = first
            self._drain(s, out)
            if s.held:
                self._waiting[sender] = now  # the next gap gets its own full timeout
            else:
                del self._waiting[sender]
        return out

    def forget(self, sender: str) -> None:
        """Drop state for a sender that is gone (streams keyed ``sender`` or ``(sender, ...)``)."""
        for key in [k for k in self._streams if k == sender or (type(k) is tuple and k[0] == sender)]:
            self._streams.pop(key, None)
            self._waiting.pop(key, None)

    def __len__(self) -> int:
        """Senders with state here."""
        return len(self._streams)

    @staticmethod
    def _drain(s: _Stream, out: list[Any]) -> None:
        held = s.held
        while s.last in held:
            seq, item = held.pop(s.last)
            out.append(item)
            s.last = seq


class Reorder:
    """The loop-thread shell of a :class:`ReorderBuffer`: releases items through
    ``release(env, payload)`` and keeps one timer for the oldest gap."""

    def __init__(
        self,
        release: Callable[[Any, Any], None],
        schedule: Callable[[float, Callable[[], None]], Any],
        gap_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._release = release
        self._schedule = schedule
        self._clock = clock
        self._buffer = ReorderBuffer(gap_timeout_s)
        self._timer_due: float | None = None

    @property
    def _streams(self) -> dict[Hashable, _Stream]:
        return self._buffer._streams

    def push(self, sender: Hashable, seq: int, env: Any, payload: Any, prev: int | None = None) -> None:
        """Accept message number ``seq``, following ``prev``, from ``sender`` (a stream:
        the runtime's are ``(sender address, actor name)``); release what is in order."""
        buf = self._buffer
        if buf.take_next(sender, seq, prev):
            self._release(env, payload)
            return
        released = buf.push(sender, seq, (env, payload), self._clock(), prev)
        release = self._release
        for e, p in released:
            release(e, p)
        if buf._waiting and self._timer_due is None:
            self._arm()

    def _arm(self) -> None:
        due = self._buffer.next_expiry()
        self._timer_due = due
        if due is not None:
            self._schedule(max(0.0, due - self._clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer_due = None
        for e, p in self._buffer.expire(self._clock()):
            self._release(e, p)
        self._arm()

    def forget(self, sender: str) -> None:
        """Drop state for a sender that is gone."""
        self._buffer.forget(sender)
