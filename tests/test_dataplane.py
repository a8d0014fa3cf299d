"""The data plane without processes: large segments framed, chunked, received
into memory of their final kind, and every malformed header refused.

Sizes sit on both sides of every threshold: the codec's out-of-band minimum
(4 KiB), its bytes minimum and the decoder's private-memory minimum (64 KiB),
the huge-page minimum (4 MiB) and the receive buffer (256 KiB).
"""

from __future__ import annotations

import sys

import random
import struct
import zlib
from typing import Any

import numpy as np
import pytest

from actormesh.errors import ProtocolError
from actormesh.transport import _buffers, _frames
from actormesh.transport._codec import dumps, loads
from actormesh.transport._frames import FrameDecoder, chunk_header, encode_chunked, encode_frame

KiB, MiB = 1 << 10, 1 << 20
THRESHOLDS = (4 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
SIZES = sorted({0, 1, *(t + d for t in THRESHOLDS for d in (-1, 0, 1))})
MAX = 1 << 34


def _pattern(n: int, seed: int) -> bytes:
    block = random.Random(seed).randbytes(min(n, 65521) or 1)  # a prime period: shifted bytes show
    return (block * (n // len(block) + 1))[:n]


def _wire(frames: list[list[Any]]) -> bytes:
    return b"".join(bytes(p) for f in frames for p in encode_frame(f))


def _feed_cut(dec: FrameDecoder, data: bytes, seed: int) -> list[list[Any]]:
    """Feed through get_buffer/buffer_updated in random pieces, as a socket would."""
    rng = random.Random(seed)
    out: list[list[Any]] = []
    pos, view = 0, memoryview(data)
    while pos < len(data):
        buf = dec.get_buffer(-1)
        n = min(len(buf), len(data) - pos, rng.choice((1, 7, 4096, 70000, 1 << 22)))
        buf[:n] = view[pos : pos + n]
        pos += n
        out.extend(dec.buffer_updated(n))
    return out


def _values(n: int) -> dict[str, Any]:
    import torch

    data = _pattern(n, n)
    return {
        "bytes": data,
        "bytearray": bytearray(data),
        "memoryview": memoryview(bytearray(data)),
        "numpy": np.frombuffer(data, dtype=np.uint8).copy(),
        "tensor": torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8),
    }


@pytest.mark.parametrize("size", SIZES)
def test_every_kind_round_trips_intact_at_sizes_around_every_threshold(size: int) -> None:
    values = _values(size)
    frames = [[b"env-%d" % i, *dumps((v, i))] for i, v in enumerate(values.values())]
    got = _feed_cut(FrameDecoder(MAX), _wire(frames + [[b"after", b"x"]]), size)
    assert len(got) == len(frames) + 1 and bytes(got[-1][0]) == b"after"
    for (name, sent), frame in zip(values.items(), got):
        value, _ = loads(frame[1:])
        raw = bytes(value) if name != "tensor" else value.numpy().tobytes()
        assert zlib.crc32(raw) == zlib.crc32(bytes(memoryview(sent).cast("B")) if name != "tensor" else sent.numpy().tobytes())
        assert len(raw) == size, name
        if name in ("bytes", "bytearray", "memoryview"):
            assert type(value).__name__ == name
        if name in ("numpy", "tensor") and size >= 64 * KiB:
            assert memoryview(value.numpy() if name == "tensor" else value).readonly is False  # memory it owns


def test_a_large_bytes_value_is_received_as_that_bytes_object() -> None:
    data = _pattern(3 * MiB, 1)
    segments = dumps({"blob": data})
    assert any(s is data for s in segments[1:])  # referenced, not copied into the stream
    (frame,) = _feed_cut(FrameDecoder(MAX), _wire([[b"env", *segments]]), 2)
    assert any(type(s) is bytes and len(s) == len(data) for s in frame[2:])
    blob = loads(frame[1:])["blob"]
    assert blob == data and any(blob is s for s in frame[2:])  # the received object itself: no copy


def _chunked(segments: list[bytes], chunk: int) -> list[bytes]:
    header, total = encode_chunked(segments)
    data = b"".join(segments)
    assert total == len(data)
    return [header, *(chunk_header(len(data[i : i + chunk])) + data[i : i + chunk] for i in range(0, len(data), chunk))]


@pytest.mark.parametrize("seed", range(4))
def test_a_chunked_frame_interleaves_with_small_frames_and_arrives_whole(seed: int) -> None:
    rng = random.Random(seed)
    big = [b"big-env", _pattern(rng.randint(1, 3 * MiB), seed), b"", bytes(rng.randint(0, 9000))]
    pieces = _chunked(big, rng.choice((1000, 65536, 300000)))
    wire, small_sent = [pieces[0]], []
    for i, piece in enumerate(pieces[1:]):
        if i and rng.random() < 50 / len(pieces):
            small = [b"small-%d" % i, bytes(rng.choice((0, 10, 5000, 200000)))]
            small_sent.append(small)
            wire.append(_wire([small]))
        wire.append(piece)
    got = _feed_cut(FrameDecoder(MAX), b"".join(wire) + _wire([[b"tail"]]), seed)
    assert [bytes(s) for s in got[-1]] == [b"tail"]
    assert [[bytes(s) for s in f] for f in got[:-2]] == small_sent  # in the order sent
    assert [bytes(s) for s in got[-2]] == big  # complete only with its last chunk


def _header(body_len: int, nseg: int, flags: int, lens: tuple[int, ...] = ()) -> bytes:
    return struct.pack("<QI", body_len, nseg | flags << 16) + struct.pack(f"<{len(lens)}Q", *lens)


MALFORMED = {
    "unknown flag": _header(8, 1, 16, (0,)),
    "chunk without a chunked frame": _header(10, 0, _frames.FLAG_CHUNK) + bytes(10),
    "chunk declaring segments": encode_chunked([bytes(100)])[0] + _header(10, 1, _frames.FLAG_CHUNK),
    "chunk longer than what is missing": encode_chunked([bytes(100)])[0] + _header(101, 0, _frames.FLAG_CHUNK),
    "empty chunk": encode_chunked([bytes(100)])[0] + _header(0, 0, _frames.FLAG_CHUNK),
    "two chunked frames at once": encode_chunked([bytes(100)])[0] * 2,
    "chunked header with data": _header(16, 1, _frames.FLAG_CHUNKED, (8,)) + bytes(8),
    "chunked frame over the limit": _header(8, 1, _frames.FLAG_CHUNKED, (MAX + 1,)),
    "chunked frame of nothing": _header(8, 1, _frames.FLAG_CHUNKED, (0,)),
    "unknown segment kind": _header(8 + 70000, 1, 0, (70000 | 9 << 56,)) + bytes(70000),
    "lengths not adding up": _header(16 + 5, 2, 0, (1, 1)) + bytes(5),
    "too many segments": _header(8 * 5000, 5000, 0),
    "frame over the limit": _header(MAX + 1, 1, 0, (MAX - 7,)),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_header_is_a_protocol_error_and_the_decoder_stays_broken(name: str) -> None:
    dec = FrameDecoder(MAX)
    with pytest.raises(ProtocolError):
        dec.feed(MALFORMED[name] + bytes(64))
    with pytest.raises(ProtocolError):
        dec.feed(_wire([[b"ok"]]))


def test_no_memory_for_a_chunked_frame_keeps_its_envelope_and_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _frames._alloc

    def failing(nbytes: int, kind: int = 0) -> Any:
        if nbytes >= 64 * KiB:
            raise MemoryError()
        return real(nbytes, kind)

    monkeypatch.setattr(_frames, "_alloc", failing)
    wire = b"".join(_chunked([b"envelope", bytes(300_000)], 65536)) + _wire([[b"next", b"x"]])
    frames = _feed_cut(FrameDecoder(MAX), wire, 5)
    assert [type(f) for f in frames] == [_frames.LostFrame, list]
    assert bytes(frames[0][0]) == b"envelope" and isinstance(frames[0].error, MemoryError)
    assert [bytes(s) for s in frames[1]] == [b"next", b"x"]


@pytest.mark.parametrize("kind", _buffers.KINDS)
def test_received_segments_are_uninitialised_only_until_filled(kind: int) -> None:
    obj, view = _buffers.alloc_segment(5 * MiB, kind)
    view[:] = _pattern(5 * MiB, 3)
    assert bytes(obj) == _pattern(5 * MiB, 3)
    assert type(obj) is {0: memoryview, 1: bytes, 2: bytearray}[kind]


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


@pytest.mark.skipif(sys.platform != "linux", reason="anonymous mappings and /proc/self/maps are Linux's")
def test_a_large_received_tensor_buffer_is_its_own_mapping_unmapped_with_its_last_view() -> None:
    import ctypes

    import torch

    obj, view = _buffers.alloc_segment(64 * MiB, _buffers.KIND_VIEW)
    view[:] = _pattern(64 * MiB, 5)
    address = ctypes.addressof(ctypes.c_char.from_buffer(obj))
    tensor = torch.frombuffer(obj, dtype=torch.uint8)  # what the codec hands a caller
    del obj, view
    assert _mapped(address) and bytes(tensor[:16].numpy()) == _pattern(64 * MiB, 5)[:16]
    unmapped: list[int] = []
    real = _buffers._munmap
    _buffers._munmap = lambda a, n: unmapped.append(n) or real(a, n)  # type: ignore[assignment]
    try:
        del tensor
    finally:
        _buffers._munmap = real  # type: ignore[assignment]
    assert unmapped == [64 * MiB] and not _mapped(address)


# -- what goes to the socket next (transport._outgoing) ------------------------------------------

from actormesh.transport._outgoing import Outgoing  # noqa: E402


def _drain(out: Outgoing, decoder: FrameDecoder, max_bytes: int = 1) -> tuple[list[bytes], int]:
    """Write batches until empty; return the frames' first segments in arrival order and the batch count."""
    names, batches = [], 0
    while out:
        parts, _ = out.batch(max_bytes)
        batches += 1
        for frame in decoder.feed(b"".join(bytes(p) for p in parts)):
            names.append(bytes(frame[0]))
    return names, batches


def test_small_frames_with_another_key_pass_a_large_one_and_same_keys_keep_their_order() -> None:
    out = Outgoing(chunk_bytes=64 * KiB, chunk_min_bytes=1 * MiB)
    out.push([b"big-a", bytes(4 * MiB)], 0, None, "a")
    first, _ = out.batch(1)  # the large frame is under way
    dec = FrameDecoder(MAX)
    assert dec.feed(b"".join(bytes(p) for p in first)) == []
    out.push([b"small-a"], 0, None, "a")  # same key: waits for the large one
    out.push([b"small-b"], 0, None, "b")  # another key than all before it: passes them
    out.push([b"small-b2"], 0, None, "b")
    names, _ = _drain(out, dec)
    assert names == [b"small-b", b"small-b2", b"big-a", b"small-a"]

    out.push([b"big-a", bytes(4 * MiB)], 0, None, "a")
    assert dec.feed(b"".join(bytes(p) for p in out.batch(1)[0])) == []
    out.push([b"small-b"], 0, None, "b")
    out.push([b"small-c"], 0, None, "c")
    out.push([b"barrier"], 0, None, None)  # no key: ordered against everything
    out.push([b"small-d"], 0, None, "d")  # behind the barrier
    names, _ = _drain(out, dec)
    assert names == [b"small-b", b"small-c", b"big-a", b"barrier", b"small-d"]


def test_a_second_large_frame_waits_and_events_fire_when_a_frame_is_out() -> None:
    import threading

    out = Outgoing(chunk_bytes=256 * KiB, chunk_min_bytes=1 * MiB)
    done = [threading.Event() for _ in range(3)]
    out.push([b"one", bytes(2 * MiB)], 0, done[0], "a")
    out.push([b"two", bytes(2 * MiB)], 0, done[1], "b")  # another key, but large: after "one"
    out.push([b"after-two"], 0, None, "b")  # behind "two", same key
    out.push([b"three", bytes(10)], 0, done[2], "c")
    dec, names, fired = FrameDecoder(MAX), [], []
    while out:
        parts, events = out.batch(256 * KiB)
        assert sum(len(memoryview(p).cast("B")) for p in parts) <= 256 * KiB + 64 * KiB  # bounded batches
        names += [bytes(f[0]) for f in dec.feed(b"".join(bytes(p) for p in parts))]
        fired += [done.index(e) for e in events]
    assert names == [b"three", b"one", b"two", b"after-two"] and sorted(fired) == [0, 1, 2]
    assert fired.index(2) < fired.index(0)  # the small frame's event fired when it went out


def test_clearing_the_queue_releases_every_waiting_sender() -> None:
    import threading

    out = Outgoing(chunk_bytes=64 * KiB, chunk_min_bytes=1 * MiB)
    events = [threading.Event() for _ in range(3)]
    out.push([b"big", bytes(2 * MiB)], 0, events[0], None)
    out.batch(1)
    out.push([b"big2", bytes(2 * MiB)], 0, events[1], None)
    out.push([b"small"], 0, events[2], None)
    assert sorted(map(id, out.clear())) == sorted(map(id, events)) and not out
