"""RDMA buffers: every byte checked (CRC) over every backend, with real procs.

Backends are forced with ``ACTORMESH_RDMA_BACKEND`` (set before procs are
spawned, so workers inherit it). Small chunks (``ACTORMESH_RDMA_CHUNK_BYTES``)
make even modest buffers cross many chunk boundaries at odd places.
"""

from __future__ import annotations

import errno
import os
import pickle
import socket
import threading
import time
import zlib
from typing import Any

import psutil
import pytest
import torch

import actormesh.rdma._backends as backends
from actormesh.actor import Actor, endpoint
from actormesh.errors import AuthenticationError
from actormesh.rdma import BufferDroppedError, RDMAAction, RDMABuffer, get_rdma_backend, is_rdma_available, same_host_backend
from actormesh.rdma import _wire as W
from actormesh.rdma._registry import registry
from conftest import wait_for

BACKENDS = ["vm", "shm", "tcp"]


def rand_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def crc(mem: Any) -> int:
    if isinstance(mem, torch.Tensor):
        mem = mem.view(torch.uint8).numpy()
    return zlib.crc32(mem)


class Owner(Actor):
    """Owns buffers of random bytes; reads and writes others' buffers on request."""

    def __init__(self) -> None:
        self.mem: dict[str, Any] = {}
        self.bufs: dict[str, RDMABuffer] = {}

    @endpoint
    def make(self, key: str, nbytes: int, offset: int = 0, seed: int = 0, shared: bool = False, kind: str = "tensor") -> RDMABuffer:
        base = rand_bytes(nbytes + offset + 5, seed) if kind != "zeros" else torch.zeros(nbytes + offset + 5, dtype=torch.uint8)
        if shared:
            base.share_memory_()
        view: Any = base[offset : offset + nbytes]
        if kind == "memoryview":
            view = memoryview(bytearray(view.numpy().tobytes()))
        self.mem[key] = view
        self.bufs[key] = RDMABuffer(view)
        return self.bufs[key]

    @endpoint
    def crc(self, key: str) -> int:
        return crc(self.mem[key])

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def registrations(self) -> int:
        return len(registry)

    @endpoint
    def drop(self, key: str) -> None:
        self.bufs[key].drop().get(timeout=10)

    @endpoint
    def read(self, buf: RDMABuffer) -> tuple[int, str]:
        dst = torch.empty(buf.size() + 3, dtype=torch.uint8)[3:]  # odd offset on this side too
        buf.read_into(dst).get(timeout=20)
        return crc(dst), buf.backend

    @endpoint
    def write(self, buf: RDMABuffer, nbytes: int, seed: int) -> int:
        src = rand_bytes(nbytes, seed)
        buf.write_from(src).get(timeout=20)
        return crc(src)


@pytest.fixture(autouse=True)
def no_leaked_shm() -> Any:
    """No test may leave a name in /dev/shm behind."""
    before = set(os.listdir("/dev/shm"))
    yield
    wait_for(lambda: set(os.listdir("/dev/shm")) <= before, timeout=5)


def owner(spawn_procs: Any, n: int = 1) -> Any:
    return spawn_procs(per_host={"gpus": n}).spawn("owner", Owner)


# -- API, no procs ------------------------------------------------------------------------------


def test_handle_is_small_picklable_and_local_transfers_work():
    t = torch.arange(1000, dtype=torch.float32)
    buf = RDMABuffer(t)
    assert is_rdma_available() and same_host_backend() in ("vm", "shm")
    assert get_rdma_backend() == "tcp"  # Monarch's category: no ibverbs
    data = pickle.dumps(buf)
    assert len(data) < 1024
    copy = pickle.loads(data)
    assert copy.size() == buf.size() == 4000 and copy.owner == buf.owner
    dst = torch.zeros(1000)
    copy.read_into(dst).get(timeout=5)
    assert torch.equal(dst, t) and copy.backend == "local"
    buf.write_from(torch.full((10,), 7.0)).get(timeout=5)
    assert t[:10].eq(7).all() and t[10] == 10
    buf.drop().get(timeout=5)
    buf.drop().get(timeout=5)  # idempotent
    with pytest.raises(BufferDroppedError, match="dropped"):
        buf.read_into(dst).get(timeout=5)
    with pytest.raises(BufferDroppedError, match="dropped"):
        copy.read_into(dst).get(timeout=5)


def test_bad_arguments_raise_value_errors_naming_the_problem():
    with pytest.raises(ValueError, match="size 0"):
        RDMABuffer(torch.empty(0))
    with pytest.raises(ValueError, match="contiguous"):
        RDMABuffer(torch.arange(10)[::2])
    with pytest.raises(ValueError, match="1-D"):
        RDMABuffer(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="contiguous"):
        RDMABuffer(memoryview(bytearray(10))[::2])
    with pytest.raises(TypeError, match="memoryview"):
        RDMABuffer(12)
    buf = RDMABuffer(torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="too small"):
        buf.read_into(torch.zeros(15, dtype=torch.uint8))
    with pytest.raises(ValueError, match="too large"):
        buf.write_from(torch.zeros(17, dtype=torch.uint8))
    with pytest.raises(ValueError, match="read-only"):
        buf.read_into(memoryview(bytes(16)))
    with pytest.raises(ValueError, match="timeout"):
        buf.read_into(torch.zeros(16, dtype=torch.uint8), timeout=0)
    ro = RDMABuffer(memoryview(b"x" * 8))
    with pytest.raises(ValueError, match="read-only"):
        ro.write_from(memoryview(bytearray(8)))
    with pytest.raises(ValueError, match="overlaps"):
        dst = torch.zeros(16, dtype=torch.uint8)
        RDMAAction().read_into(buf, dst).write_from(buf, dst)
    for b in (buf, ro):
        b.drop().get(timeout=5)


# -- every byte, every backend --------------------------------------------------------------------


def use(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """Force this process's transfers onto ``backend``, in small odd-sized chunks."""
    monkeypatch.setenv("ACTORMESH_RDMA_BACKEND", backend)
    monkeypatch.setenv("ACTORMESH_RDMA_CHUNK_BYTES", str(64 * 1024 + 3))


def test_every_byte_at_odd_sizes_and_offsets_over_every_backend(spawn_procs, monkeypatch):
    """The owner's bulk server listens on 127.0.0.2: the tcp transfers cross two addresses."""
    monkeypatch.setenv("ACTORMESH_RDMA_BIND_HOST", "127.0.0.2")  # inherited by the owner's proc
    o = owner(spawn_procs)
    cases = [(1, 0), (4097, 1), (300_001, 3), ((1 << 20) + 7, 5)]
    for b, backend in enumerate(BACKENDS):
        use(monkeypatch, backend)
        for i, (nbytes, offset) in enumerate(cases):
            key, seed = f"{backend}{i}", 10 * b + i
            original = rand_bytes(nbytes + offset + 5, seed)[offset : offset + nbytes]
            buf = o.make.call_one(key, nbytes, offset, seed=seed).get(timeout=30)
            assert buf.size() == nbytes
            dst = torch.zeros(nbytes + 9, dtype=torch.uint8)[offset + 1 : offset + 1 + nbytes + 2]  # odd start, room to spare
            buf.read_into(dst).get(timeout=20)
            assert buf.backend == backend
            assert crc(dst[:nbytes]) == crc(original) == o.crc.call_one(key).get(timeout=10)
            assert dst[nbytes:].eq(0).all()  # nothing written past the buffer's size
            src = rand_bytes(nbytes - nbytes // 3, 100 + seed)  # a shorter source writes a prefix
            buf.write_from(src).get(timeout=20)
            assert o.crc.call_one(key).get(timeout=10) == crc(torch.cat([src, original[len(src) :]]))
    assert buf._handle.tcp[0] == "127.0.0.2"
    conns = psutil.Process(o.pid.call_one().get(timeout=10)).net_connections("tcp")
    assert any(c.laddr and c.laddr.ip == "127.0.0.2" and c.raddr for c in conns), "no stream through 127.0.0.2"
    # a peer without the job secret is refused before any request is read; the owner is fine
    with socket.create_connection(buf._handle.tcp, timeout=5) as sock:
        with pytest.raises((AuthenticationError, ConnectionError)):
            W.handshake(sock, b"not the job secret!!", dialer=True, deadline=time.monotonic() + 5)
    assert o.crc.call_one(key).get(timeout=10) == crc(torch.cat([src, original[len(src) :]]))


def test_shared_memory_tensors_memoryviews_and_the_vm_fallback(spawn_procs, monkeypatch):
    from actormesh.rdma._client import _shm_backend

    o = owner(spawn_procs)
    for backend in ("shm", "vm"):
        use(monkeypatch, backend)
        for key, shared, kind in (("shared", True, "tensor"), ("mv", False, "memoryview")):
            buf = o.make.call_one(key, 200_003, 7, seed=9, shared=shared, kind=kind).get(timeout=30)
            dst = memoryview(bytearray(200_003))
            buf.read_into(dst).get(timeout=20)
            assert crc(dst) == o.crc.call_one(key).get(timeout=10)
            src = memoryview(bytes(rand_bytes(200_003, 11).numpy()))  # read-only sources are fine
            buf.write_from(src).get(timeout=20)
            assert o.crc.call_one(key).get(timeout=10) == crc(src)
            assert buf.backend == backend
        if backend == "shm":  # the shared tensor was mapped directly, not staged
            assert any(m is not None for m in _shm_backend._maps.values())

    # process_vm access refused (Yama, another user): auto falls back to shared memory
    monkeypatch.setenv("ACTORMESH_RDMA_BACKEND", "auto")
    buf = o.make.call_one("p", 100_000, seed=8).get(timeout=30)

    def denied(pid: int, *a: Any, **k: Any) -> Any:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(backends, "vm_copy", denied)
    monkeypatch.setattr(backends, "vm_read_u64", denied)
    try:
        dst = torch.empty(100_000, dtype=torch.uint8)
        buf.read_into(dst).get(timeout=20)
        assert buf.backend == "shm" and crc(dst) == o.crc.call_one("p").get(timeout=10)
    finally:
        backends.BACKENDS["vm"].denied.clear()  # type: ignore[attr-defined]


def test_handles_pass_between_actors(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2}).spawn("owner", Owner)
    a, b = procs.slice(gpus=0), procs.slice(gpus=1)
    buf = a.make.call_one("x", 1_000_003, 1, seed=3).get(timeout=30)
    got, used = b.read.call_one(buf).get(timeout=30)
    assert got == a.crc.call_one("x").get(timeout=10) and used == "vm"
    written = b.write.call_one(buf, 999_999, 5).get(timeout=30)
    expected = torch.cat([rand_bytes(999_999, 5), rand_bytes(1_000_003 + 6, 3)[1 + 999_999 : 1 + 1_000_003]])
    assert written == crc(rand_bytes(999_999, 5)) and a.crc.call_one("x").get(timeout=10) == crc(expected)
    mine = torch.arange(5000, dtype=torch.int64)  # the controller's own memory, read by a worker
    got, _ = b.read.call_one(RDMABuffer(mine)).get(timeout=30)
    assert got == crc(mine)
    # a batch over two owners: same-owner operations run in order
    ba = a.make.call_one("a", 12345, seed=1).get(timeout=30)
    bb = b.make.call_one("b", 54321, seed=2).get(timeout=30)
    da, db = torch.empty(12345, dtype=torch.uint8), torch.empty(54321, dtype=torch.uint8)
    src = rand_bytes(100, 3)
    RDMAAction().read_into(ba, da).read_into(bb, db).write_from(bb, src).submit().get(timeout=30)
    assert crc(da) == a.crc.call_one("a").get(timeout=10)
    assert crc(db) == crc(rand_bytes(54321 + 5, 2)[:54321])  # the read ran before the write
    assert b.crc.call_one("b").get(timeout=10) == crc(torch.cat([src, db[100:]]))
    with pytest.raises(NotImplementedError):
        RDMAAction().fetch_add(ba, da, 1)


# -- concurrency -----------------------------------------------------------------------------------


def test_concurrent_readers_and_a_writer_racing_without_locking(spawn_procs, monkeypatch):
    """Many readers over every backend at once get every byte. A write racing reads is
    not locked out (as in Monarch): each byte read comes from some write, never garbage,
    and nothing hangs. Order transfers with messages when it matters."""
    monkeypatch.setenv("ACTORMESH_RDMA_CHUNK_BYTES", str(32 * 1024))
    mesh = spawn_procs(per_host={"gpus": 2}).spawn("owner", Owner)
    o, reader = mesh.slice(gpus=0), mesh.slice(gpus=1)
    buf = o.make.call_one("c", 2_000_001, seed=21).get(timeout=30)
    expected = o.crc.call_one("c").get(timeout=10)
    futs = []
    for be in BACKENDS:  # three backends at once, several transfers each
        monkeypatch.setenv("ACTORMESH_RDMA_BACKEND", be)
        dsts = [torch.empty(2_000_001, dtype=torch.uint8) for _ in range(3)]
        futs += [(buf.read_into(d), d) for d in dsts]
    remote = reader.read.call_one(buf)
    for fut, d in futs:
        fut.get(timeout=30)
        assert crc(d) == expected
    assert remote.get(timeout=30)[0] == expected

    monkeypatch.setenv("ACTORMESH_RDMA_BACKEND", "auto")
    buf.write_from(torch.full((2_000_001,), 0xAA, dtype=torch.uint8)).get(timeout=10)
    patterns = [torch.full((2_000_001,), v, dtype=torch.uint8) for v in (0xAA, 0x55)]
    writes = [buf.write_from(patterns[i % 2]) for i in range(16)]
    dsts = [torch.empty(2_000_001, dtype=torch.uint8) for _ in range(16)]
    reads = [buf.read_into(d) for d in dsts]
    for f in writes + reads:
        f.get(timeout=30)
    for d in dsts:
        assert ((d == 0xAA) | (d == 0x55)).all()


def test_transfer_threads_are_reused_not_accumulated():
    buf = RDMABuffer(torch.zeros(2 << 20, dtype=torch.uint8))  # above the inline size: a thread copies
    dst = torch.zeros(2 << 20, dtype=torch.uint8)
    buf.read_into(dst).get(timeout=5)
    before = threading.active_count()
    for _ in range(50):
        buf.read_into(dst).get(timeout=5)
    assert threading.active_count() <= before + 1
    buf.drop().get(timeout=5)
