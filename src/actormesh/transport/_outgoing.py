"""Which bytes go to the socket next: large frames in chunks, small frames between them.

Theory of operation
-------------------
Frames wait here in send order. A frame with at least ``chunk_min_bytes`` of
data goes out *chunked* (see _frames.py): a header with its segment table, then
its bytes in chunks of ``chunk_bytes``. Anything else goes out whole. The
connection asks for one batch at a time, and only when the socket has taken
everything before, so at most about a batch (plus what the kernel holds, which
``TCP_NOTSENT_LOWAT`` bounds) is ever ahead of a frame that has just arrived.

Order. Every frame has an *order key* (or None). The rules:

1. Frames leave in send order, except that
2. a frame that goes out whole may pass the chunked frame in progress and
   frames queued before it if it and all of them have keys and its key
   differs from theirs (looking at most ``_SCAN`` frames deep);
3. a second chunked frame starts only when the first is done.

So frames with the same key (messages to one actor, replies to one port) keep
their order, a frame without a key is ordered against everything, and a small
message to another actor passes a 1 GiB transfer instead of waiting behind it.
Nothing here copies data: a batch is memoryviews over the sender's buffers.

Pure logic, no I/O: the connection hands the batch to its transport.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any

from ._frames import Segment, chunk_header, encode_chunked, encode_frame_sized, seg_nbytes

__all__ = ["Outgoing", "CHUNK_BYTES", "CHUNK_MIN_BYTES"]

#: Frames with this much data or more go out in chunks.
CHUNK_MIN_BYTES = 1 << 20
#: Bytes per chunk: what a small frame may have to wait for, per batch.
CHUNK_BYTES = 256 << 10
# How deep the queue is searched for a frame that may pass the ones before it.
_SCAN = 64


class _Chunked:
    """A chunked frame: its header, and a cursor over its data segments."""

    __slots__ = ("header", "views", "index", "offset", "left", "event", "key")

    def __init__(self, segments: Sequence[Segment], event: threading.Event | None, key: Hashable | None) -> None:
        self.header, self.left = encode_chunked(segments)
        self.views = [memoryview(s).cast("B") if not isinstance(s, bytes) else memoryview(s) for s in segments]
        self.index = self.offset = 0
        self.event, self.key = event, key

    def take(self, nbytes: int, parts: list[Segment]) -> None:
        """Append views of the next ``nbytes`` of data to ``parts``."""
        self.left -= nbytes
        views = self.views
        while nbytes:
            view = views[self.index]
            n = min(nbytes, len(view) - self.offset)
            if n:
                parts.append(view[self.offset : self.offset + n])
            self.offset += n
            nbytes -= n
            if self.offset == len(view):
                self.index += 1
                self.offset = 0


class Outgoing:
    """Frames waiting for the socket; :meth:`batch` says what to write next (one thread at a time)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, chunk_min_bytes: int = CHUNK_MIN_BYTES) -> None:
        if chunk_bytes <= 0 or chunk_min_bytes <= 0:
            raise ValueError("chunk_bytes and chunk_min_bytes must be positive")
        self._chunk = chunk_bytes
        self._chunk_min = chunk_min_bytes
        # (parts of a whole frame, event, key, its bytes) or a _Chunked not yet started
        self._queue: deque[Any] = deque()
        self._big: _Chunked | None = None
        self._chunked = 0  # chunked frames queued or in progress

    def __bool__(self) -> bool:
        return bool(self._queue) or self._big is not None

    @property
    def chunked(self) -> bool:
        """Whether a chunked frame is queued or in progress (so frames may pass others)."""
        return self._chunked > 0

    def push(self, segments: Sequence[Segment], flags: int, event: threading.Event | None, key: Hashable | None) -> None:
        """Queue one frame (its segments, not yet encoded)."""
        if not flags and len(segments) > 1:
            if len(segments) == 2:  # the commonest frame: no generator to size it
                a, b = segments
                size = (len(a) if type(a) is bytes else memoryview(a).nbytes) + (len(b) if type(b) is bytes else memoryview(b).nbytes)
            else:
                size = sum(seg_nbytes(s) for s in segments)
            if size >= self._chunk_min:
                self._queue.append(_Chunked(segments, event, key))
                self._chunked += 1
                return
        parts, nbytes = encode_frame_sized(segments, flags)
        self._queue.append((parts, event, key, nbytes))

    def push_encoded(self, parts: list[Segment]) -> None:
        """Queue the rest of a frame that is already partly on the wire: it goes first."""
        self._queue.appendleft((parts, None, None, sum(seg_nbytes(p) for p in parts)))

    def batch(self, max_bytes: int) -> tuple[list[Segment], list[threading.Event]]:
        """The next parts to write, about ``max_bytes`` of them (at least one frame or
        chunk), and the events of the frames they complete."""
        parts, events, _ = self.batch_sized(max_bytes)
        return parts, events

    def batch_sized(self, max_bytes: int) -> tuple[list[Segment], list[threading.Event], int]:
        """:meth:`batch`, and how many bytes its parts hold (sized as they were queued)."""
        parts: list[Segment] = []
        events: list[threading.Event] = []
        budget, total = max_bytes, 0
        queue = self._queue
        while budget > 0 and len(parts) < 512:
            i = self._next_whole()
            if i is not None:
                frame, event, _, nbytes = queue[i]
                del queue[i]
                parts.extend(frame)
                budget -= nbytes
                total += nbytes
                if event is not None:
                    events.append(event)
                continue
            big = self._big
            if big is None and queue and type(queue[0]) is _Chunked:
                self._big = big = queue.popleft()
                parts.append(big.header)
                total += len(big.header)
            if big is None:
                break
            n = min(self._chunk, big.left)
            header = chunk_header(n)
            parts.append(header)
            big.take(n, parts)
            budget -= n
            total += len(header) + n
            if not big.left:
                self._big = None
                self._chunked -= 1
                if big.event is not None:
                    events.append(big.event)
        return parts, events, total

    def _next_whole(self) -> int | None:
        """Where the next frame to write whole is in the queue (rules 1 and 2), if any."""
        queue, big = self._queue, self._big
        if big is None and queue and type(queue[0]) is tuple:
            return 0
        ahead: set[Hashable] = set()
        if big is not None:
            if big.key is None:
                return None
            ahead.add(big.key)
        for i, item in enumerate(queue):
            if i == _SCAN:
                return None
            key = item[2] if type(item) is tuple else item.key
            if key is None:
                return None  # ordered against everything: nothing behind it may pass
            if type(item) is tuple and key not in ahead:
                return i
            ahead.add(key)
        return None

    def clear(self) -> list[threading.Event]:
        """Drop everything (the connection is gone); return the events to set."""
        events = [item.event if type(item) is _Chunked else item[1] for item in self._queue]
        if self._big is not None:
            events.append(self._big.event)
        self._queue.clear()
        self._big = None
        self._chunked = 0
        return [e for e in events if e is not None]
