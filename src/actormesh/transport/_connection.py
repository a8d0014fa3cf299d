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
from ._frames import FLAG_SHM, FrameDecoder, LostFrame, Segment, ShmFrame, encode_frame, frame_tail, seg_nbytes
from ._memory import peer_pid_uid
from ._outgoing import CHUNK_BYTES, CHUNK_MIN_BYTES, Outgoing
from ._shm import ShmError, ShmExhausted, ShmPool

__all__ = ["Connection"]

log = logging.getLogger("actormesh.transport")

#: Gets each frame's segments; a payload this process could not take in arrives as
#: ``[envelope, LostPayload]`` (not in the type, so that handlers keep ``list[Segment]``).
FrameHandler = Callable[["Connection", list[Segment]], None]
CloseHandler = Callable[["Connection", "BaseException | None"], None]


# A connection quiet for this long takes the direct-write path (see _write_direct).
_IDLE_S = 100e-6
# Bytes handed to the transport per batch while frames wait (see _outgoing.py).
_BATCH_BYTES = CHUNK_BYTES


class Connection(asyncio.BufferedProtocol):
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
            self._on_frame(self, frame)  # read each time: a handler may rebind() mid-batch

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

    # -- sending (any thread) ----------------------------------------------------------
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
        if self.shm is not None and len(segments) > 1:
            exported = self.shm.export(segments, self)
            if exported is not None:
                # Copied into shared memory already: only small parts still reference the caller's memory.
                manifest, rest = exported
                segments, flags = [manifest, *rest], FLAG_SHM
                if wait_flushed and max(seg_nbytes(p) for p in rest) < 65536:
                    wait_flushed = False
        if self._fd >= 0 and not wait_flushed and threading.get_ident() != self._loop_thread:
            now = _monotonic()
            idle = now - self._last_tx > _IDLE_S
            self._last_tx = now
            if idle and self._write_direct(segments, flags):
                return None
        event = threading.Event() if wait_flushed else None
        self._outbox.append((segments, flags, event, order_key))
        if not self._scheduled:
            self._scheduled = True
            if threading.get_ident() == self._loop_thread:
                self._loop.call_soon(self._flush)
            else:
                try:
                    self._loop.call_soon_threadsafe(self._flush)
                except RuntimeError as exc:  # loop closed under us
                    raise TransportError("event loop is closed") from exc
        return event

    def _write_direct(self, segments: Sequence[Segment], flags: int) -> bool:
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
            frame = encode_frame(segments, flags)
            total = sum(seg_nbytes(p) for p in frame)
            if total >= CHUNK_MIN_BYTES:
                return False  # goes in chunks, from the loop
            try:
                written = os.writev(self._fd, frame)
            except (BlockingIOError, InterruptedError):
                written = 0
            except OSError:
                return False  # let the loop see the broken connection
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
        while outbox:
            segments, flags, event, key = outbox.popleft()
            out.push(segments, flags, event, key)
        transport = self._transport
        # One batch at a time, each once the socket has taken the last: what waits in
        # the transport stays small, so a frame queued now is not stuck behind megabytes.
        while out and transport.get_write_buffer_size() == 0:
            parts, waiters = out.batch(_BATCH_BYTES)
            if not self._write_parts(parts):
                self._drain_waiters.extend(waiters)
                break
            for ev in waiters:
                ev.set()
        if self._closing and not out:
            transport.close()

    def _write_parts(self, parts: list[Segment]) -> bool:
        """Hand a batch to the kernel; True if it took all of it.

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
            if written == sum(seg_nbytes(p) for p in parts):
                return True
            parts = frame_tail(parts, written)
        transport.writelines(parts)
        return transport.get_write_buffer_size() == 0

    def _release_drain_waiters(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for ev in waiters:
            ev.set()

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
            self._transport.abort()

    @property
    def drained(self) -> bool:
        """Whether every frame sent so far has reached the kernel (loop thread); True once
        closed, since nothing more will."""
        if self.closed:
            return True
        transport = self._transport
        return not self._outbox and not self._scheduled and not self._out and (
            transport is None or transport.get_write_buffer_size() == 0)

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
