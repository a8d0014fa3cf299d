"""Per-sender FIFO when messages take different paths.

A message from process S to an actor in process D may go straight (``call_one``)
or through a cast tree (``broadcast``/``call`` on large meshes), so two messages
can arrive out of order. S numbers every actor-directed message, and each names
the number of S's previous message to the same actor (``SeqOut``, in
``_numbering``: a chain per destination actor, keyed by the actor's process and
name); D releases them in
chain order per (sender, actor) (``Reorder``), holding early ones. This is
Monarch's scheme (sequence numbers allocated by the originating sender before
fan-out, a reorder buffer at the destination), with chains instead of
contiguous numbers so that a cast to a whole mesh, or again to the same
slice, is numbered in O(1).

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

from ._numbering import SeqOut

log = logging.getLogger("actormesh.ordering")

__all__ = ["SeqOut", "ReorderBuffer", "Reorder"]


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
