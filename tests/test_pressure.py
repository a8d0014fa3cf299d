"""Under pressure a message fails, never the process.

Real worker processes: one whose descriptor table is full, one whose memory
mappings fail (simulated inside that worker by patching the mapping call), one
flooded with 1,000 connections that never authenticate (on its actor listener
and on its RDMA bulk server). Each keeps serving; the caller of the one message
that could not be taken in gets an error naming the resource. And a remote
``MemoryError`` (or any builtin with its own ``__new__``) reaches the caller
as both ``ActorError`` and the original class.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
import threading
from typing import Any

import pytest

from actormesh.actor import Actor, endpoint
from actormesh.errors import ActorError, ResourceExhaustedError, make_actor_error

T = 60
BIG = 4 << 20  # above the default shm_threshold_bytes (1 MiB): travels through shared memory
FLOOD = 1000


class Pressure(Actor):
    """Puts its own process under pressure on request."""

    def __init__(self) -> None:
        self.fillers: list[int] = []
        self.saved_limit: tuple[int, int] | None = None
        self.patched: Any = None
        self.rdma: Any = None

    @endpoint
    def take(self, data: bytes) -> int:
        return len(data)

    @endpoint
    def ping(self) -> int:
        return os.getpid()

    @endpoint
    def fill_fds(self) -> int:
        """Lower RLIMIT_NOFILE close to what is open, then open files until EMFILE."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.saved_limit = (soft, hard)
        highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 32, hard))
        while True:
            try:
                self.fillers.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                return len(self.fillers)

    @endpoint
    def release_fds(self) -> None:
        for fd in self.fillers:
            os.close(fd)
        self.fillers.clear()
        if self.saved_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, self.saved_limit)

    @endpoint
    def fail_mappings(self, how: str) -> None:
        """Make every shared-memory mapping in this process fail (ENOMEM or MemoryError)."""
        from actormesh.transport import _shm

        self.patched = _shm._map

        def failing(*args: Any) -> int:
            if how == "enomem":
                raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
            raise MemoryError()

        _shm._map = failing

    @endpoint
    def fail_allocations(self) -> None:
        """Make the receive buffer of every large inline frame fail to allocate."""
        from actormesh.transport import _frames

        self.patched_alloc = _frames._alloc

        def failing(nbytes: int, *kind: int) -> bytearray:
            raise MemoryError()

        _frames._alloc = failing

    @endpoint
    def restore_allocations(self) -> None:
        from actormesh.transport import _frames

        _frames._alloc = self.patched_alloc

    @endpoint
    def restore_mappings(self) -> None:
        from actormesh.transport import _shm

        _shm._map = self.patched

    @endpoint
    def listener(self) -> tuple[str, int]:
        """This proc's address and how many of its connections wait in the handshake."""
        from actormesh.runtime import current_runtime

        rt = current_runtime()
        return rt.address, len(rt._listener.gate)

    @endpoint
    def fd_count(self) -> int:
        return len(os.listdir("/proc/self/fd"))

    @endpoint
    def rdma_server(self) -> Any:
        """Register a buffer (starting the bulk server); return its handle."""
        import torch

        from actormesh.rdma import RDMABuffer

        self.mem = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
        self.rdma = RDMABuffer(self.mem)
        return self.rdma

    @endpoint
    def thread_count(self) -> int:
        return threading.active_count()

    @endpoint
    def raise_memory_error(self) -> None:
        raise MemoryError("asked for too much")


@pytest.fixture(scope="module")
def worker() -> Any:
    import dataclasses

    from actormesh.runtime import current_runtime
    from conftest import module_procs

    # A flood keeps the worker's loop busy on a loaded machine: the spawner's
    # 3 s silence rule (issue 10, liveness) must not kill it for that here.
    rt = current_runtime()
    saved = rt.config
    rt.config = dataclasses.replace(saved, heartbeat_timeout=max(saved.heartbeat_timeout, 30.0))
    try:
        for pm in module_procs({"gpus": 1}):
            yield pm.spawn("pressure", Pressure)
    finally:
        rt.config = saved


# -- a remote MemoryError and other builtins with their own __new__ ----------------------------

BUILTINS = [
    MemoryError("big"),
    KeyError("k"),
    OSError(errno.EIO, "io"),
    FileNotFoundError(errno.ENOENT, "gone", "/x"),
    PermissionError(errno.EACCES, "no"),
    ConnectionResetError(errno.ECONNRESET, "reset"),
    BlockingIOError(errno.EAGAIN, "again"),
    TimeoutError("late"),
    UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte"),
    StopIteration(3),
    RecursionError("deep"),
    SystemExit(3),
    KeyboardInterrupt(),
    ExceptionGroup("several", [ValueError(1)]),
]


@pytest.mark.parametrize("exc", BUILTINS, ids=lambda e: type(e).__name__)
def test_builtin_exceptions_become_actor_errors_of_their_class(exc):
    err = make_actor_error(exc, "Actor call f failed.", "Traceback: ...")
    assert isinstance(err, ActorError)
    assert err.exception is exc
    assert err.args == exc.args
    if not isinstance(exc, BaseExceptionGroup):  # its read-only .message clashes with ours
        assert isinstance(err, type(exc))
    for field in ("errno", "strerror", "filename", "value", "code", "reason", "start"):
        if hasattr(exc, field):
            assert getattr(err, field) == getattr(exc, field), field


def test_a_remote_memory_error_is_caught_as_memory_error_and_actor_error(worker):
    with pytest.raises(MemoryError) as info:
        worker.raise_memory_error.call_one().get(timeout=T)
    assert isinstance(info.value, ActorError)
    assert "asked for too much" in str(info.value)
    assert worker.ping.call_one().get(timeout=T)


# -- resource exhaustion fails one message -----------------------------------------------------

def test_a_full_descriptor_table_fails_the_one_message_not_the_worker(worker):
    pid = worker.ping.call_one().get(timeout=T)
    try:
        assert worker.fill_fds.call_one().get(timeout=T) > 0
        with pytest.raises(ResourceExhaustedError) as info:
            worker.take.call_one(bytes(BIG)).get(timeout=T)
        text = str(info.value)
        assert "file descriptors" in text and "RLIMIT_NOFILE=" in text and "raise the limit" in text, text
        assert info.value.resource == "file descriptors"
        assert worker.ping.call_one().get(timeout=T) == pid  # same process, still serving
    finally:
        worker.release_fds.call_one().get(timeout=T)
    assert worker.take.call_one(bytes(BIG)).get(timeout=T) == BIG


@pytest.mark.parametrize("how", ["enomem", "memory_error"])
def test_a_failed_mapping_fails_the_one_message_not_the_worker(worker, how):
    pid = worker.ping.call_one().get(timeout=T)
    worker.fail_mappings.call_one(how).get(timeout=T)
    try:
        futures = [worker.take.call_one(bytes(BIG)) for _ in range(3)]
        after = worker.ping.call_one()  # sent after them: must not wait for a gap to time out
        for fut in futures:
            with pytest.raises(ResourceExhaustedError) as info:
                fut.get(timeout=T)
            assert "ran out of memory" in str(info.value) and info.value.resource == "memory"
        assert after.get(timeout=T) == pid
    finally:
        worker.restore_mappings.call_one().get(timeout=T)
    assert worker.take.call_one(bytes(BIG)).get(timeout=T) == BIG


def test_a_large_inline_message_without_memory_fails_alone(worker, monkeypatch):
    from actormesh.runtime import current_runtime

    monkeypatch.setattr(current_runtime().shm, "threshold", 0)  # our big arguments go over the socket
    pid = worker.ping.call_one().get(timeout=T)
    worker.fail_allocations.call_one().get(timeout=T)
    try:
        failed = worker.take.call_one(bytes(BIG))
        after = worker.take.call_one(b"small")
        with pytest.raises(ResourceExhaustedError) as info:
            failed.get(timeout=T)
        assert "ran out of memory while receiving a " in str(info.value) and info.value.resource == "memory"
        assert after.get(timeout=T) == 5
        assert worker.ping.call_one().get(timeout=T) == pid
    finally:
        worker.restore_allocations.call_one().get(timeout=T)
    assert worker.take.call_one(bytes(BIG)).get(timeout=T) == BIG


def test_the_decoder_skips_a_frame_it_has_no_memory_for_and_goes_on(monkeypatch):
    from actormesh.transport import _frames

    def failing(nbytes: int, *kind: int) -> bytearray:
        raise MemoryError()

    wire = b"".join(bytes(p) for p in _frames.encode_frame([b"envelope", bytes(300_000)]))
    wire += b"".join(bytes(p) for p in _frames.encode_frame([b"next", b"x"]))
    decoder = _frames.FrameDecoder(1 << 30)
    monkeypatch.setattr(_frames, "_alloc", failing)
    frames = []
    for i in range(0, len(wire), 65536):  # as a socket would deliver it
        frames.extend(decoder.feed(wire[i : i + 65536]))
    assert [type(f) for f in frames] == [_frames.LostFrame, list]
    assert frames[0] == [b"envelope"] and isinstance(frames[0].error, MemoryError)
    assert frames[1] == [b"next", b"x"]


# -- floods of connections that never authenticate --------------------------------------------

def _flood(family: int, target: Any, count: int) -> list[socket.socket]:
    """``count`` connections, each accepted (the server's handshake greeting arrived)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 1024), hard))
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.settimeout(T)
            s.connect(target)
            s.recv(1)  # the greeting (or EOF, once shed): the server has accepted it
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def test_a_flood_of_unauthenticated_connections_is_shed_and_the_worker_serves(worker):
    from actormesh.transport._sockets import MAX_UNAUTHENTICATED

    address, _ = worker.listener.call_one().get(timeout=T)
    assert address.startswith("unix:")
    before = worker.fd_count.call_one().get(timeout=T)
    socks = _flood(socket.AF_UNIX, address[5:], FLOOD)
    try:
        _, waiting = worker.listener.call_one().get(timeout=T)
        assert waiting <= MAX_UNAUTHENTICATED
        # Every connection was accepted, yet the worker holds at most the cap of them.
        assert worker.fd_count.call_one().get(timeout=T) <= before + MAX_UNAUTHENTICATED + 16
        assert worker.take.call_one(bytes(BIG)).get(timeout=T) == BIG
    finally:
        for s in socks:
            s.close()


def test_a_flood_on_the_rdma_server_keeps_threads_bounded_and_it_serves(worker, monkeypatch):
    import torch

    from actormesh.rdma._server import MAX_PENDING_HANDSHAKES

    monkeypatch.setenv("ACTORMESH_RDMA_BACKEND", "tcp")  # our reads go through the bulk server
    buf = worker.rdma_server.call_one().get(timeout=T)
    threads_before = worker.thread_count.call_one().get(timeout=T)
    fds_before = worker.fd_count.call_one().get(timeout=T)
    socks = _flood(socket.AF_INET, tuple(buf._handle.tcp), FLOOD)
    try:
        assert worker.thread_count.call_one().get(timeout=T) <= threads_before + 4
        assert worker.fd_count.call_one().get(timeout=T) <= fds_before + MAX_PENDING_HANDSHAKES + 16
        dst = torch.zeros(buf.size(), dtype=torch.uint8)
        buf.read_into(dst).get(timeout=T)
        assert torch.equal(dst.view(torch.int32), torch.arange(4096, dtype=torch.int32))
        assert buf.backend == "tcp"
    finally:
        for s in socks:
            s.close()
