"""Hostile bytes: the frame decoder and the handshake only ever raise their own
protocol errors (10,000+ generated cases in total)."""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actormesh.errors import AuthenticationError, ProtocolError
from actormesh.transport import FrameDecoder, Handshake, encode_frame

FUZZ = settings(max_examples=4000, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
SECRET = b"s" * 32


def _feed_in_chunks(dec: FrameDecoder, data: bytes, cuts: list[int]) -> list:
    frames, pos = [], 0
    for cut in sorted(c % (len(data) + 1) for c in cuts) + [len(data)]:
        frames.extend(dec.feed(data[pos:cut]))
        pos = max(pos, cut)
    return frames


@FUZZ
@given(st.binary(max_size=2048), st.lists(st.integers(0, 4096), max_size=6))
def test_random_bytes_raise_only_protocol_error(data, cuts):
    dec = FrameDecoder(max_frame_bytes=1 << 20)
    try:
        frames = _feed_in_chunks(dec, data, cuts)
    except ProtocolError:
        return
    assert all(isinstance(f, list) for f in frames)


@FUZZ
@given(
    st.lists(st.binary(max_size=300), min_size=0, max_size=5),
    st.integers(0, 200),
    st.binary(min_size=1, max_size=8),
    st.lists(st.integers(0, 4096), max_size=4),
)
def test_corrupted_valid_frames(segments, where, garbage, cuts):
    wire = bytearray(b"".join(bytes(p) for p in encode_frame(segments)))
    at = where % len(wire)
    wire[at : at + len(garbage)] = garbage
    dec = FrameDecoder(max_frame_bytes=1 << 16)
    try:
        frames = _feed_in_chunks(dec, bytes(wire), cuts)
    except ProtocolError:
        return
    for frame in frames:  # whatever decoded is well-formed
        assert isinstance(frame, list)


@settings(max_examples=2000, derandomize=True, database=None, deadline=None)
@given(st.binary(min_size=0, max_size=200))
def test_handshake_garbage_raises_only_authentication_error(data):
    hs = Handshake(SECRET, dialer=False)
    hs.start()
    try:
        hs.receive(data)
    except AuthenticationError:
        return
    assert not hs.done  # success needs the secret; random bytes never have it


def test_oversized_frame_rejected_after_prefix():
    dec = FrameDecoder(max_frame_bytes=1000)
    try:
        dec.feed(struct.pack("<QI", 10_000, 1))
    except ProtocolError as exc:
        assert "exceeds" in str(exc)
    else:
        raise AssertionError("oversized frame accepted")
