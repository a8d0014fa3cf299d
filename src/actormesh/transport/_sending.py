"""The sending half of a :class:`~._connection.Connection` (any thread in, the loop thread out).

Frames queue in a deque and one flush per loop iteration writes them all with a
single ``writelines``: many small messages cost one syscall, and a burst from
another thread costs one wake-up of the loop, not one per message. An idle
connection writes a small frame straight from the sender's thread. Large frames
go out in chunks (_outgoing.py), or on the bulk lane (_lane_conn.py).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from collections.abc import Sequence
from time import monotonic as _monotonic
from typing import Any

from ..errors import TransportError
from ._frames import FLAG_SHM, Segment, encode_frame_sized, frame_tail, seg_nbytes
from ._lane_conn import ConnectionLanes
from . import _lanes
from ._lanes import SendLane
from ._outgoing import CHUNK_BYTES, CHUNK_MIN_BYTES, Outgoing
from ._shm import ShmPool

__all__ = ["Sending"]

# A connection quiet for this long takes the direct-write path (see _write_direct).
_IDLE_S = 100e-6
# Bytes handed to the transport per batch while frames wait (see _outgoing.py).
_BATCH_BYTES = CHUNK_BYTES


class Sending:
    """Connection's sending methods; the attributes are Connection's (set in its __init__)."""

    closed: bool
    peer_name: str
    shm: ShmPool | None
    _fd: int
    _loop: asyncio.AbstractEventLoop
    _loop_thread: int
    _last_tx: float
    _outbox: deque[tuple[Sequence[Segment], int, threading.Event | None, Any]]
    _out: Outgoing
    _scheduled: bool
    _closing: bool
    _wlock: threading.Lock
    _transport: asyncio.Transport | None
    _handshake: Any
    _lanes: ConnectionLanes | None
    _drain_waiters: list[threading.Event]

    def send(self, segments: Sequence[Segment], *, wait_flushed: bool = False,
             order_key: Any = None) -> threading.Event | None:
        """Queue one frame. Thread-safe; frames from one thread keep their order.

        With ``wait_flushed`` an Event is returned that is set once the frame's
        bytes are in the kernel (or the connection closed): until then the
        segments' memory is still referenced and must not change.

        ``order_key``: frames with equal keys, or without a key, are written in
        send order; a small frame may pass a large one in progress when both
        have keys and they differ (see _outgoing.py).
        """
        if self.closed:
            raise TransportError(f"connection to {self.peer_name} is closed")
        flags = 0
        shm = self.shm
        if shm is not None and len(segments) > 1 and not (
                # The commonest frame, an envelope and a small pickle, skips the scan.
                len(segments) == 2 and type(segments[1]) is bytes and len(segments[1]) < shm.threshold):
            exported = shm.export(segments, self)
            if exported is not None:
                # Copied into shared memory already: only small parts still reference the caller's memory.
                manifest, rest = exported
                segments, flags = [manifest, *rest], FLAG_SHM
                if wait_flushed and max(seg_nbytes(p) for p in rest) < 65536:
                    wait_flushed = False
        lanes = self._lanes
        off_loop = threading.get_ident() != self._loop_thread
        if lanes is not None and off_loop and lanes.wants_lane(segments, flags):
            self._await_lane(lanes)
        if self._fd >= 0 and not wait_flushed and off_loop:
            now = _monotonic()
            idle = now - self._last_tx > _IDLE_S
            self._last_tx = now
            if idle and self._write_direct(segments, flags, order_key):
                return None
        event = threading.Event() if wait_flushed else None
        self._outbox.append((segments, flags, event, order_key))
        if not self._scheduled:
            self._scheduled = True
            if not off_loop:
                self._loop.call_soon(self._flush)
            else:
                try:
                    self._loop.call_soon_threadsafe(self._flush)
                except RuntimeError as exc:  # loop closed under us
                    raise TransportError("event loop is closed") from exc
        return event

    def _await_lane(self, lanes: ConnectionLanes) -> None:
        """The first large frame to a peer: offer the lane and wait, at most LANE_WAIT_S,
        for it to come up, so the frame goes by it, not in chunks among small messages.
        Only the sender's thread waits; others' frames keep moving."""
        wait_s = _lanes.LANE_WAIT_S
        deadline = _monotonic() + wait_s
        lane = lanes.send_lane
        if lane is None:
            offered = threading.Event()
            made: list[SendLane | None] = []

            def offer() -> None:
                with self._wlock:
                    if not self.closed:
                        made.append(lanes.offer_ahead(self._out))
                        self._flush_locked()
                offered.set()

            try:
                self._loop.call_soon_threadsafe(offer)
            except RuntimeError:
                return  # the loop is closed: send() reports it
            if not offered.wait(wait_s) or not made:
                return
            lane = made[0]
        if lane is not None:
            lane.settled.wait(max(0.0, deadline - _monotonic()))

    def _write_direct(self, segments: Sequence[Segment], flags: int, key: Any) -> bool:
        """Write a small frame from the sender's thread, skipping the hop to the loop.

        Only on an idle connection (nothing queued, nothing buffered): one less
        thread wake-up per message is most of a round trip's latency. Busy
        connections keep the batched path, which makes one syscall per burst.
        """
        with self._wlock:
            transport = self._transport
            if self._outbox or self._scheduled or self._out or self._handshake is not None or self.closed or transport is None:
                return False
            if transport.get_write_buffer_size():
                return False
            lanes = self._lanes
            if lanes is not None and lanes.needs_barrier(key):
                return False
            frame, total = encode_frame_sized(segments, flags)
            if total >= CHUNK_MIN_BYTES:
                return False  # goes in chunks, from the loop
            try:
                written = os.writev(self._fd, frame)
            except (BlockingIOError, InterruptedError):
                written = 0
            except OSError:
                return False  # let the loop see the broken connection
            if lanes is not None:
                lanes.control_sent += 1
            if written == total:
                return True
            # The kernel took part of it: the loop writes the rest, before anything else.
            self._out.push_encoded(frame_tail(frame, written))
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:
            pass
        return True

    def _flush(self) -> None:
        with self._wlock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        self._scheduled = False
        if self._handshake is not None or self.closed or self._transport is None:
            return
        outbox, out = self._outbox, self._out
        lanes = self._lanes
        while outbox:
            segments, flags, event, key = outbox.popleft()
            if lanes is None or not lanes.route(segments, flags, event, key, out):
                out.push(segments, flags, event, key)
        transport = self._transport
        # One batch at a time, each once the socket has taken the last: what waits in
        # the transport stays small, so a frame queued now is not stuck behind megabytes.
        while out and transport.get_write_buffer_size() == 0:
            parts, waiters, nbytes = out.batch_sized(_BATCH_BYTES)
            if not self._write_parts(parts, nbytes):
                self._drain_waiters.extend(waiters)
                break
            for ev in waiters:
                ev.set()
        if self._closing and not out and (lanes is None or lanes.idle):
            transport.close()

    def _write_parts(self, parts: list[Segment], nbytes: int) -> bool:
        """Hand a batch of ``nbytes`` to the kernel; True if it took all of it.

        Written with ``os.writev`` where we have the descriptor (the transport's
        buffer is empty, so nothing is overtaken): it copies without holding the
        GIL, so other threads (callers, actors) run during a large transfer. What
        the kernel does not take goes to the transport, which keeps it without
        a copy (uvloop) and says when it is out (``resume_writing``).
        """
        transport = self._transport
        assert transport is not None
        written = 0
        if self._fd >= 0:
            try:
                written = os.writev(self._fd, parts)
            except (BlockingIOError, InterruptedError):
                written = 0
            except OSError:
                written = 0  # the transport's own write reports the broken connection
            if written == nbytes:
                return True
            parts = frame_tail(parts, written)
        transport.writelines(parts)
        return transport.get_write_buffer_size() == 0

    def _wake(self) -> None:
        """Flush again, from any thread (the lane went idle: a close may be waiting for it)."""
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:
            pass

    def _release_drain_waiters(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for ev in waiters:
            ev.set()

    @property
    def flush_scheduled(self) -> bool:
        """Whether the loop will flush this connection soon: a frame sent now waits for
        that flush (any thread; a hint, read without the lock)."""
        return self._scheduled

    @property
    def drained(self) -> bool:
        """Whether every frame sent so far has reached the kernel (loop thread); True once
        closed, since nothing more will."""
        if self.closed:
            return True
        transport = self._transport
        return not self._outbox and not self._scheduled and not self._out and (
            transport is None or transport.get_write_buffer_size() == 0) and (self._lanes is None or self._lanes.idle)
