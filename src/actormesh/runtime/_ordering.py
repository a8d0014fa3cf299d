"""Per-sender FIFO when messages take different paths.

A message from process S to an actor in process D may go straight (``call_one``)
or through a cast tree (``broadcast``/``call`` on large meshes), so two messages
can arrive out of order. S numbers every actor-directed message per destination
process (``SeqOut``); D releases them in number order (``Reorder``), holding
early ones. This is Monarch's scheme (sequence numbers allocated by the
originating sender before fan-out, a reorder buffer at the destination).

A gap that never fills (a tree node died with messages for us) is skipped after
``gap_timeout_s``, so later messages are delayed, never lost for good.
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
    __slots__ = ("expected", "held", "since")

    def __init__(self) -> None:
        self.expected = 0
        self.held: dict[int, tuple[Any, Any]] = {}
        self.since = 0.0


class Reorder:
    """Releases each sender's messages in sequence order. Loop thread only."""

    def __init__(self, release: Callable[[Any, Any], None], schedule: Callable[[float, Callable[[], None]], Any], gap_timeout_s: float) -> None:
        self._release = release
        self._schedule = schedule
        self._gap_timeout_s = gap_timeout_s
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
                s.since = time.monotonic()
                self._schedule(self._gap_timeout_s, lambda: self._check_gap(sender))
            s.held[seq] = (env, payload)
        # seq < expected: a duplicate of something already released; drop it.

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
        if time.monotonic() - s.since < self._gap_timeout_s * 0.9:
            self._schedule(self._gap_timeout_s, lambda: self._check_gap(sender))
            return
        first = min(s.held)
        log.warning("messages %d..%d from %s never arrived; skipping the gap", s.expected, first - 1, sender)
        s.expected = first
        self._drain(s)
        if s.held:
            s.since = time.monotonic()
            self._schedule(self._gap_timeout_s, lambda: self._check_gap(sender))

    def forget(self, sender: str) -> None:
        """Drop state for a sender that is gone."""
        self._streams.pop(sender, None)
