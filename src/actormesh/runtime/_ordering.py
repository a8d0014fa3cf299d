"""Per-sender FIFO when messages take different paths.

A message from process S to an actor in process D may go straight (``call_one``)
or through a cast tree (``broadcast``/``call`` on large meshes), so two messages
can arrive out of order. S numbers every actor-directed message per destination
process (``SeqOut``); D releases them in number order (``Reorder``), holding
early ones. This is Monarch's scheme (sequence numbers allocated by the
originating sender before fan-out, a reorder buffer at the destination).

A gap that never fills (a tree node died with messages for us) is skipped after
``gap_timeout_s``, so later messages are delayed, never lost for good. A message
of a skipped gap that arrives after all is delivered late (out of order) rather
than dropped: its caller waits on its reply and the sender is alive.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("actormesh.ordering")

__all__ = ["SeqOut", "Reorder"]


class SeqOut:
    """Sequence numbers per destination address (thread-safe)."""

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count[int]] = {}
        self._lock = threading.Lock()

    def next(self, address: str) -> int:
        """The next number for a message to ``address``."""
        c = self._counters.get(address)
        if c is None:
            with self._lock:
                c = self._counters.setdefault(address, itertools.count())
        return next(c)  # atomic in CPython

    def forget(self, address: str) -> None:
        """Drop the counter of a destination that is gone for good."""
        with self._lock:
            self._counters.pop(address, None)


class _Stream:
    __slots__ = ("expected", "held", "since", "skipped")

    def __init__(self) -> None:
        self.expected = 0
        self.held: dict[int, tuple[Any, Any]] = {}
        self.since = 0.0
        # Numbers given up on, as [lo, hi) ranges, each removed once it arrives:
        # what is below ``expected`` and not in here was released already.
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


class Reorder:
    """Releases each sender's messages in sequence order. Loop thread only."""

    def __init__(
        self,
        release: Callable[[Any, Any], None],
        schedule: Callable[[float, Callable[[], None]], Any],
        gap_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._release = release
        self._schedule = schedule
        self._gap_timeout_s = gap_timeout_s
        self._clock = clock
        self._streams: dict[str, _Stream] = {}

    def push(self, sender: str, seq: int, env: Any, payload: Any) -> None:
        """Accept message number ``seq`` from ``sender``; release what is in order."""
        s = self._streams.get(sender)
        if s is None:
            s = self._streams[sender] = _Stream()
        if seq == s.expected:
            s.expected += 1
            self._release(env, payload)
            if s.held:
                self._drain(s)
        elif seq > s.expected:
            if not s.held:
                s.since = self._clock()
                self._schedule(self._gap_timeout_s, lambda: self._check_gap(sender))
            s.held[seq] = (env, payload)
        elif s.skipped and s.take_skipped(seq):
            log.warning("message %d from %s arrived after its gap was skipped; delivering it late", seq, sender)
            self._release(env, payload)
        # else: a duplicate of something already released; drop it.

    def _drain(self, s: _Stream) -> None:
        held = s.held
        while s.expected in held:
            env, payload = held.pop(s.expected)
            s.expected += 1
            self._release(env, payload)

    def _check_gap(self, sender: str) -> None:
        s = self._streams.get(sender)
        if s is None or not s.held:
            return
        if self._clock() - s.since < self._gap_timeout_s * 0.9:
            self._schedule(self._gap_timeout_s, lambda: self._check_gap(sender))
            return
        first = min(s.held)
        log.warning("messages %d..%d from %s never arrived; skipping the gap", s.expected, first - 1, sender)
        s.skipped.append([s.expected, first])
        s.expected = first
        self._drain(s)
        if s.held:
            s.since = self._clock()
            self._schedule(self._gap_timeout_s, lambda: self._check_gap(sender))

    def forget(self, sender: str) -> None:
        """Drop state for a sender that is gone."""
        self._streams.pop(sender, None)
