"""The bulk lane: large frames on a second TCP connection, moved by threads of low priority.

Why: on one connection a small message waits behind every byte of a large
transfer queued ahead of it (socket buffers, the receive window, the rest of a
batch), and the event loop that would handle it is busy moving that transfer.
Measured between two network namespaces on the 2-core reference box: a noop's
p99 during a 1 GiB transfer was about 10x its idle p99, while a ping over its
own socket beside a bulk stream of another thread kept its idle p99 within 2.5x
once that thread ran at nice 10 (bench/_socket_noop.py, RESULTS.md).

Theory of operation
-------------------
A lane carries one direction. The side with a large frame to send *offers* a
lane: it listens on an ephemeral port of the connection's own local address
and sends ``offer(port, token)`` over the connection (a ``FLAG_LANE`` frame,
which the connection handles itself). The peer dials that port from a thread
and proves itself with the token (random, and it travelled inside the
authenticated connection). Until the lane is up, and for good if it cannot be
made (a firewall, a port forward), large frames go on the connection as before.

Order. Frames leave the connection's outbox in one order, the *send order*; a
frame of at least ``BULK_MIN_BYTES`` goes to the lane, any other to the
connection. So that the receiver releases them in send order where it matters:

- a lane frame carries ``c``, the number of connection frames sent before it:
  the receiver holds it until it has delivered that many;
- a connection frame whose order key matches a lane frame not yet covered (or
  that has no key, and so is ordered against everything) is preceded by
  ``barrier(b)``, ``b`` the number of lane frames sent so far: the receiver
  holds the connection's frames from there until it has delivered ``b`` lane
  frames.

Each side holds only frames that come later in send order than what they wait
for, so nothing waits in a cycle. :class:`LaneMerger` is that receiving rule,
pure; the threads only move bytes.

Memory: the sender writes from the caller's buffers; the receiver allocates
each segment once, at its final size (the frame decoder does). A lane that
breaks fails its connection (the layer above sees the peer lost), and closing
the connection shuts the lane's socket, which ends its thread.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ProtocolError, TransportError
from ._frames import FrameDecoder, Segment, encode_frame, frame_tail, seg_nbytes

__all__ = ["BULK_MIN_BYTES", "LaneMerger", "SendLane", "dial_lane", "lane_message", "parse_lane_message"]

log = logging.getLogger("actormesh.transport")

#: Frames with at least this many bytes go on the bulk lane once it is up; 0 = no lanes.
BULK_MIN_BYTES = 1 << 20
#: How much lower the lane threads run than the rest of the process (nice).
LANE_NICE = 10
#: Seconds for the peer to dial an offered lane (else large frames stay on the connection).
OFFER_TIMEOUT_S = 5.0
#: Seconds the first large frame to a peer waits (its sender's thread) for the lane it offers,
#: up in a few round trips on a LAN, rather than go in chunks that small messages queue among.
LANE_WAIT_S = 0.5
_TOKEN_BYTES = 32
_ACK = b"L"
_OFFER = struct.Struct("<cH32s")
_BARRIER = struct.Struct("<cQ")
_COUNT = struct.Struct("<Q")


def lane_message(kind: str, value: int, token: bytes = b"") -> bytes:
    """The one segment of a ``FLAG_LANE`` frame: ``offer`` (value: port) or ``barrier`` (value: b)."""
    return _OFFER.pack(b"O", value, token) if kind == "offer" else _BARRIER.pack(b"B", value)


def parse_lane_message(frame: Sequence[Segment]) -> tuple[str, int, bytes]:
    """``(kind, value, token)`` of a ``FLAG_LANE`` frame; ProtocolError if malformed."""
    body = bytes(frame[0]) if len(frame) == 1 else b""
    if len(body) == _OFFER.size and body[:1] == b"O":
        _, port, token = _OFFER.unpack(body)
        return "offer", port, token
    if len(body) == _BARRIER.size and body[:1] == b"B":
        return "barrier", _BARRIER.unpack(body)[1], b""
    raise ProtocolError("malformed lane frame")


def _lower_priority() -> None:
    # Raising one's own niceness needs no privilege; a thread's id is a pid for setpriority (Linux).
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LANE_NICE)
    except (OSError, AttributeError):
        pass


class LaneMerger:
    """The receiving rule (see the module docstring): frames in, frames out in send order where it matters.

    Pure, single-threaded (the connection's loop thread): ``deliver(frame)`` is
    called for each frame released.

    >>> out = []
    >>> m = LaneMerger(out.append)
    >>> m.bulk(1, "big")        # sent after one connection frame: held
    >>> m.control("small")      # that frame: delivered, then the big one
    >>> m.barrier(1); m.control("after")
    >>> out
    ['small', 'big', 'after']
    """

    def __init__(self, deliver: Callable[[Any], None], max_held: int = 1 << 20, max_bulk: int = 1024) -> None:
        self._deliver = deliver
        # What a peer may make this side hold (a barrier never met, a lane frame after
        # frames never sent): beyond it the peer is broken or hostile (ProtocolError).
        self._max_held, self._max_bulk = max_held, max_bulk
        self.control_delivered = 0
        self.bulk_delivered = 0
        self._held: deque[tuple[bool, Any]] = deque()  # (is_barrier, frame or b), connection order
        self._bulk: deque[tuple[int, Any]] = deque()  # (c, frame), lane order

    @property
    def holding(self) -> int:
        """Frames held back (connection and lane)."""
        return sum(1 for barrier, _ in self._held if not barrier) + len(self._bulk)

    def control(self, frame: Any) -> None:
        if self._held:
            self._hold((False, frame))
            return
        self.control_delivered += 1
        self._deliver(frame)
        if self._bulk:
            self._pump()

    def barrier(self, b: int) -> None:
        if self._held or self.bulk_delivered < b:
            self._hold((True, b))

    def bulk(self, c: int, frame: Any) -> None:
        if len(self._bulk) >= self._max_bulk:
            raise ProtocolError(f"{len(self._bulk)} lane frames wait for connection frames that never came")
        self._bulk.append((c, frame))
        self._pump()

    def _hold(self, item: tuple[bool, Any]) -> None:
        if len(self._held) >= self._max_held:
            raise ProtocolError(f"{len(self._held)} frames held behind a barrier that the lane never met")
        self._held.append(item)

    def _pump(self) -> None:
        moved = True
        while moved:
            moved = False
            while self._bulk and self._bulk[0][0] <= self.control_delivered:
                frame = self._bulk.popleft()[1]
                self.bulk_delivered += 1
                self._deliver(frame)
                moved = True
            while self._held:
                barrier, item = self._held[0]
                if barrier:
                    if self.bulk_delivered < item:
                        break
                else:
                    self.control_delivered += 1
                    self._deliver(item)
                self._held.popleft()
                moved = True

    def clear(self) -> None:
        self._held.clear()
        self._bulk.clear()


class SendLane:
    """This side's sending lane: offered, accepted from the peer, then written by one thread.

    ``state`` is ``"offering"``, ``"up"``, ``"failed"`` or ``"closed"``; ``submit``
    only when up. On the lane's thread: ``on_error(exc)`` if the lane breaks once
    up, ``on_idle()`` each time it has written all it was given.
    """

    def __init__(self, local_host: str, on_error: Callable[[BaseException], None], on_idle: Callable[[], None]) -> None:
        self.token = os.urandom(_TOKEN_BYTES)
        self._on_idle = on_idle
        self.state = "offering"
        #: Set once ``state`` has left "offering" (up, failed or closed): senders may wait on it.
        self.settled = threading.Event()
        self.sent = 0  # frames submitted, in send order (the b of a barrier)
        self._on_error = on_error
        self._queue: deque[tuple[int, Sequence[Segment], threading.Event | None] | None] = deque()
        self._ready = threading.Condition()
        self._busy = False
        self._sock: socket.socket | None = None
        self._server = socket.create_server((local_host, 0), family=socket.AF_INET6 if ":" in local_host else socket.AF_INET)
        self.port: int = self._server.getsockname()[1]
        self.thread = threading.Thread(target=self._run, name="actormesh-lane-send", daemon=True)
        self.thread.start()

    @property
    def idle(self) -> bool:
        """Nothing queued or being written."""
        with self._ready:
            return not self._queue and not self._busy

    def submit(self, c: int, segments: Sequence[Segment], event: threading.Event | None) -> None:
        """Queue one frame sent after ``c`` connection frames (any thread)."""
        with self._ready:
            self.sent += 1
            self._queue.append((c, segments, event))
            self._ready.notify()

    def close(self) -> None:
        """Stop: the thread ends, queued frames are dropped (their events set)."""
        with self._ready:
            self.state = "failed" if self.state == "offering" else "closed"
            for item in self._queue:
                if item is not None and item[2] is not None:
                    item[2].set()
            self._queue.clear()
            self._queue.append(None)
            self._ready.notify()
        self.settled.set()
        _shut(self._sock)
        _shut(self._server)

    def _accept(self) -> socket.socket | None:
        deadline = time.monotonic() + OFFER_TIMEOUT_S  # in all: a stranger's tries cannot stretch it
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the offer expired")
                self._server.settimeout(left)
                sock, _ = self._server.accept()
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    token = _recv_exactly(sock, _TOKEN_BYTES)
                except OSError:
                    token = b""
                if hmac.compare_digest(token, self.token):
                    sock.sendall(_ACK)  # tells the peer it reached this lane, not some other listener
                    sock.settimeout(None)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return sock
                sock.close()  # not our peer: keep waiting for it
        except OSError as exc:
            log.debug("bulk lane not dialled (%s): large frames stay on the connection", exc)
            return None
        finally:
            self._server.close()

    def _run(self) -> None:
        _lower_priority()
        sock = self._accept()
        with self._ready:
            if sock is None or self.state != "offering":
                self.state = "failed" if self.state == "offering" else self.state
                self.settled.set()
                _shut(sock)
                return
            self._sock, self.state = sock, "up"
        self.settled.set()
        try:
            while True:
                with self._ready:
                    while not self._queue:
                        self._ready.wait()
                    item = self._queue.popleft()
                    if item is None:
                        return
                    self._busy = True
                c, segments, event = item
                try:
                    _send_all(sock, [*encode_frame([_COUNT.pack(c)]), *encode_frame(segments)])
                finally:
                    if event is not None:
                        event.set()  # written, or never will be: the sender's memory is free either way
                with self._ready:
                    self._busy = False
                    idle = not self._queue
                if idle:
                    self._on_idle()
        except OSError as exc:
            with self._ready:
                self._busy = False
                closed = self.state == "closed"
            if not closed:
                self._on_error(TransportError(f"bulk lane broke: {exc}"))


def dial_lane(host: str, port: int, token: bytes, max_frame_bytes: int, on_frame: Callable[[int, list[Segment]], None],
              on_end: Callable[[BaseException | None], None]) -> Callable[[], None]:
    """Dial a lane the peer offered and read it on a thread of low priority.

    ``on_frame(c, frame)`` and then ``on_end(exc)`` run on that thread:
    ``exc`` is None when the peer closed the lane between frames, or when the
    lane could not be reached or did not answer as one (then the peer's offer
    expires and its large frames stay on the connection). Returns a function
    that closes the lane (its thread ends; ``on_end`` still runs).
    """
    state: dict[str, Any] = {"closed": False, "sock": None}

    def run() -> None:
        _lower_priority()
        error: BaseException | None = None
        try:
            sock = _reach(host, port, token)
            if sock is None:
                return
            state["sock"] = sock
            if state["closed"]:
                _shut(sock)
                return
            _read_frames(sock, FrameDecoder(max_frame_bytes), on_frame)
        except (OSError, ProtocolError) as exc:
            error = exc if not state["closed"] else None
        finally:
            on_end(None if error is None else TransportError(f"bulk lane from {host}:{port} broke: {error}"))

    def close() -> None:
        state["closed"] = True
        _shut(state["sock"])

    threading.Thread(target=run, name="actormesh-lane-recv", daemon=True).start()
    return close


def _reach(host: str, port: int, token: bytes) -> socket.socket | None:
    """A connected lane, or None (logged) if the offer cannot be reached or is not a lane."""
    try:
        sock = socket.create_connection((host, port), timeout=OFFER_TIMEOUT_S)
    except OSError as exc:
        log.debug("bulk lane at %s:%d not reachable (%s): large frames stay on the connection", host, port, exc)
        return None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(token)
        if _recv_exactly(sock, len(_ACK)) != _ACK:
            raise OSError("no lane answered")
        sock.settimeout(None)
        return sock
    except OSError as exc:
        log.debug("bulk lane at %s:%d refused (%s): large frames stay on the connection", host, port, exc)
        sock.close()
        return None


def _read_frames(sock: socket.socket, decoder: FrameDecoder, on_frame: Callable[[int, list[Segment]], None]) -> None:
    """Read ``(count, frame)`` pairs until the peer closes; OSError if it closes inside one."""
    count: int | None = None
    try:
        while True:
            n = sock.recv_into(decoder.get_buffer(-1))
            if not n:
                if count is not None or not decoder.idle:
                    raise OSError("closed by the peer in the middle of a frame")
                return
            for frame in decoder.buffer_updated(n):
                if count is None:
                    if len(frame) != 1 or seg_nbytes(frame[0]) != _COUNT.size:
                        raise ProtocolError("a lane frame without its count")
                    count = _COUNT.unpack(bytes(frame[0]))[0]
                else:
                    on_frame(count, frame)
                    count = None
    finally:
        decoder.close()


def _send_all(sock: socket.socket, parts: list[Segment]) -> None:
    while parts:
        sent = sock.sendmsg(parts[:512])
        parts = frame_tail(parts, sent)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def _shut(sock: Any) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
        sock.close()
