"""Sans-I/O framing: bytes in, frames out; frames in, bytes out.

Theory of operation
-------------------
A frame is a list of *segments* (byte strings). On the wire::

    <u64 body_len> <u16 nseg> <u16 flags> <u64 len_0> ... <u64 len_{nseg-1}> <seg_0> ... <seg_{nseg-1}>

``body_len`` counts everything after the 12-byte prefix, so a reader can reject
an oversized frame after 12 bytes, before allocating anything. Segment 0 is by
convention the envelope, the others pickle-5 out-of-band buffers, but this
module does not care. One flag exists: ``FLAG_SHM`` marks a frame whose first
segment is a shared-memory manifest (see _shm.py); such frames decode as
:class:`ShmFrame` lists. Unknown flags are a protocol error.

The decoder is written for asyncio's ``BufferedProtocol``: the event loop asks
``get_buffer()`` for memory and reports with ``buffer_updated(n)``. Small frames
share one reusable receive buffer and are copied out (cheap). A frame whose data
is large gets a buffer of its own, handed straight to the kernel, so large
payloads land in their final place without a copy: the segments of such a frame
are memoryviews over that private buffer (writable, so numpy/torch can wrap them).

Any violation raises :class:`ProtocolError`; the decoder is then unusable, and the
caller closes the connection.

Running out of memory is not a violation: when the private buffer of a large
frame cannot be allocated, the decoder keeps the envelope (segment 0, already
received), discards the rest of the frame's bytes as they come and then yields
a :class:`LostFrame` holding just the envelope, so the layer above can fail
that one message while the stream goes on.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Union

from ..errors import ProtocolError

__all__ = ["FrameDecoder", "encode_frame", "Segment", "PREFIX_BYTES", "FLAG_SHM", "ShmFrame", "LostFrame"]

Segment = Union[bytes, bytearray, memoryview]

_PREFIX = struct.Struct("<QI")
_TWO = struct.Struct("<QIQQ")
PREFIX_BYTES = _PREFIX.size
# Keeps the segment-length table of any frame inside the shared buffer.
_MAX_SEGMENTS = 4096
_RECV_BYTES = 256 * 1024
# Frames with more data than this get a private buffer (no copy on receive).
_BIG_BYTES = 64 * 1024
FLAG_SHM = 1


class ShmFrame(list):  # type: ignore[type-arg]
    """A decoded frame flagged ``FLAG_SHM``: segment 0 is the manifest."""

    __slots__ = ()


class LostFrame(list):  # type: ignore[type-arg]
    """A frame whose data could not be received (no memory): ``[envelope]`` and ``error``."""

    __slots__ = ("error",)

    def __init__(self, segments: list[Segment], error: BaseException) -> None:
        super().__init__(segments)
        self.error = error


def _alloc(nbytes: int) -> bytearray:
    """The private receive buffer of a large frame (a seam for memory-pressure tests)."""
    return bytearray(nbytes)


def encode_frame(segments: Sequence[Segment], flags: int = 0) -> list[Segment]:
    """The parts to write for one frame: a header, then the segments unchanged.

    >>> b"".join(encode_frame([b"ab", b"c"]))[12 + 16:]
    b'abc'
    """
    n = len(segments)
    if n == 2 and not flags:  # the common frame: envelope + small payload
        a, b = segments
        la = len(a) if type(a) is bytes else memoryview(a).nbytes
        lb = len(b) if type(b) is bytes else memoryview(b).nbytes
        return [_TWO.pack(16 + la + lb, 2, la, lb), a, b]
    if n > _MAX_SEGMENTS:
        raise ValueError(f"a frame holds at most {_MAX_SEGMENTS} segments, got {n}")
    lens = [len(s) if type(s) is bytes else memoryview(s).nbytes for s in segments]
    header = _PREFIX.pack(8 * n + sum(lens), n | flags << 16) + struct.pack(f"<{n}Q", *lens)
    return [header, *segments]


class FrameDecoder:
    """Turns a byte stream into frames (lists of segments).

    Use either ``get_buffer()`` / ``buffer_updated(n)`` (zero-copy, for
    ``asyncio.BufferedProtocol``) or ``feed(data)`` (tests, fuzzing).
    """

    def __init__(self, max_frame_bytes: int) -> None:
        if max_frame_bytes <= 0:
            raise ValueError("max_frame_bytes must be positive")
        self._max = max_frame_bytes
        self._buf = bytearray(_RECV_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        # A large frame in progress: its private buffer, bytes filled, segment lengths.
        self._big: bytearray | None = None
        self._big_view: memoryview | None = None
        self._big_filled = 0
        self._big_lens: tuple[int, ...] = ()
        self._big_flags = 0
        # A large frame being discarded (its buffer could not be allocated).
        self._skip = 0
        self._lost: LostFrame | None = None
        self._broken = False

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Writable memory for the next bytes from the stream (never empty)."""
        if self._big_view is not None:
            return self._big_view[self._big_filled :]
        if self._skip:
            return self._view[: min(len(self._buf), self._skip)]
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buf) - self._end < _BIG_BYTES:
            # Move the unparsed tail to the front so a whole small frame fits.
            tail = self._end - self._start
            self._buf[:tail] = self._view[self._start : self._end]
            self._start, self._end = 0, tail
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> list[list[Segment]]:
        """Account for ``nbytes`` written into the last buffer; return complete frames."""
        if self._broken:
            raise ProtocolError("frame decoder used after a protocol error")
        if self._big is not None:
            self._big_filled += nbytes
            if self._big_filled < len(self._big):
                return []
            frame = self._split_big()
            return [frame]
        if self._skip:
            self._skip -= nbytes
            if self._skip:
                return []
            lost, self._lost = self._lost, None
            assert lost is not None
            return [lost]
        self._end += nbytes
        try:
            return self._parse()
        except ProtocolError:
            self._broken = True
            raise

    def feed(self, data: bytes) -> list[list[Segment]]:
        """Push bytes in (copying); return every frame they complete."""
        frames: list[list[Segment]] = []
        mv = memoryview(data)
        while mv.nbytes:
            buf = self.get_buffer()
            n = min(buf.nbytes, mv.nbytes)
            buf[:n] = mv[:n]
            mv = mv[n:]
            frames.extend(self.buffer_updated(n))
        return frames

    def _split_big(self) -> list[Segment]:
        view = self._big_view
        assert view is not None
        segments: list[Segment] = []
        pos = 0
        for length in self._big_lens:
            segments.append(view[pos : pos + length])
            pos += length
        self._big = self._big_view = None
        self._big_filled = 0
        return ShmFrame(segments) if self._big_flags else segments

    def _parse(self) -> list[list[Segment]]:
        frames: list[list[Segment]] = []
        buf, view = self._buf, self._view
        while True:
            start, avail = self._start, self._end - self._start
            if avail < PREFIX_BYTES:
                break
            body_len, nseg = _PREFIX.unpack_from(buf, start)
            flags = nseg >> 16
            if flags:
                if flags != FLAG_SHM:
                    raise ProtocolError(f"frame has unknown flags {flags:#x}")
                nseg &= 0xFFFF
            if nseg > _MAX_SEGMENTS:
                raise ProtocolError(f"frame declares {nseg} segments (limit {_MAX_SEGMENTS})")
            if body_len > self._max:
                raise ProtocolError(f"frame of {body_len} bytes exceeds codec_max_frame_length={self._max}")
            table = 8 * nseg
            if body_len < table:
                raise ProtocolError("frame body shorter than its segment table")
            if avail < PREFIX_BYTES + table:
                break
            lens = struct.unpack_from(f"<{nseg}Q", buf, start + PREFIX_BYTES)
            data_len = body_len - table
            if sum(lens) != data_len:
                raise ProtocolError("frame segment lengths do not add up to its body length")
            data_start = start + PREFIX_BYTES + table
            if avail >= PREFIX_BYTES + body_len:
                segments: list[Segment] = []
                pos = data_start
                for length in lens:
                    segments.append(bytes(view[pos : pos + length]))
                    pos += length
                self._start = pos
                frames.append(ShmFrame(segments) if flags else segments)
                continue
            if data_len >= _BIG_BYTES:
                # Receive the rest of this frame straight into its own buffer.
                have = self._end - data_start
                try:
                    big = _alloc(data_len)
                except MemoryError:
                    if flags or not lens or lens[0] > have:
                        raise  # nothing to tell the sender with: the connection goes
                    self._discard(bytes(view[data_start : data_start + lens[0]]), data_len, have)
                    break
                big[:have] = view[data_start : self._end]
                self._big, self._big_view = big, memoryview(big)
                self._big_filled, self._big_lens, self._big_flags = have, lens, flags
                self._start = self._end = 0
            break
        if self._start == self._end:
            self._start = self._end = 0
        return frames

    def _discard(self, envelope: bytes, data_len: int, have: int) -> None:
        """Drop the rest of a frame we have no memory for; keep its envelope."""
        error = MemoryError(f"ran out of memory while receiving a {data_len}-byte message: "
                            "free memory in this process or send smaller arguments")
        error.resource = "memory"  # type: ignore[attr-defined]
        self._lost = LostFrame([envelope], error)
        self._skip = data_len - have
        self._start = self._end = 0
