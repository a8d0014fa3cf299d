"""A TCP connection's bulk lanes (see _lanes.py): which frame goes where, and what comes back in order.

One :class:`ConnectionLanes` per TCP connection without TLS, made when the
connection has its socket. Its sending half runs on the connection's loop
thread under the connection's write lock, as frames leave the outbox; its
receiving half on the loop thread as frames arrive. The lane threads reach it
only through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ProtocolError
from ._codec import LostPayload
from ._frames import FLAG_LANE, LostFrame, Segment, seg_nbytes
from ._lanes import LaneMerger, SendLane, dial_lane, lane_message, parse_lane_message
from ._outgoing import Outgoing

__all__ = ["ConnectionLanes"]


def _nbytes(segments: Sequence[Segment]) -> int:
    if len(segments) == 2:  # the commonest frame: no generator to size it
        a, b = segments
        return (len(a) if type(a) is bytes else memoryview(a).nbytes) + (len(b) if type(b) is bytes else memoryview(b).nbytes)
    return sum(seg_nbytes(s) for s in segments)

log = logging.getLogger("actormesh.transport")

#: How long a connection the peer closed waits for the rest of the peer's lane.
DRAIN_S = 10.0


class ConnectionLanes:
    """The lanes of one connection. ``deliver(frame)`` hands a received frame to the
    layer above (in order); ``fail(exc)`` drops the connection; ``wake()`` makes the
    connection flush again (thread-safe); ``lost()`` finishes a close put off by
    :meth:`connection_lost` until the peer's lane has ended."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_host: str, peer_host: str, max_frame_bytes: int, min_bytes: int,
                 deliver: Callable[[list[Segment]], None], fail: Callable[[BaseException], None], wake: Callable[[], None]) -> None:
        self._loop = loop
        self._local, self._peer, self._max = local_host, peer_host, max_frame_bytes
        self._deliver, self._fail, self._wake = deliver, fail, wake
        self._min = min_bytes  # frames this large take the lane
        self.send_lane: SendLane | None = None
        self.control_sent = 0  # data frames sent on the connection, in send order (a lane frame's c)
        self._keys: dict[Any, int] = {}  # order key -> number of the last lane frame with it
        self._any_at = 0  # number of the last lane frame without a key
        self._barrier_at = 0  # lane frames covered by the last barrier sent
        self._merger: LaneMerger | None = None  # made when the peer first uses a lane
        self._received = 0  # data frames delivered before there was a merger
        self._recv_close: Callable[[], None] | None = None
        self._receiving = False
        self._on_lost: Callable[[], None] | None = None
        self._closed = False

    # -- sending: loop thread, under the connection's write lock ----------------------
    @property
    def idle(self) -> bool:
        """Nothing waits to be written on the lane."""
        lane = self.send_lane
        return lane is None or lane.state != "up" or lane.idle

    def route(self, segments: Sequence[Segment], flags: int, event: Any, key: Any, out: Outgoing) -> bool:
        """A frame leaves the outbox: True if it went to the lane. Otherwise the caller
        pushes it to ``out``, after any lane frame (offer, barrier) pushed here."""
        lane = self.send_lane
        if not flags and len(segments) > 1 and _nbytes(segments) >= self._min:
            if lane is None:
                self._offer(out)
            elif lane.state == "up" and not out.chunked:
                lane.submit(self.control_sent, segments, event)
                if key is None:
                    self._any_at = lane.sent
                else:
                    self._keys[key] = lane.sent
                return True
        if lane is not None and self.needs_barrier(key):
            out.push([lane_message("barrier", lane.sent)], FLAG_LANE, None, None)
            self._barrier_at = lane.sent
            self._keys.clear()
            self._any_at = 0
        self.control_sent += 1
        return False

    def wants_lane(self, segments: Sequence[Segment], flags: int) -> bool:
        """Whether this frame would take a lane that is not up yet (any thread: a hint)."""
        lane = self.send_lane
        return (lane is None or lane.state == "offering") and not flags and len(segments) > 1 and _nbytes(segments) >= self._min

    def offer_ahead(self, out: Outgoing) -> SendLane | None:
        """Offer the lane now, before the frame that wants it is queued (loop thread, write lock)."""
        if self.send_lane is None and not self._closed:
            self._offer(out)
        return self.send_lane

    def needs_barrier(self, key: Any) -> bool:
        """Whether a connection frame with ``key`` must wait for lane frames sent before it."""
        lane = self.send_lane
        if lane is None or lane.sent <= self._barrier_at:
            return False
        if key is None:
            return True
        return max(self._any_at, self._keys.get(key, 0)) > self._barrier_at

    def _offer(self, out: Outgoing) -> None:
        try:
            lane = SendLane(self._local, self._lane_broke, self._wake)
        except OSError as exc:
            log.debug("no bulk lane to %s (%s): large frames stay on the connection", self._peer, exc)
            return
        self.send_lane = lane
        out.push([lane_message("offer", lane.port, lane.token)], FLAG_LANE, None, None)

    def _lane_broke(self, exc: BaseException) -> None:  # the lane's thread
        self._threadsafe(self._fail, exc)

    # -- receiving: loop thread ---------------------------------------------------------
    def control(self, frame: list[Segment]) -> None:
        """A data frame from the connection."""
        if self._merger is None:
            self._received += 1  # the count a lane frame's c is compared with, from the start
            self._deliver(frame)
            return
        try:
            self._merger.control(frame)
        except ProtocolError as exc:
            self._broken(exc)

    def lane_frame(self, frame: list[Segment]) -> None:
        """A ``FLAG_LANE`` frame from the connection; ProtocolError if it makes no sense."""
        kind, value, token = parse_lane_message(frame)
        if kind == "barrier":
            self._merged().barrier(value)
            return
        if self._recv_close is not None:
            raise ProtocolError("a second bulk lane offered on one connection")
        self._merged()
        self._receiving = True
        self._recv_close = dial_lane(self._peer, value, token, self._max,
                                     lambda c, f: self._threadsafe(self._bulk, c, f),
                                     lambda exc: self._threadsafe(self._recv_ended, exc))

    def _merged(self) -> LaneMerger:
        if self._merger is None:
            self._merger = LaneMerger(self._deliver)
            self._merger.control_delivered = self._received
        return self._merger

    def _bulk(self, c: int, frame: list[Segment]) -> None:
        if type(frame) is LostFrame:
            log.warning("dropping the payload of a frame from %s: %s", self._peer, frame.error)
            frame = [frame[0], LostPayload(frame.error)]  # type: ignore[list-item]  # as Connection does
        if self._merger is not None and not self._closed:
            try:
                self._merger.bulk(c, frame)
            except ProtocolError as exc:
                self._broken(exc)

    def _broken(self, exc: ProtocolError) -> None:
        log.warning("closing connection from %s: %s", self._peer, exc)
        self._closed = True
        self._fail(exc)

    def _recv_ended(self, exc: BaseException | None) -> None:
        self._receiving = False
        if exc is not None and self._on_lost is None:
            self._fail(exc)
        if self._on_lost is not None:
            self._on_lost()

    # -- closing ------------------------------------------------------------------------
    def connection_lost(self, finish: Callable[[], None], clean: bool) -> bool:
        """The connection closed. Returns True if ``finish`` is put off: the peer closed
        cleanly, and frames it wrote on its lane before that may still be coming."""
        if self.send_lane is not None:
            self.send_lane.close()
        if clean and self._receiving:
            done = [False]

            def once() -> None:
                if not done[0]:
                    done[0] = True
                    self.close()
                    finish()

            self._on_lost = once
            self._loop.call_later(DRAIN_S, once)
            return True
        self.close()
        return False

    def close(self) -> None:
        self._closed = True  # a frame the lane thread handed over meanwhile is dropped
        if self._recv_close is not None:
            self._recv_close()
        if self._merger is not None:
            self._merger.clear()

    def _threadsafe(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed: the process is shutting down
