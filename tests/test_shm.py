"""Large message buffers through shared memory (transport/_shm.py): every byte,
reuse without corruption, copy-on-write isolation, validation of what a peer
announces, and the same across real procs (threshold, snapshot semantics,
sender killed while the receiver still holds the data)."""

from __future__ import annotations

import ctypes
import os
import signal
import struct
import zlib
from typing import Any

import pytest

from actormesh import config
from actormesh.actor import Actor, endpoint, this_host
from actormesh.transport import FrameDecoder, ShmError, ShmPool, encode_frame
from actormesh.transport import _shm
from actormesh.transport._frames import FLAG_SHM, ShmFrame
from actormesh.errors import ProtocolError

MiB = 1 << 20


def _pattern(n: int, seed: int = 0) -> bytearray:
    data = bytearray(os.urandom(64)) * (n // 64 + 1)
    data[: min(n, 8)] = seed.to_bytes(8, "little")[: min(n, 8)]
    return data[:n]


def _send(pool: ShmPool, segments: list[Any]) -> list[Any]:
    """Export like a sender, import like its receiver (both this process)."""
    exported = pool.export(segments, "conn")
    assert exported is not None
    manifest, placeholders = exported
    return ShmPool.import_frame(manifest, placeholders, os.getpid())


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def pool() -> Any:
    p = ShmPool(threshold=4096, max_free_bytes=256 * MiB)
    yield p
    p.close()


# -- one process: the pool and the mapper ------------------------------------------------


@pytest.mark.parametrize("n", [4096, 4097, 65535, 1 * MiB + 3, 3 * MiB - 1])
@pytest.mark.parametrize("offset", [0, 1, 7, 4093])
def test_every_byte_arrives_for_odd_sizes_and_offsets(pool: ShmPool, n: int, offset: int) -> None:
    backing = _pattern(n + offset + 5, seed=n)
    src = memoryview(backing)[offset : offset + n]
    out = _send(pool, [b"envelope", b"small", src])
    assert out[0] == b"envelope" and out[1] == b"small"  # below the threshold: untouched
    assert out[2].nbytes == n and not out[2].readonly
    assert zlib.crc32(out[2]) == zlib.crc32(src)


def test_readonly_sources_are_copied_too(pool: ShmPool) -> None:
    data = bytes(_pattern(10_000))
    out = _send(pool, [b"e", data])
    assert bytes(out[1]) == data


def test_segments_are_reused_only_after_the_receiver_let_go(pool: ShmPool) -> None:
    first = _send(pool, [b"e", _pattern(2 * MiB, seed=1)])
    held = first[1]
    crc_held = zlib.crc32(held)
    # While the receiver holds its buffer, further sends must not touch that segment.
    for seed in range(2, 6):
        out = _send(pool, [b"e", _pattern(2 * MiB, seed=seed)])
        del out
    assert zlib.crc32(held) == crc_held
    created = pool.created
    assert created == 2  # one held, one recycled for every later send
    del first, held
    # Both are free now: sends reuse them, nothing new is created.
    for seed in range(6, 10):
        out = _send(pool, [b"e", _pattern(2 * MiB, seed=seed)])
        assert out[1][:8] == seed.to_bytes(8, "little")
        del out
    assert pool.created == created


def test_receiver_writes_stay_private(pool: ShmPool) -> None:
    src = _pattern(1 * MiB, seed=3)
    a = _send(pool, [b"e", src])[1]
    b = ShmPool.import_frame  # noqa: F841  (keep the API referenced)
    a[:4] = b"\xff\xff\xff\xff"
    # The sender's segment still has the original bytes: a second receiver of the same
    # segment (after release) or the sender itself never sees the write.
    seg = next(s for s in pool._segments if s.channel is not None)
    assert bytes((ctypes.c_char * 4).from_address(seg.addr)) == bytes(src[:4])
    assert bytes(a[4:]) == bytes(src[4:])


def test_sender_may_change_its_buffer_right_after_send(pool: ShmPool) -> None:
    src = _pattern(1 * MiB, seed=4)
    exported = pool.export([b"e", src], "conn")
    assert exported is not None
    expected = zlib.crc32(src)
    src[:] = bytes(len(src))  # the caller reuses its memory at once
    out = ShmPool.import_frame(exported[0], exported[1], os.getpid())
    assert zlib.crc32(out[1]) == expected


def test_below_threshold_or_disabled_nothing_is_exported() -> None:
    p = ShmPool(threshold=MiB, max_free_bytes=MiB)
    try:
        assert p.export([b"e", bytes(MiB - 1)], "c") is None
        p.close()
        assert p.export([b"e", bytes(MiB)], "c") is None  # closed pools fall back to the socket
    finally:
        p.close()


def test_idle_bytes_are_bounded() -> None:
    p = ShmPool(threshold=4096, max_free_bytes=4 * MiB)
    try:
        held = [_send(p, [b"e", bytes(2 * MiB + k)])[1] for k in range(6)]
        del held  # six free 4 MiB segments now, twice the cap
        _send(p, [b"e", bytes(4096)])
        free = [s for s in p._segments if s.channel is None]
        assert sum(s.capacity for s in free) <= 4 * MiB
    finally:
        p.close()


def test_lent_segments_and_descriptors_are_bounded(monkeypatch: pytest.MonkeyPatch, pool: ShmPool) -> None:
    monkeypatch.setattr(_shm, "_MAX_LENT", 8)
    before = _fds()
    held = [_send(pool, [b"e", bytes(8192)])[1] for _ in range(40)]
    assert len(pool._segments) <= 8 + 2
    assert _fds() - before <= 8 + 2
    assert all(h.nbytes == 8192 for h in held)  # receivers keep their data


def test_forget_drops_what_a_closed_connection_borrowed(pool: ShmPool) -> None:
    exported = pool.export([b"e", bytes(8192)], "dead-conn")
    assert exported is not None
    pool.forget("dead-conn")
    assert not pool._segments
    with pytest.raises(ShmError, match="cannot"):  # its receiver can no longer open it
        ShmPool.import_frame(exported[0], exported[1], os.getpid())


# -- what a peer announces is checked ---------------------------------------------------------


def _manifest(pool: ShmPool) -> tuple[bytes, list[Any], tuple[int, ...]]:
    exported = pool.export([b"e", bytes(8192)], "c")
    assert exported is not None
    manifest, segs = exported
    entry = struct.unpack_from("<HIQQQ", manifest, 4)
    return manifest, segs, entry


def _with(entry: tuple[int, ...], **change: int) -> bytes:
    names = ("index", "fd", "capacity", "nbytes", "token")
    values = dict(zip(names, entry))
    values.update(change)
    return struct.pack("<I", 1) + struct.pack("<HIQQQ", *(values[k] for k in names))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(token=8), "stale"),
        (dict(token=9), "inconsistent"),
        (dict(nbytes=0), "inconsistent"),
        (dict(nbytes=1 << 40), "inconsistent"),
        (dict(capacity=4096 * 9), "not the announced"),
        (dict(index=0), "not a placeholder"),
        (dict(index=7), "not a placeholder"),
        (dict(fd=0), "not the announced|cannot"),
    ],
)
def test_bad_manifest_entries_raise_shm_error(pool: ShmPool, change: dict[str, int], message: str) -> None:
    _, segs, entry = _manifest(pool)
    with pytest.raises(ShmError, match=message):
        ShmPool.import_frame(_with(entry, **change), segs, os.getpid())


def test_bad_manifests_raise_shm_error(pool: ShmPool) -> None:
    manifest, segs, _ = _manifest(pool)
    for bad in (b"", manifest[:-1], struct.pack("<I", 0)):
        with pytest.raises(ShmError):
            ShmPool.import_frame(bad, segs, os.getpid())
    with pytest.raises(ShmError, match="pid"):
        ShmPool.import_frame(manifest, segs, 0)


def test_unsealed_files_are_refused(pool: ShmPool) -> None:
    _, segs, entry = _manifest(pool)
    fd = os.memfd_create("plain", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, entry[2] + 4096)
        with pytest.raises(ShmError, match="sealed"):
            ShmPool.import_frame(_with(entry, fd=fd), segs, os.getpid())
    finally:
        os.close(fd)


def test_frame_flags() -> None:
    dec = FrameDecoder(1 << 20)
    frames = dec.feed(b"".join(encode_frame([b"m", b"env", b""], FLAG_SHM)) + b"".join(encode_frame([b"x", b"y"])))
    assert type(frames[0]) is ShmFrame and list(frames[0]) == [b"m", b"env", b""]
    assert type(frames[1]) is list
    bad = bytearray(b"".join(encode_frame([b"a"])))
    bad[10] = 0x80  # an unknown flag
    with pytest.raises(ProtocolError, match="flags"):
        FrameDecoder(1 << 20).feed(bytes(bad))


# -- across procs --------------------------------------------------------------------------


class Keeper(Actor):
    """Receives big buffers, checks, keeps or modifies them."""

    def __init__(self) -> None:
        self.kept: list[Any] = []

    @endpoint
    def crc(self, data: Any) -> int:
        return zlib.crc32(memoryview(data).cast("B"))

    @endpoint
    def scribble_crc(self, data: bytearray) -> int:
        data[:8] = b"\x00" * 8  # a received buffer is the receiver's to modify
        return zlib.crc32(data)

    @endpoint
    def echo(self, data: Any) -> Any:
        return data

    @endpoint
    def make(self, n: int, seed: int) -> bytearray:
        return _pattern(n, seed)

    @endpoint
    def shm_stats(self) -> tuple[int, int]:
        from actormesh.runtime._context import current_runtime

        rt = current_runtime()
        return rt.shm.sent, rt.shm.created

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _controller_shm() -> Any:
    from actormesh.runtime._context import current_runtime

    return current_runtime().shm


@pytest.mark.timeout(60)
def test_big_arguments_and_results_cross_procs_through_shared_memory() -> None:
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        k = procs.spawn("keeper", Keeper)
        sent0 = _controller_shm().sent
        for n in (MiB, MiB + 1, 5 * MiB + 17):
            data = _pattern(n, seed=n)
            assert k.crc.call_one(data).get(timeout=30) == zlib.crc32(data)
            back = k.echo.call_one(data).get(timeout=30)
            assert zlib.crc32(back) == zlib.crc32(data)
        assert _controller_shm().sent - sent0 == 6
        assert k.shm_stats.call_one().get(timeout=10)[0] == 3
        # Modifying a received buffer changes nothing at the sender.
        data = _pattern(2 * MiB, seed=7)
        crc = zlib.crc32(data)
        scribbled = bytearray(data)
        scribbled[:8] = bytes(8)
        assert k.scribble_crc.call_one(data).get(timeout=30) == zlib.crc32(scribbled)
        assert zlib.crc32(data) == crc
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.timeout(60)
def test_tensors_and_arrays_roundtrip_through_shared_memory() -> None:
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        k = procs.spawn("keeper", Keeper)
        t = torch.randn(3, 1000, 333)  # ~4 MB, odd shape
        a = np.arange(2_000_001, dtype=np.int64)
        t2, a2 = k.echo.call_one((t, a)).get(timeout=30)
        assert torch.equal(t, t2) and np.array_equal(a, a2)
        t2.add_(1)  # received tensors are writable and private
        assert not torch.equal(t, t2)
        assert _controller_shm().sent >= 2
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.timeout(60)
def test_threshold_zero_keeps_everything_on_the_socket() -> None:
    with config.configured(shm_threshold_bytes=0):
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        try:
            k = procs.spawn("keeper", Keeper)
            data = _pattern(3 * MiB, seed=2)
            assert zlib.crc32(k.echo.call_one(data).get(timeout=30)) == zlib.crc32(data)
            assert k.shm_stats.call_one().get(timeout=10) == (0, 0)
        finally:
            procs.stop().get(timeout=30)


@pytest.mark.timeout(60)
def test_data_outlives_a_sender_killed_after_sending() -> None:
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        k = procs.spawn("keeper", Keeper)
        data = k.make.call_one(4 * MiB, 11).get(timeout=30)
        crc = zlib.crc32(data)
        os.kill(k.pid.call_one().get(timeout=10), signal.SIGKILL)
        procs.stop().get(timeout=30)
        assert zlib.crc32(data) == crc and data[:8] == (11).to_bytes(8, "little")
    finally:
        procs.stop().get(timeout=30)


def test_config_rejects_negative_threshold() -> None:
    from actormesh.errors import ConfigError

    with pytest.raises(ConfigError, match="shm_threshold_bytes"):
        config.configure(shm_threshold_bytes=-1)
    with pytest.raises(ConfigError, match="shm_pool_bytes"):
        config.configure(shm_pool_bytes=0)


@pytest.mark.timeout(60)
def test_an_unmappable_segment_closes_only_that_connection() -> None:
    """An authenticated peer announcing a segment the receiver cannot map (here: an
    unsealed memfd) loses its connection; the receiver keeps serving everyone else."""
    import socket

    from actormesh.runtime._context import current_runtime
    from actormesh.transport import HANDSHAKE_BYTES, Handshake

    procs = this_host().spawn_procs(per_host={"gpus": 1})
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    try:
        k = procs.spawn("keeper", Keeper)
        assert k.crc.call_one(b"warm").get(timeout=30) == zlib.crc32(b"warm")
        os.ftruncate(fd, 2 * 4096)
        manifest = struct.pack("<I", 1) + struct.pack("<HIQQQ", 1, fd, 4096, 100, 4)
        frame = b"".join(bytes(p) for p in encode_frame([manifest, b"env", b""], FLAG_SHM))
        rt = current_runtime()
        for address in (rt.address, procs._addresses[0]):
            me = Handshake(rt.secret, dialer=True)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(address[len("unix:"):])
                s.sendall(me.start())
                s.settimeout(10)
                while not me.done:
                    chunk = s.recv(HANDSHAKE_BYTES)
                    assert chunk, "closed during an authentic handshake"
                    reply = me.receive(chunk)
                    if reply:
                        s.sendall(reply)
                s.sendall(frame)
                assert s.recv(4096) == b"", f"{address} kept the connection open"
            assert k.crc.call_one(b"still").get(timeout=30) == zlib.crc32(b"still")
    finally:
        os.close(fd)
        procs.stop().get(timeout=30)


def test_non_contiguous_segments_stay_on_the_socket(pool: ShmPool) -> None:
    strided = memoryview(bytearray(3 * 8192)).cast("B")[::3]
    assert pool.export([b"e", strided], "c") is None
