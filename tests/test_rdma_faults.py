"""RDMA buffers when things go wrong, and across a network namespace boundary: owners
killed mid-transfer, stopped or gone; drops; forced backends; an owner in another
network namespace; nothing left in /dev/shm when the controller dies."""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import signal
import subprocess
import sys
from typing import Any

import psutil
import pytest
import torch

import actormesh.rdma._backends as backends
from actormesh.rdma import BufferDroppedError, OwnerGoneError, RDMABuffer, RDMAError, RDMATimeoutError
from conftest import freeze, wait_for
from test_rdma import BACKENDS, Owner, crc, no_leaked_shm, owner, rand_bytes, use  # noqa: F401  (no_leaked_shm: autouse fixture)


# -- failures --------------------------------------------------------------------------------------


def _kill_and_wait(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)

    def dead() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_for(dead, timeout=10)  # not reaped here: the runtime reaps its own child


def test_owner_killed_mid_transfer_fails_the_reader(spawn_procs, monkeypatch):
    mesh = spawn_procs(per_host={"gpus": len(BACKENDS)}).spawn("owner", Owner)
    for rank, backend in enumerate(BACKENDS):
        use(monkeypatch, backend)
        o = mesh.slice(gpus=rank)
        pid = o.pid.call_one().get(timeout=30)
        buf = o.make.call_one("k", 16 << 20, kind="zeros").get(timeout=30)  # more than socket buffers hold
        chunks: list[int] = []

        def on_chunk(name: str, done: int) -> None:
            chunks.append(done)
            if len(chunks) == 1:
                _kill_and_wait(pid)

        monkeypatch.setattr(backends, "on_chunk", on_chunk)
        with pytest.raises(OwnerGoneError) as info:
            buf.read_into(torch.empty(16 << 20, dtype=torch.uint8)).get(timeout=30)
        assert buf.owner in str(info.value) and str(pid) in str(info.value), backend
        assert 0 < chunks[-1] < 16 << 20, backend  # it failed part way through
        monkeypatch.setattr(backends, "on_chunk", None)
        with pytest.raises(OwnerGoneError, match="owner"):  # and later transfers fail at once
            buf.write_from(torch.zeros(8, dtype=torch.uint8)).get(timeout=30)
        buf.drop().get(timeout=10)  # nothing left to drop: not an error


def test_drop_by_owner_or_by_holder_and_a_stopped_owner_times_out(spawn_procs, monkeypatch):
    o = owner(spawn_procs)
    for backend in BACKENDS:
        use(monkeypatch, backend)
        b1 = o.make.call_one("one", 4096, seed=1).get(timeout=30)
        b2 = o.make.call_one("two", 4096, seed=2).get(timeout=30)
        assert o.registrations.call_one().get(timeout=10) == 2
        o.drop.call_one("one").get(timeout=10)
        with pytest.raises(BufferDroppedError, match="dropped"):
            b1.read_into(torch.empty(4096, dtype=torch.uint8)).get(timeout=10)
        b2.drop().get(timeout=10)  # a holder drops: the owner deregisters
        assert o.registrations.call_one().get(timeout=10) == 0
        with pytest.raises(BufferDroppedError):
            b2.write_from(torch.zeros(1, dtype=torch.uint8)).get(timeout=10)
    # an owner that is alive but does not answer (SIGSTOP) times the transfer out
    use(monkeypatch, "tcp")
    buf = o.make.call_one("t", 1000, seed=1).get(timeout=30)
    pid = o.pid.call_one().get(timeout=10)
    freeze(pid)
    try:
        fut = buf.read_into(torch.empty(1000, dtype=torch.uint8), timeout=0.5)
        assert not fut.done()  # the caller was not blocked
        with pytest.raises(RDMATimeoutError, match="owner"):
            fut.get(timeout=10)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_forcing_a_backend_that_cannot_reach_fails_clearly(monkeypatch):
    buf = RDMABuffer(torch.zeros(10, dtype=torch.uint8))
    monkeypatch.setenv("ACTORMESH_RDMA_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="ACTORMESH_RDMA_BACKEND"):
        buf.read_into(torch.zeros(10, dtype=torch.uint8)).get(timeout=5)
    monkeypatch.setenv("ACTORMESH_RDMA_BACKEND", "vm")
    remote = pickle.loads(pickle.dumps(buf))
    object.__setattr__(remote._handle, "host", "elsewhere/0/0")
    with pytest.raises(RDMAError, match="cannot reach"):
        remote.read_into(torch.zeros(10, dtype=torch.uint8)).get(timeout=5)
    monkeypatch.setenv("ACTORMESH_RDMA_BACKEND", "auto")  # another host: auto picks the stream
    remote.read_into(torch.zeros(10, dtype=torch.uint8)).get(timeout=5)
    assert remote.backend == "tcp"
    buf.drop().get(timeout=5)


# -- across network namespaces ---------------------------------------------------------------------


def _own_network_namespace() -> None:
    """Bootstrap: move this proc into a fresh network namespace (root only; best effort)."""
    import ctypes

    CLONE_NEWNET = 0x40000000
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) == 0:
        os.environ["ACTORMESH_RDMA_BIND_HOST"] = "198.18.7.2"


def test_tcp_across_two_network_namespaces(spawn_procs, monkeypatch):
    """The owner lives in its own network namespace, reachable only through a veth pair."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("nsenter"):
        pytest.skip("needs root and iproute2 to build a veth pair between namespaces")
    o = spawn_procs(per_host={"gpus": 1}, bootstrap=_own_network_namespace).spawn("owner", Owner)
    pid = o.pid.call_one().get(timeout=30)
    if os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net"):
        pytest.skip("could not create a network namespace here")
    host_end, proc_end = f"amr{os.getpid() % 100000}a", f"amr{os.getpid() % 100000}b"

    def ip(*args: str, inside: bool = False) -> None:
        cmd = (["nsenter", "-t", str(pid), "-n"] if inside else []) + ["ip", *args]
        subprocess.run(cmd, check=True, capture_output=True, timeout=10)

    try:
        ip("link", "add", host_end, "type", "veth", "peer", "name", proc_end)
        ip("link", "set", proc_end, "netns", str(pid))
        ip("addr", "add", "198.18.7.1/30", "dev", host_end)
        ip("link", "set", host_end, "up")
        ip("addr", "add", "198.18.7.2/30", "dev", proc_end, inside=True)
        ip("link", "set", proc_end, "up", inside=True)
        monkeypatch.setenv("ACTORMESH_RDMA_BACKEND", "tcp")  # same kernel: vm would work; force the stream
        buf = o.make.call_one("n", (2 << 20) + 3, 3, seed=12).get(timeout=30)
        assert buf._handle.tcp[0] == "198.18.7.2"
        dst = torch.empty((2 << 20) + 3, dtype=torch.uint8)
        buf.read_into(dst).get(timeout=20)
        assert buf.backend == "tcp" and crc(dst) == o.crc.call_one("n").get(timeout=10)
        src = rand_bytes((2 << 20) + 3, 13)
        buf.write_from(src).get(timeout=20)
        assert o.crc.call_one("n").get(timeout=10) == crc(src)
        # auto without process_vm: the owner's abstract Unix socket is in its namespace,
        # unreachable from here, so the transfer falls through shm to the stream
        monkeypatch.setenv("ACTORMESH_RDMA_BACKEND", "auto")

        def denied(*a: Any, **k: Any) -> Any:
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(backends, "vm_copy", denied)
        monkeypatch.setattr(backends, "vm_read_u64", denied)
        try:
            buf.read_into(dst).get(timeout=20)
            assert buf.backend == "tcp" and crc(dst) == crc(src)
        finally:
            backends.BACKENDS["vm"].denied.clear()  # type: ignore[attr-defined]
    finally:
        subprocess.run(["ip", "link", "del", host_end], capture_output=True, timeout=10)


_CONTROLLER = """
import os, sys, torch
os.environ["ACTORMESH_RDMA_BACKEND"] = "shm"
from actormesh.actor import Actor, endpoint, this_host
from actormesh.rdma import RDMABuffer

class O(Actor):
    def __init__(self):
        self.shared = torch.arange(1 << 20, dtype=torch.int32).share_memory_()
        self.plain = torch.ones(1 << 20, dtype=torch.uint8)

    @endpoint
    def bufs(self):
        return RDMABuffer(self.shared), RDMABuffer(self.plain)

    @endpoint
    def read(self, buf):
        buf.read_into(torch.empty(buf.size(), dtype=torch.uint8)).get(timeout=20)
        return os.getpid()

o = this_host().spawn_procs(per_host={"gpus": 1}).spawn("o", O)
a, b = o.bufs.call_one().get(timeout=30)
for buf in (a, b):
    buf.read_into(torch.empty(buf.size(), dtype=torch.uint8)).get(timeout=20)
mine = RDMABuffer(torch.zeros(1 << 20, dtype=torch.uint8).share_memory_())
print(o.read.call_one(mine).get(timeout=30), flush=True)
os._exit(0)  # no shutdown at all: the worker dies with us
"""


def test_nothing_left_in_dev_shm_after_the_controller_exits(tmp_path):
    """Shared memory is memfd or unlinked at once: an abrupt exit of the controller (and so
    of its workers) leaves no name in /dev/shm and no process behind."""
    before = set(os.listdir("/dev/shm"))
    out = subprocess.run([sys.executable, "-c", _CONTROLLER], capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    worker = int(out.stdout.split()[-1])

    def gone() -> bool:
        try:
            return psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_for(gone, timeout=10)
    assert set(os.listdir("/dev/shm")) <= before
