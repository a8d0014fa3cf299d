"""Transport: framing (sans-I/O, fuzzed), the HMAC handshake, the codec, and a
live listening socket that must not unpickle anything from an unauthenticated peer.

Semantics: DESIGN.md §3 (messages, authentication), MONARCH_API.md §1.1 (serialization).
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actormesh.actor import Actor, endpoint
from actormesh.errors import AuthenticationError, ProtocolError, TransportError
from actormesh.transport import (
    HANDSHAKE_BYTES,
    FrameDecoder,
    Handshake,
    dumps,
    encode_frame,
    loads,
)

T = 20  # bound of every .get()
BIG = 64 * 1024  # frames with more data than this take the private-buffer path
MAX = 4 * 1024 * 1024  # decoder limit used by the fuzz tests (keeps allocations small)

FUZZ = settings(
    max_examples=500,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _frame_bytes(segments: list[bytes]) -> bytes:
    return b"".join(bytes(p) for p in encode_frame(segments))


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


def _as_bytes(frames: list[list[Any]]) -> list[list[bytes]]:
    return [[bytes(s) for s in f] for f in frames]


# --------------------------------------------------------------------------- frames: strategies

small_segment = st.binary(min_size=0, max_size=300)


@st.composite
def big_segment(draw: st.DrawFn) -> bytes:
    """A segment over 64 KiB; its bytes come from a seeded PRNG (cheap to draw)."""
    n = draw(st.integers(BIG + 1, 3 * BIG))
    seed = draw(st.integers(0, 2**32 - 1))
    return random.Random(seed).randbytes(n)


@st.composite
def frame(draw: st.DrawFn) -> list[bytes]:
    segs = draw(st.lists(small_segment, min_size=0, max_size=8))
    if draw(st.integers(0, 9)) == 0:  # one frame in ten carries a big segment
        segs.insert(draw(st.integers(0, len(segs))), draw(big_segment()))
    return segs


# --------------------------------------------------------------------------- frames: properties


@FUZZ
@given(frames=st.lists(frame(), min_size=1, max_size=6), cuts=st.lists(st.integers(0, 10**7), max_size=20))
def test_frames_roundtrip_in_any_chunking(frames: list[list[bytes]], cuts: list[int]) -> None:
    data = b"".join(_frame_bytes(f) for f in frames)
    dec = FrameDecoder(MAX)
    got: list[list[Any]] = []
    for chunk in _chunks(data, cuts):
        got.extend(dec.feed(chunk))
    assert _as_bytes(got) == frames


def test_frame_roundtrip_byte_by_byte_with_empty_and_big_segments() -> None:
    big = random.Random(1).randbytes(BIG * 2 + 7)
    frames = [[b""], [], [b"", b"a", b""], [b"head", big, b"", b"tail"], [b"after big"]]
    data = b"".join(_frame_bytes(f) for f in frames)
    dec = FrameDecoder(MAX)
    got: list[list[Any]] = []
    for i in range(len(data)):
        got.extend(dec.feed(data[i : i + 1]))
    assert _as_bytes(got) == frames


def test_big_frame_segments_arrive_writable_or_as_the_type_sent() -> None:
    big = random.Random(2).randbytes(BIG * 4)
    data = _frame_bytes([b"env", memoryview(big), big, bytearray(big)])
    dec = FrameDecoder(MAX)
    got = dec.feed(data[:100]) + dec.feed(data[100:])
    assert len(got) == 1
    env, payload, as_bytes, as_bytearray = got[0]
    assert bytes(env) == b"env" and bytes(payload) == big
    arr = np.frombuffer(payload, dtype=np.uint8)
    assert arr.flags.writeable  # a buffer (tensor, array) arrives in memory torch/numpy can own
    assert type(as_bytes) is bytes and as_bytes == big and hash(as_bytes) == hash(big)
    assert type(as_bytearray) is bytearray and as_bytearray == big


def test_frame_with_many_segments() -> None:
    segs = [bytes([i % 251]) * (i % 5) for i in range(4096)]
    frames = [segs, [b"next"]]
    data = b"".join(_frame_bytes(f) for f in frames)
    dec = FrameDecoder(MAX)
    got: list[list[Any]] = []
    rng = random.Random(3)
    pos = 0
    while pos < len(data):
        step = rng.randint(1, 5000)
        got.extend(dec.feed(data[pos : pos + step]))
        pos += step
    assert _as_bytes(got) == frames
    with pytest.raises(ValueError):
        encode_frame([b""] * 4097)


def test_frames_via_get_buffer_and_buffer_updated() -> None:
    """The asyncio BufferedProtocol path: write into the decoder's own memory."""
    frames = [[b"a" * 10], [random.Random(4).randbytes(BIG * 3)], [b"z"]]
    data = memoryview(b"".join(_frame_bytes(f) for f in frames))
    dec = FrameDecoder(MAX)
    got: list[list[Any]] = []
    rng = random.Random(5)
    while data.nbytes:
        buf = dec.get_buffer(-1)
        assert buf.nbytes > 0
        n = min(buf.nbytes, data.nbytes, rng.randint(1, 70000))
        buf[:n] = data[:n]
        data = data[n:]
        got.extend(dec.buffer_updated(n))
    assert _as_bytes(got) == frames


def _feed_expecting_only_protocol_errors(dec: FrameDecoder, chunks: list[bytes]) -> None:
    for chunk in chunks:
        try:
            dec.feed(chunk)
        except ProtocolError:
            # Broken for good: any further input is refused the same way.
            with pytest.raises(ProtocolError):
                dec.feed(b"\x00" * 16)
            return


@FUZZ
@given(data=st.binary(min_size=0, max_size=2000), cuts=st.lists(st.integers(0, 10**6), max_size=10))
def test_random_bytes_only_ever_raise_protocol_error(data: bytes, cuts: list[int]) -> None:
    _feed_expecting_only_protocol_errors(FrameDecoder(MAX), _chunks(data, cuts))


@st.composite
def corrupted_stream(draw: st.DrawFn) -> bytes:
    segs = draw(frame())
    data = bytearray(_frame_bytes(segs))
    header_len = 12 + 8 * len(segs)
    kind = draw(st.sampled_from(["flip", "truncate", "overwrite_prefix"]))
    if kind == "flip":
        i = draw(st.integers(0, max(0, header_len - 1)))
        data[i] ^= draw(st.integers(1, 255))
    elif kind == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    else:
        fake = struct.pack("<QI", draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**32 - 1)))
        data[:12] = fake
    tail = draw(st.binary(max_size=64))
    return bytes(data) + tail


@FUZZ
@given(data=corrupted_stream(), cuts=st.lists(st.integers(0, 10**6), max_size=10))
def test_corrupted_headers_only_ever_raise_protocol_error(data: bytes, cuts: list[int]) -> None:
    _feed_expecting_only_protocol_errors(FrameDecoder(MAX), _chunks(data, cuts))


def test_oversized_frame_is_rejected_after_the_prefix() -> None:
    limit = 1000
    dec = FrameDecoder(limit)
    prefix = struct.pack("<QI", limit + 1, 1)
    assert dec.feed(prefix[:11]) == []  # not yet decidable
    with pytest.raises(ProtocolError, match="exceeds"):
        dec.feed(prefix[11:])
    with pytest.raises(ProtocolError):
        dec.feed(b"\x00" * 8)

    dec = FrameDecoder(limit)
    with pytest.raises(ProtocolError):
        dec.feed(struct.pack("<QI", 2**64 - 1, 1))
    # A frame exactly at the limit is fine.
    dec = FrameDecoder(limit)
    seg = b"x" * (limit - 8)
    assert _as_bytes(dec.feed(_frame_bytes([seg]))) == [[seg]]


def test_segment_table_inconsistencies_are_protocol_errors() -> None:
    # body shorter than its segment table
    with pytest.raises(ProtocolError):
        FrameDecoder(MAX).feed(struct.pack("<QI", 4, 1) + b"\x00" * 8)
    # lengths that do not add up
    with pytest.raises(ProtocolError):
        FrameDecoder(MAX).feed(struct.pack("<QIQ", 8 + 5, 1, 6) + b"x" * 5)
    # too many segments
    with pytest.raises(ProtocolError):
        FrameDecoder(MAX).feed(struct.pack("<QI", 8 * 5000, 5000))


def test_decoder_rejects_nonpositive_limit() -> None:
    with pytest.raises(ValueError):
        FrameDecoder(0)


# --------------------------------------------------------------------------- handshake


SECRET = b"s3cr3t-job-key-0123456789abcdef!"


def _run_handshake(a: Handshake, b: Handshake) -> None:
    pa = a.receive(b.start())
    pb = b.receive(a.start())
    a.receive(pb)
    b.receive(pa)


def test_handshake_same_secret_succeeds() -> None:
    a, b = Handshake(SECRET, dialer=True), Handshake(SECRET, dialer=False)
    _run_handshake(a, b)
    assert a.done and b.done


@FUZZ
@given(cuts_a=st.lists(st.integers(0, 200), max_size=8), cuts_b=st.lists(st.integers(0, 200), max_size=8), extra=st.binary(max_size=32))
def test_handshake_succeeds_in_any_chunking_and_keeps_leftover(cuts_a: list[int], cuts_b: list[int], extra: bytes) -> None:
    a, b = Handshake(SECRET, dialer=True), Handshake(SECRET, dialer=False)
    a_hello, b_hello = a.start(), b.start()
    # Each side answers the peer's hello; then the proofs cross.
    a_proof = a.receive(b_hello)
    b_proof = b.receive(a_hello)
    to_a = _chunks(b_proof, cuts_a)
    to_a[-1] += extra  # bytes after the handshake ride along with its last piece
    for chunk in to_a:
        a.receive(chunk)
    for chunk in _chunks(a_proof, cuts_b):
        b.receive(chunk)
    assert a.done and b.done
    assert a.leftover == extra


def test_handshake_byte_by_byte() -> None:
    a, b = Handshake(SECRET, dialer=True), Handshake(SECRET, dialer=False)
    to_a, to_b = b.start(), a.start()
    out_a = b"".join(a.receive(to_a[i : i + 1]) for i in range(len(to_a)))
    out_b = b"".join(b.receive(to_b[i : i + 1]) for i in range(len(to_b)))
    for i in range(len(out_b)):
        a.receive(out_b[i : i + 1])
    for i in range(len(out_a)):
        b.receive(out_a[i : i + 1])
    assert a.done and b.done


def test_handshake_different_secrets_fail() -> None:
    a, b = Handshake(SECRET, dialer=True), Handshake(b"another-secret-of-32-bytes-long!", dialer=False)
    pa = a.receive(b.start())
    pb = b.receive(a.start())
    with pytest.raises(AuthenticationError):
        a.receive(pb)
    with pytest.raises(AuthenticationError):
        b.receive(pa)
    assert not a.done and not b.done


def test_handshake_same_role_cannot_authenticate() -> None:
    """A proof reflected back (both sides claiming to dial) is refused."""
    a, b = Handshake(SECRET, dialer=True), Handshake(SECRET, dialer=True)
    pa = a.receive(b.start())
    pb = b.receive(a.start())
    with pytest.raises(AuthenticationError):
        a.receive(pb)
    with pytest.raises(AuthenticationError):
        b.receive(pa)


def test_handshake_wrong_magic_fails() -> None:
    a = Handshake(SECRET, dialer=False)
    hello = Handshake(SECRET, dialer=True).start()
    bad = bytes([hello[0] ^ 0xFF]) + hello[1:]
    with pytest.raises(AuthenticationError):
        a.receive(bad)
    assert not a.done


def test_handshake_replayed_proof_fails() -> None:
    """A recorded proof does not authenticate against a fresh nonce."""
    a1, b1 = Handshake(SECRET, dialer=True), Handshake(SECRET, dialer=False)
    a_hello = a1.start()
    b1.receive(a_hello)
    a_proof = a1.receive(b1.start())
    b2 = Handshake(SECRET, dialer=False)
    b2.receive(a_hello)  # replay the old hello ...
    with pytest.raises(AuthenticationError):
        b2.receive(a_proof)  # ... and the old proof


@FUZZ
@given(data=st.binary(min_size=0, max_size=3 * HANDSHAKE_BYTES), cuts=st.lists(st.integers(0, 300), max_size=8), dialer=st.booleans())
def test_handshake_random_bytes_raise_authentication_error_only(data: bytes, cuts: list[int], dialer: bool) -> None:
    hs = Handshake(SECRET, dialer=dialer)
    try:
        for chunk in _chunks(data, cuts):
            out = hs.receive(chunk)
            assert isinstance(out, bytes)
    except AuthenticationError:
        pass
    assert not hs.done


def test_handshake_repr_never_shows_the_secret() -> None:
    for dialer in (True, False):
        hs = Handshake(SECRET, dialer=dialer)
        for text in (repr(hs), str(hs)):
            assert SECRET.decode() not in text
            assert SECRET.hex() not in text
            assert repr(SECRET) not in text
        _run_handshake(hs, Handshake(SECRET, dialer=not dialer))
        assert SECRET.decode() not in repr(hs) and SECRET.hex() not in repr(hs)


def test_handshake_rejects_short_secret() -> None:
    with pytest.raises(ValueError):
        Handshake(b"short", dialer=True)


# --------------------------------------------------------------------------- codec


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -(2**70),
        3.5,
        float("inf"),
        "text ünïcode",
        b"\x00bytes",
        bytearray(b"ba"),
        (1, "a", None),
        [1, [2, [3, [4, [5]]]]],
        {"a": {"b": {"c": [1, 2, {"d": (3,)}]}}},
        {1, 2, 3},
        frozenset({"x"}),
        {(1, 2): "tuple key"},
        complex(1, 2),
        range(3, 10, 2),
    ],
    ids=repr,
)
def test_codec_roundtrips_builtins_and_nested_containers(value: Any) -> None:
    segs = dumps(value)
    assert len(segs) == 1
    assert loads(segs) == value


def test_codec_roundtrips_a_local_function_by_value() -> None:
    base = 7

    def local_fn(x: int) -> int:
        return x * base

    segs = dumps(local_fn)
    blob = bytes(segs[0])
    # By value: the code itself travels, not a reference a worker could not import.
    assert b"local_fn" in blob
    again = loads([blob])
    assert again(6) == 42
    assert loads(dumps(lambda y: y + base))(1) == 8


def test_codec_sends_large_numpy_arrays_out_of_band() -> None:
    arr = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    assert arr.nbytes == 1 << 20
    segs = dumps({"arr": arr, "meta": "m"})
    assert len(segs) > 1
    assert len(bytes(segs[0])) < 64 * 1024, "the array bytes are not copied into the pickle stream"
    out = loads([bytes(s) for s in segs])
    assert out["meta"] == "m"
    np.testing.assert_array_equal(out["arr"], arr)
    small = np.arange(10)
    assert len(dumps(small)) == 1
    np.testing.assert_array_equal(loads(dumps(small)), small)


def test_codec_unpicklable_value_is_type_error() -> None:
    with pytest.raises(TypeError):
        dumps(threading.Lock())
    with pytest.raises(TypeError):
        dumps({"nested": [(x for x in range(2))]})


def test_codec_segments_survive_framing() -> None:
    arr = np.arange(1 << 17, dtype=np.int64)
    segs = dumps((arr, "x"))
    dec = FrameDecoder(MAX)
    data = b"".join(bytes(p) for p in encode_frame(segs))
    frames = dec.feed(data[:1000]) + dec.feed(data[1000:])
    out_arr, tag = loads(frames[0])
    assert tag == "x"
    np.testing.assert_array_equal(out_arr, arr)


# --------------------------------------------------------------------------- live sockets


class Pinger(Actor):
    @endpoint
    def ping(self, x: int) -> int:
        return x + 1


class Evil:
    """Unpickling this creates a file: proof that a payload was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _unix_path(address: str) -> str:
    assert address.startswith("unix:"), address
    return address[len("unix:") :]


def _closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Read until EOF (or reset); True if the peer closed within ``timeout``."""
    sock.settimeout(timeout)
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def _send_all(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the peer hung up on us early: also fine


def _malicious_frames(marker: Path) -> bytes:
    env = pickle.dumps(Evil(str(marker)), protocol=5)
    return _frame_bytes([env]) + _frame_bytes([pickle.dumps((0, "x", "y", None, 0, (), (), "z")), env])


def _targets(procs: Any) -> list[str]:
    from actormesh.runtime import current_runtime

    return [current_runtime().address, procs._addresses[0]]


def test_unauthenticated_pickle_payload_is_never_unpickled(spawn_procs, tmp_path) -> None:
    procs = spawn_procs(per_host={"gpus": 1})
    pinger = procs.spawn("pinger", Pinger)
    assert pinger.ping.call_one(1).get(timeout=T) == 2
    for i, address in enumerate(_targets(procs)):
        marker = tmp_path / f"pwned-{i}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(_unix_path(address))
            _send_all(s, _malicious_frames(marker))
            assert _closed_by_peer(s), f"{address} kept an unauthenticated connection open"
        assert not marker.exists(), f"{address} unpickled an unauthenticated payload"
        assert pinger.ping.call_one(10 + i).get(timeout=T) == 11 + i
    assert not list(tmp_path.glob("pwned-*"))


def test_control_an_authenticated_peer_does_get_its_frames_unpickled(spawn_procs, tmp_path) -> None:
    """Positive control for the two tests above: with the job secret, the same
    raw-socket client gets through, so the marker file would reveal a breach."""
    from actormesh.runtime import current_runtime

    procs = spawn_procs(per_host={"gpus": 1})
    pinger = procs.spawn("pinger", Pinger)
    assert pinger.ping.call_one(1).get(timeout=T) == 2
    rt = current_runtime()
    marker = tmp_path / "control"
    me = Handshake(rt.secret, dialer=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(_unix_path(rt.address))
        _send_all(s, me.start())
        s.settimeout(10)
        while not me.done:
            chunk = s.recv(HANDSHAKE_BYTES)
            assert chunk, "listener closed during an authentic handshake"
            reply = me.receive(chunk)
            if reply:
                _send_all(s, reply)
        _send_all(s, _frame_bytes([pickle.dumps(Evil(str(marker)), protocol=5)]))
        assert _closed_by_peer(s)  # not a HELLO: dropped after unpickling
    assert marker.exists()
    assert pinger.ping.call_one(2).get(timeout=T) == 3


def test_handshake_with_magic_but_bad_proof_then_payload_is_refused(spawn_procs, tmp_path) -> None:
    """A peer that knows the protocol but not the secret gets nothing unpickled."""
    procs = spawn_procs(per_host={"gpus": 1})
    pinger = procs.spawn("pinger", Pinger)
    assert pinger.ping.call_one(1).get(timeout=T) == 2
    for i, address in enumerate(_targets(procs)):
        marker = tmp_path / f"pwned-proof-{i}"
        impostor = Handshake(b"not-the-job-secret-0123456789abc", dialer=True)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(_unix_path(address))
            _send_all(s, impostor.start())
            s.settimeout(10)
            hello = b""
            while len(hello) < HANDSHAKE_BYTES - 32:
                chunk = s.recv(HANDSHAKE_BYTES - 32 - len(hello))
                assert chunk, "listener closed before sending its hello"
                hello += chunk
            proof = impostor.receive(hello)
            _send_all(s, proof + _malicious_frames(marker))
            assert _closed_by_peer(s)
        assert not marker.exists()
        assert pinger.ping.call_one(20 + i).get(timeout=T) == 21 + i


@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"A" * 100, b"\x00" * HANDSHAKE_BYTES, os.urandom(3 * HANDSHAKE_BYTES)],
    ids=["http", "zeros", "random"],
)
def test_garbage_handshake_closes_connection_and_controller_keeps_working(spawn_procs, garbage: bytes) -> None:
    procs = spawn_procs(per_host={"gpus": 1})
    pinger = procs.spawn("pinger", Pinger)
    assert pinger.ping.call_one(1).get(timeout=T) == 2
    for address in _targets(procs):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(_unix_path(address))
            _send_all(s, garbage)
            assert _closed_by_peer(s)
        assert pinger.ping.call_one(5).get(timeout=T) == 6
    # New connections from real peers still work: a fresh proc dials the controller.
    more = spawn_procs(per_host={"gpus": 1}).spawn("pinger2", Pinger)
    assert more.ping.call_one(7).get(timeout=T) == 8


def test_many_bad_connections_at_once_do_not_disturb_the_controller(spawn_procs) -> None:
    procs = spawn_procs(per_host={"gpus": 1})
    pinger = procs.spawn("pinger", Pinger)
    from actormesh.runtime import current_runtime

    path = _unix_path(current_runtime().address)
    socks = []
    try:
        for i in range(20):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            socks.append(s)
            if i % 2:
                _send_all(s, b"\xff" * HANDSHAKE_BYTES)
        # Half of them are silent (waiting out the handshake timeout); calls flow meanwhile.
        assert [pinger.ping.call_one(i).get(timeout=T) for i in range(10)] == list(range(1, 11))
        for s in socks[1::2]:
            assert _closed_by_peer(s)
    finally:
        for s in socks:
            s.close()


def test_a_dialer_waits_for_a_slow_server_within_its_connect_budget(tmp_path: Path) -> None:
    """The handshake deadline protects listeners; a dialer waits for a slow server
    (an agent busy starting many procs) up to its connect timeout, and gives up after it."""
    import asyncio

    from actormesh.transport import connect

    secret = os.urandom(32)

    async def scenario(delay: float, timeout: float) -> Any:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(delay)  # busy: answers late
            server = Handshake(secret, dialer=False)
            writer.write(server.start())
            while not server.done:
                chunk = await reader.read(HANDSHAKE_BYTES)
                if not chunk:
                    return
                reply = server.receive(chunk)
                if reply:
                    writer.write(reply)
            await writer.drain()
            await reader.read()  # hold the connection until the client goes

        path = str(tmp_path / f"slow-{delay}.sock")
        server = await asyncio.start_unix_server(serve, path)
        try:
            conn = await connect(f"unix:{path}", secret, on_frame=lambda c, f: None, on_close=lambda c, e: None,
                                 max_frame_bytes=1 << 20, handshake_timeout_s=0.2, timeout_s=timeout)
            conn.close()
            return conn
        finally:
            server.close()

    assert asyncio.run(scenario(delay=0.6, timeout=5.0)).ready.done()
    with pytest.raises(TransportError, match="could not connect"):
        asyncio.run(scenario(delay=3.0, timeout=0.8))
