"""Authenticated, framed, coalescing connections over Unix and TCP sockets.

A :class:`Connection` is an ``asyncio.BufferedProtocol`` that lives on one event
loop. It runs the HMAC handshake first (bounded in size and time) and only then
decodes frames and hands them to ``on_frame`` on the loop thread.

``send`` may be called from any thread. Frames queue in a deque and one flush
per loop iteration writes them all with a single ``writelines``: many small
messages cost one syscall, and a burst from another thread costs one wake-up
of the loop, not one per message.

Large frames go out in chunks, one batch at a time, each only once the socket
has taken the one before (see _outgoing.py): small frames with another order
key pass them, and memory for a send is the sender's own buffers, never a copy.
On TCP without TLS, frames of ``BULK_MIN_BYTES`` or more take a second
connection, the bulk lane, once it is up (see _lanes.py). Sending is in
_sending.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections import deque
from time import monotonic as _monotonic
from collections.abc import Callable, Sequence
from typing import Any, cast

from ..errors import AuthenticationError, ProtocolError, TransportError
from ._auth import HANDSHAKE_BYTES, Handshake
from ._codec import LostPayload
from ._frames import FrameDecoder, LaneFrame, LostFrame, Segment, ShmFrame
from ._lane_conn import ConnectionLanes
from ._memory import peer_pid_uid
from ._outgoing import Outgoing
from ._sending import Sending
from ._shm import ShmError, ShmExhausted, ShmPool

__all__ = ["Connection"]

log = logging.getLogger("actormesh.transport")

#: Gets each frame's segments; a payload this process could not take in arrives as
#: ``[envelope, LostPayload]`` (not in the type, so that handlers keep ``list[Segment]``).
FrameHandler = Callable[["Connection", list[Segment]], None]
CloseHandler = Callable[["Connection", "BaseException | None"], None]




class Connection(Sending, asyncio.BufferedProtocol):
    """One authenticated byte stream carrying frames both ways."""

    def __init__(
        self,
        secret: bytes,
        *,
        dialer: bool,
        max_frame_bytes: int,
        handshake_timeout_s: float,
        on_frame: FrameHandler,
        on_close: CloseHandler,
        loop: asyncio.AbstractEventLoop,
        shm: ShmPool | None = None,
        tune: Callable[[socket.socket], None] | None = None,
        lanes: int = 0,
    ) -> None:
        self._handshake: Handshake | None = Handshake(secret, dialer=dialer)
        self._hs_buf = bytearray(HANDSHAKE_BYTES)
        self._hs_view = memoryview(self._hs_buf)
        self._hs_filled = 0
        self._hs_timeout_s = handshake_timeout_s
        self._hs_timer: asyncio.TimerHandle | None = None
        self._decoder = FrameDecoder(max_frame_bytes)
        self._on_frame = on_frame
        self._on_close = on_close
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._transport: asyncio.Transport | None = None
        # (segments, flags, event, order key) from any thread, until the loop takes them into _out
        self._outbox: deque[tuple[Sequence[Segment], int, threading.Event | None, Any]] = deque()
        self._out = Outgoing()
        self._closing = False  # close once _out is written
        self._scheduled = False
        self._drain_waiters: list[threading.Event] = []
        self._wlock = threading.Lock()
        self._fd = -1  # set for plain sockets: direct writes from other threads
        self._last_tx = 0.0
        self.ready: asyncio.Future[None] = loop.create_future()
        self.closed = False
        #: When bytes last arrived (time.monotonic()): liveness for heartbeats.
        self.last_rx = _monotonic()
        self.peer_name = "?"
        #: Free for the layer above (e.g. the peer's proc address).
        self.tag: Any = None
        self._shm_pool = shm
        self._tune = tune  # socket options for TCP, applied as soon as there is a socket
        #: Where large outgoing segments go instead of the socket (same-host peers only).
        self.shm: ShmPool | None = None
        self._peer_pid = 0
        self._max_frame = max_frame_bytes
        #: Frames of ``lanes`` bytes or more on a second TCP connection (see _lanes.py; 0: none): set up in connection_made.
        self._lanes: ConnectionLanes | None = None
        self._want_lanes = lanes
        self._aborted = False

    def __repr__(self) -> str:
        return f"<Connection peer={self.peer_name} ready={self.ready.done()} closed={self.closed}>"

    # -- asyncio protocol callbacks (loop thread) ------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Only stream servers and connections (_sockets: create_server, create_connection) make
        # this protocol, and they hand it a read-write Transport.
        self._transport = transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer_name = str(peer) if peer else "unix-peer"
        # Resume is our signal that big buffers handed to the kernel are free.
        transport.set_write_buffer_limits(high=0)
        sock = transport.get_extra_info("socket")
        if sock is not None and self._tune is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                self._tune(sock)
            except OSError:
                pass  # a peer that already closed: the handshake wait reports it
        if sock is not None and transport.get_extra_info("sslcontext") is None and transport.get_extra_info("ssl_object") is None:
            self._fd = sock.fileno()
            if self._want_lanes and sock.family in (socket.AF_INET, socket.AF_INET6):
                self._lanes = ConnectionLanes(self._loop, sock.getsockname()[0], str(peer[0]), self._max_frame, self._want_lanes,
                                              self._deliver, self._abort, self._wake)
        if sock is not None and sock.family == socket.AF_UNIX:
            try:
                self._peer_pid, uid = peer_pid_uid(sock)
            except OSError:
                self._peer_pid, uid = 0, -1
            pool = self._shm_pool
            # The peer opens our segments through /proc: it needs our uid and a visible pid.
            if pool is not None and pool.usable and pool.threshold and self._peer_pid > 0 and uid == os.getuid():
                self.shm = pool
        assert self._handshake is not None
        transport.write(self._handshake.start())
        self._hs_timer = self._loop.call_later(self._hs_timeout_s, self._handshake_timed_out)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._handshake is not None:
            # Read exactly the handshake's bytes: nothing after it is touched until it succeeds.
            return self._hs_view[self._hs_filled :]
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.last_rx = _monotonic()
        try:
            if self._handshake is not None:
                self._advance_handshake(nbytes)
                return
            frames = self._decoder.buffer_updated(nbytes)
        except (ProtocolError, AuthenticationError) as exc:
            log.warning("closing connection from %s: %s", self.peer_name, exc)
            self._fail_ready(exc)  # a dialer learns the cause, not a bare "closed"
            reply = getattr(exc, "reply", b"")
            if reply and self._transport is not None and not self.closed:
                self._transport.write(reply)
                self._transport.close()  # flushes the proof, then closes
                return
            self._abort(exc)
            return
        for frame in frames:
            if type(frame) is LostFrame:
                log.warning("dropping the payload of a frame from %s: %s", self.peer_name, frame.error)
                # stands in for the payload segment; FrameHandler's contract says handlers check for it
                frame = [frame[0], LostPayload(frame.error)]  # type: ignore[list-item]
            elif type(frame) is ShmFrame:
                try:
                    frame = ShmPool.import_frame(frame[0], frame[1:], self._peer_pid)
                except ShmExhausted as exc:
                    log.warning("dropping the payload of a frame from %s: %s", self.peer_name, exc)
                    frame = [frame[1], LostPayload(exc)]  # type: ignore[list-item]  # as above
                except ShmError as exc:
                    log.warning("closing connection from %s: %s", self.peer_name, exc)
                    self._abort(exc)
                    return
            elif type(frame) is LaneFrame:
                if not self._lane_frame(frame):
                    return
                continue
            if self._lanes is None:
                self._on_frame(self, frame)  # read each time: a handler may rebind() mid-batch
            else:
                self._lanes.control(frame)

    def _deliver(self, frame: list[Segment]) -> None:
        self._on_frame(self, frame)

    def _lane_frame(self, frame: list[Segment]) -> bool:
        try:
            if self._lanes is None:
                raise ProtocolError("a lane frame on a connection without lanes")
            self._lanes.lane_frame(frame)
            return True
        except ProtocolError as exc:
            log.warning("closing connection from %s: %s", self.peer_name, exc)
            self._abort(exc)
            return False

    def _advance_handshake(self, nbytes: int) -> None:
        hs = self._handshake
        assert hs is not None and self._transport is not None
        start = self._hs_filled
        self._hs_filled += nbytes
        reply = hs.receive(bytes(self._hs_view[start : self._hs_filled]))
        if reply:
            self._transport.write(reply)
        if hs.done:
            self._handshake = None
            if self._hs_timer is not None:
                self._hs_timer.cancel()
            if not self.ready.done():
                self.ready.set_result(None)
            self._flush()

    def _handshake_timed_out(self) -> None:
        if self._handshake is not None and not self.closed:
            log.warning("closing connection from %s: handshake not completed in %.1fs", self.peer_name, self._hs_timeout_s)
            self._abort(AuthenticationError("handshake timed out"))

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        self._release_drain_waiters()
        if self._out and not self._scheduled:
            # Not a flush from here: a transport may call this from inside our own write.
            self._scheduled = True
            self._loop.call_soon(self._flush)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        if self._lanes is not None and self._lanes.connection_lost(lambda: self._lost(exc), clean=exc is None and not self._aborted):
            return  # what the peer wrote on its lane before it closed may still come
        self._lost(exc)

    def _lost(self, exc: BaseException | None) -> None:
        if self._hs_timer is not None:
            self._hs_timer.cancel()
        if not self.ready.done():
            self.ready.set_exception(TransportError(f"connection to {self.peer_name} closed during handshake"))
            self.ready.exception()  # mark retrieved: a dial that gave up must not log noise
        self._release_drain_waiters()
        self._decoder.close()  # a frame cut off with the connection frees its memory now
        with self._wlock:
            for _, _, ev, _ in self._outbox:
                if ev is not None:
                    ev.set()
            self._outbox.clear()
            for ev in self._out.clear():
                ev.set()
        if self.shm is not None:
            self.shm.forget(self)
        self._on_close(self, exc)

    def rebind(self, *, on_frame: FrameHandler, on_close: CloseHandler) -> None:
        """Hand this connection's later frames and its close to new handlers (loop thread).

        For a layer that learns from a first frame who owns the connection (a
        gateway taking over a relayed leg): frames already handed over stay handled.
        """
        self._on_frame = on_frame
        self._on_close = on_close

    def close(self) -> None:
        """Close after queued frames are written (thread-safe)."""
        if threading.get_ident() == self._loop_thread:
            self._close_now()
        else:
            try:
                self._loop.call_soon_threadsafe(self._close_now)
            except RuntimeError:
                pass

    def _close_now(self) -> None:
        if self._transport is not None and not self.closed:
            self._closing = True  # the transport closes once every queued frame is written
            self._flush()
            if self._handshake is not None and not self.closed:
                self._transport.close()  # nothing of ours can be written before the handshake

    def _abort(self, exc: BaseException) -> None:
        if self._transport is not None and not self.closed:
            self._aborted = True  # dropped here: nothing more is waited for, lanes included
            self._transport.abort()

    def abort(self) -> None:
        """Drop the connection now, queued frames and all (thread-safe): for a peer given up on."""
        if threading.get_ident() == self._loop_thread:
            self._abort(TransportError("aborted"))
        else:
            try:
                self._loop.call_soon_threadsafe(self._abort, TransportError("aborted"))
            except RuntimeError:
                pass

    def _fail_ready(self, exc: BaseException) -> None:
        """A dial waiting on the handshake learns the real cause (not "closed")."""
        if not self.ready.done():
            self.ready.set_exception(exc)
            self.ready.exception()  # retrieved: the dialer may have given up already
