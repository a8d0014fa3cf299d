"""Sans-I/O framing: bytes in, frames out; frames in, bytes out.

Theory of operation
-------------------
A frame is a list of *segments* (byte strings). On the wire::

    <u64 body_len> <u16 nseg> <u16 flags> <u64 len_0> ... <u64 len_{nseg-1}> <seg_0> ... <seg_{nseg-1}>

``body_len`` counts everything after the 12-byte prefix, so a reader can reject
an oversized frame after 12 bytes, before allocating anything. Segment 0 is by
convention the envelope, the others pickle-5 out-of-band buffers, but this
module does not care. The top byte of each segment length is the segment's
*kind* (see _buffers.py): what object a large segment is received into.

Flags:

- ``FLAG_SHM``: the first segment is a shared-memory manifest (see _shm.py);
  such frames decode as :class:`ShmFrame` lists.
- ``FLAG_CHUNKED``: the body is only the segment table; the segments' bytes
  follow in ``FLAG_CHUNK`` frames, which may have whole other frames between
  them. So a large message does not hold up small ones on the same stream. At
  most one chunked frame is in progress per stream; it is complete (and
  delivered) when its last chunk has arrived.
- ``FLAG_CHUNK``: ``nseg`` is 0 and the body is the next bytes of the chunked
  frame in progress.
- ``FLAG_LANE``: a small frame for the connection itself (_lanes.py).

Any other flag, a chunk with no chunked frame in progress or longer than what
that frame still lacks, a second chunked frame while one is in progress, an
unknown kind, lengths that do not add up: each is a protocol error.

The decoder is written for asyncio's ``BufferedProtocol`` (``get_buffer()``,
``buffer_updated(n)``). Small frames share one reusable receive buffer and are
copied out (cheap). The segments of a frame with 64 KiB of data or more are each
allocated once, at their final size and kind, and the socket writes straight
into them (a ``bytes`` argument arrives in its ``bytes`` object, a tensor's
buffer in memory torch wraps as it is).

Any violation raises :class:`ProtocolError`; the decoder is then unusable, and
the caller closes the connection. Running out of memory is not a violation:
the decoder keeps the envelope, discards the rest of that frame's bytes as they
come and yields a :class:`LostFrame` holding just the envelope, so the layer
above fails that one message while the stream goes on.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import ProtocolError
from ._buffers import KINDS, alloc_segment, kind_of
from ._received import LaneFrame, LostFrame, Segment, ShmFrame, Assembly

__all__ = ["FrameDecoder", "encode_frame", "encode_frame_sized", "encode_chunked", "chunk_header", "Segment", "PREFIX_BYTES", "FLAG_SHM",
           "FLAG_CHUNKED", "FLAG_CHUNK", "FLAG_LANE", "ShmFrame", "LaneFrame", "LostFrame", "BIG_BYTES", "seg_nbytes", "frame_tail"]


_PREFIX = struct.Struct("<QI")
_TWO = struct.Struct("<QIQQ")
PREFIX_BYTES = _PREFIX.size
# Keeps the segment-length table of any frame inside the shared buffer.
_MAX_SEGMENTS = 4096
_RECV_BYTES = 256 * 1024
# Frames with more data than this get segments of their own (no copy on receive).
_BIG_BYTES = BIG_BYTES = 64 * 1024
_LEN_MASK = (1 << 56) - 1
# How much a read between the chunks of a chunked frame takes into the shared buffer.
_BETWEEN_CHUNKS_BYTES = 8 * 1024
FLAG_SHM = 1
FLAG_CHUNKED = 2
FLAG_CHUNK = 4
FLAG_LANE = 8
_FRAME_FLAGS = (0, FLAG_SHM, FLAG_CHUNKED, FLAG_LANE)
_NO_KINDS: Any = itertools.repeat(0)  # or a list of kinds, per frame
# The segment tables of the commonest frames, compiled once (not a format string per frame).
_N_SEG_TABLES = 9
_SEG_TABLES = [struct.Struct(f"<{n}Q") for n in range(_N_SEG_TABLES)]


# The seam for memory-pressure tests: (nbytes, kind) -> (object handed out, writable view).
_alloc = alloc_segment


def seg_nbytes(part: Any) -> int:
    """Length in bytes of a segment (bytes, bytearray or any buffer)."""
    return len(part) if type(part) is bytes else memoryview(part).nbytes


def frame_tail(frame: Sequence[Segment], skip: int) -> list[Segment]:
    """The parts of ``frame`` after its first ``skip`` bytes (the rest of a partial write)."""
    rest: list[Segment] = []
    for part in frame:
        n = seg_nbytes(part)
        if skip >= n:
            skip -= n
            continue
        rest.append(memoryview(part)[skip:] if skip else part)
        skip = 0
    return rest


def _table(segments: Sequence[Segment]) -> tuple[list[int], bytes]:
    """Segment lengths, and the table to send: kinds marked where the receiver uses them (large frames)."""
    lens = [seg_nbytes(s) for s in segments]
    words = [n | kind_of(s) << 56 for n, s in zip(lens, segments)] if sum(lens) >= _BIG_BYTES else lens
    return lens, struct.pack(f"<{len(lens)}Q", *words)


def encode_frame(segments: Sequence[Segment], flags: int = 0) -> list[Segment]:
    """The parts to write for one frame: a header, then the segments unchanged.

    >>> b"".join(encode_frame([b"ab", b"c"]))[12 + 16:]
    b'abc'
    """
    return encode_frame_sized(segments, flags)[0]


def encode_frame_sized(segments: Sequence[Segment], flags: int = 0) -> tuple[list[Segment], int]:
    """:func:`encode_frame`, and the frame's length in bytes (what a write must take)."""
    n = len(segments)
    if n == 2 and not flags:  # the common frame: envelope + small payload
        a, b = segments
        la = len(a) if type(a) is bytes else memoryview(a).nbytes
        lb = len(b) if type(b) is bytes else memoryview(b).nbytes
        if la + lb < _BIG_BYTES:
            return [_TWO.pack(16 + la + lb, 2, la, lb), a, b], _TWO.size + la + lb
    if n > _MAX_SEGMENTS:
        raise ValueError(f"a frame holds at most {_MAX_SEGMENTS} segments, got {n}")
    lens, table = _table(segments)
    body = sum(lens)
    head = _PREFIX.pack(8 * n + body, n | flags << 16) + table
    return [head, *segments], len(head) + body


def encode_chunked(segments: Sequence[Segment]) -> tuple[bytes, int]:
    """The header of a chunked frame and how many data bytes its chunks must carry."""
    n = len(segments)
    if n > _MAX_SEGMENTS:
        raise ValueError(f"a frame holds at most {_MAX_SEGMENTS} segments, got {n}")
    lens, table = _table(segments)
    return _PREFIX.pack(8 * n, n | FLAG_CHUNKED << 16) + table, sum(lens)


def chunk_header(nbytes: int) -> bytes:
    """The prefix of a chunk carrying the next ``nbytes`` of the chunked frame in progress."""
    return _PREFIX.pack(nbytes, FLAG_CHUNK << 16)


def _split_kinds(words: Sequence[int]) -> tuple[tuple[int, ...], list[int], int]:
    """A segment table whose words carry kinds in their top byte: ``(lengths, kinds, total)``."""
    kinds = [w >> 56 for w in words]
    if any(k not in KINDS for k in kinds):
        raise ProtocolError(f"frame has a segment of unknown kind {max(kinds)}")
    lens = tuple(w & _LEN_MASK for w in words)
    return lens, kinds, sum(lens)


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
        # Bytes the stream owes straight to ``_target`` (a large frame's memory) before anything else.
        self._target: Assembly | None = None
        self._inflow = 0
        self._chunked: Assembly | None = None  # the chunked frame in progress
        self._broken = False

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Writable memory for the next bytes from the stream (never empty)."""
        if self._inflow:
            assert self._target is not None
            return self._target.space(self._inflow)
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buf) - self._end < _BIG_BYTES:
            # Move the unparsed tail to the front so a whole small frame fits.
            tail = self._end - self._start
            self._buf[:tail] = self._view[self._start : self._end]
            self._start, self._end = 0, tail
        if self._chunked is not None:
            # Between chunks, read little: what follows a chunk's header is its data, which
            # should land in its segment, not here (where it would be copied once more).
            return self._view[self._end : self._end + _BETWEEN_CHUNKS_BYTES]
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> list[list[Segment]]:
        """Account for ``nbytes`` written into the last buffer; return complete frames."""
        if self._broken:
            raise ProtocolError("frame decoder used after a protocol error")
        if self._inflow:
            asm = self._target
            assert asm is not None
            asm.advance(nbytes)
            self._inflow -= nbytes
            if self._inflow or asm.remaining:
                return []
            self._target = None
            if asm is self._chunked:
                self._chunked = None
            return [asm.frame()]
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

    @property
    def idle(self) -> bool:
        """No frame in progress: the stream may end here."""
        return not self._inflow and self._chunked is None and self._start == self._end

    def close(self) -> None:
        """Drop any frame in progress (its memory goes now); the decoder takes no more bytes."""
        self._target = self._chunked = None
        self._inflow = 0
        self._broken = True

    def _parse(self) -> list[list[Segment]]:
        frames: list[list[Segment]] = []
        buf, view = self._buf, self._view
        while True:
            start, avail = self._start, self._end - self._start
            if avail < PREFIX_BYTES:
                break
            body_len, word = _PREFIX.unpack_from(buf, start)
            nseg, flags = word & 0xFFFF, word >> 16
            if flags == FLAG_CHUNK:
                if not self._chunk(body_len, nseg, frames):
                    break
                continue
            if flags not in _FRAME_FLAGS:
                raise ProtocolError(f"frame has unknown flags {flags:#x}")
            if nseg > _MAX_SEGMENTS:
                raise ProtocolError(f"frame declares {nseg} segments (limit {_MAX_SEGMENTS})")
            table = 8 * nseg
            if body_len > self._max:
                raise ProtocolError(f"frame of {body_len} bytes exceeds codec_max_frame_length={self._max}")
            if body_len < table or (flags == FLAG_CHUNKED and body_len != table):
                raise ProtocolError("frame body does not match its segment table")
            if avail < PREFIX_BYTES + table:
                break
            lens = (_SEG_TABLES[nseg] if nseg < _N_SEG_TABLES else struct.Struct(f"<{nseg}Q")).unpack_from(buf, start + PREFIX_BYTES)
            data_len = sum(lens)
            kinds = _NO_KINDS
            if data_len > _LEN_MASK:  # kinds in the top bytes (only large frames carry them)
                lens, kinds, data_len = _split_kinds(lens)
            data_start = start + PREFIX_BYTES + table
            if flags == FLAG_CHUNKED:
                self._begin_chunked(lens, kinds, data_len)
                self._start = data_start
                continue
            if data_len != body_len - table:
                raise ProtocolError("frame segment lengths do not add up to its body length")
            complete = avail >= PREFIX_BYTES + body_len
            if data_len >= _BIG_BYTES:
                if self._begin_big(lens, kinds, flags, data_start, data_len, complete, frames):
                    continue
                break
            if not complete:
                break
            if nseg == 2:  # the commonest frame: an envelope and one pickle
                mid = data_start + lens[0]
                pos = mid + lens[1]
                segments: list[Segment] = [bytes(view[data_start:mid]), bytes(view[mid:pos])]
            else:
                segments = []
                pos = data_start
                for length in lens:
                    segments.append(bytes(view[pos : pos + length]))
                    pos += length
            self._start = pos
            frames.append(segments if not flags else ShmFrame(segments) if flags == FLAG_SHM else LaneFrame(segments))
        if self._start == self._end:
            self._start = self._end = 0
        return frames

    def _begin_chunked(self, lens: Sequence[int], kinds: Sequence[int], data_len: int) -> None:
        """A chunked frame's header was read: its chunks will come straight into new segments."""
        if self._chunked is not None:
            raise ProtocolError("a chunked frame started while another is in progress")
        if not 0 < data_len <= self._max:
            raise ProtocolError(f"chunked frame of {data_len} bytes (limit codec_max_frame_length={self._max})")
        self._chunked = self._assemble(lens, kinds, 0)

    def _begin_big(self, lens: Sequence[int], kinds: Sequence[int], flags: int, data_start: int, data_len: int,
                   complete: bool, frames: list[list[Segment]]) -> bool:
        """A large frame into segments of its own (the rest comes straight into them); True if it was whole."""
        have = self._view[data_start : min(self._end, data_start + data_len)]
        asm = self._assemble(lens, kinds, flags)
        asm.copy_in(have)
        self._start = data_start + len(have)
        if complete:
            frames.append(asm.frame())
            return True
        self._target, self._inflow = asm, asm.remaining
        return False

    def _chunk(self, body_len: int, nseg: int, frames: list[list[Segment]]) -> bool:
        """Take a chunk whose prefix is at ``_start``; False when the rest is to come from the stream."""
        asm = self._chunked
        if nseg:
            raise ProtocolError("a chunk frame declares segments")
        if asm is None:
            raise ProtocolError("a chunk arrived with no chunked frame in progress")
        if not 0 < body_len <= asm.remaining:
            raise ProtocolError(f"a chunk of {body_len} bytes for a frame that lacks {asm.remaining}")
        data_start = self._start + PREFIX_BYTES
        have = min(self._end - data_start, body_len)
        asm.copy_in(self._view[data_start : data_start + have])
        self._start = data_start + have
        if have < body_len:
            self._target, self._inflow = asm, body_len - have
            return False
        if not asm.remaining:
            self._chunked = None
            frames.append(asm.frame())
        return True

    def _assemble(self, lens: Sequence[int], kinds: Iterable[int], flags: int) -> Assembly:
        """Memory for a large frame's segments; a lost frame's envelope only, when there is none."""
        total = sum(lens)
        objs: list[Any] = []
        views: list[memoryview | None] = []
        try:
            for n, kind in zip(lens, kinds):
                obj, mv = _alloc(n, kind)
                objs.append(obj)
                views.append(mv)
            return Assembly(objs, views, flags, total)
        except MemoryError:
            del objs, views
            if flags or not lens or lens[0] >= _BIG_BYTES:
                raise  # nothing to tell the sender with: the connection goes
        error = MemoryError(f"ran out of memory while receiving a {total}-byte message: "
                            "free memory in this process or send smaller arguments")
        error.resource = "memory"  # type: ignore[attr-defined]
        # A discarded segment is recorded by its length (no view): its bytes go to scratch memory.
        envelope = memoryview(bytearray(lens[0]))
        return Assembly([envelope, *lens[1:]], [envelope, *[None] * (len(lens) - 1)], flags, total, error,
                         memoryview(bytearray(_BIG_BYTES)))
