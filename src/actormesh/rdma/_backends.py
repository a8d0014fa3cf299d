"""Backends: how the bytes of one transfer move, and which one a transfer uses.

A backend is anything with the :class:`Backend` shape. The reader/writer side
calls ``usable(handle)`` then ``read``/``write``; nothing else is required of
the owner, which is what makes a transfer one-sided. An ibverbs or UCX backend
fits the same seam: ``export(registration)`` runs in the owner when a buffer
is registered and returns what peers need (an rkey, the remote address, a
queue-pair endpoint); those entries travel in the handle's ``extras``; its
``read``/``write`` post RDMA READ/WRITE work requests and wait for completion.

Choice (``ACTORMESH_RDMA_BACKEND``, read per transfer): ``auto`` (default)
tries, in order, ``local`` (same process: memmove), ``vm`` (same host:
process_vm_readv/writev), ``shm`` (same host: shared memory through the
owner's Unix socket), ``tcp`` (anywhere: bulk TCP stream). ``vm``, ``shm``
or ``tcp`` forces that one (an error if it cannot reach the owner).
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from typing import Any, Protocol

from ._errors import BufferDroppedError, OwnerGoneError, RDMAError
from ._memory import host_id, memmove, proc_start_time
from ._registry import Registration, registry
from ._vm import vm_copy, vm_copy_many, vm_read_u64, vm_supported

__all__ = ["BufferHandle", "Backend", "Unusable", "backends_for", "read_many", "chunk_bytes", "forced_backend", "BACKENDS", "on_chunk", "register_backend"]

_NAMES = ("auto", "local", "vm", "shm", "tcp")


@dataclass(frozen=True)
class BufferHandle:
    """Everything a peer needs to reach a registered buffer (small, picklable)."""

    owner: str  # the owning actor's id
    proc: str  # the owner's proc address
    host: str  # see _memory.host_id
    pid: int
    start_time: int
    reg_id: int
    nbytes: int
    address: int
    slot_address: int
    device: str
    readonly: bool
    tcp: tuple[str, int]
    unix: str
    extras: tuple[tuple[str, Any], ...] = ()

    def describe_owner(self) -> str:
        """The owner, for error messages: actor, pid and proc address."""
        where = f"pid {self.pid}" if self.proc in self.owner else f"pid {self.pid}, proc {self.proc}"
        return f"{self.owner} ({where})"


class Unusable(Exception):
    """Raised by a backend that cannot serve this transfer: the next one is tried."""


class Backend(Protocol):
    """How bytes move between local memory and a registered buffer."""

    name: str

    def usable(self, handle: BufferHandle) -> bool:
        """Whether this backend can reach the buffer's owner from here (cheap, no I/O)."""

    def export(self, reg: Registration) -> dict[str, Any]:
        """Owner side, at registration: entries peers need (e.g. an rkey); usually empty."""

    def read(self, handle: BufferHandle, offset: int, local: int, nbytes: int, deadline: float) -> None:
        """Copy ``nbytes`` at ``offset`` of the buffer into local CPU memory at ``local``."""

    def write(self, handle: BufferHandle, offset: int, local: int, nbytes: int, deadline: float) -> None:
        """Copy ``nbytes`` of local CPU memory at ``local`` into the buffer at ``offset``."""


#: Test seam: called as ``on_chunk(backend_name, bytes_done)`` after each chunk moves.
on_chunk: Any = None


def _progress(name: str) -> Any:
    hook = on_chunk
    return None if hook is None else (lambda done: hook(name, done))


def chunk_bytes(default: int = 8 << 20) -> int:
    """Bytes per chunk (``ACTORMESH_RDMA_CHUNK_BYTES``): the unit of progress and deadline checks."""
    raw = os.environ.get("ACTORMESH_RDMA_CHUNK_BYTES")
    if raw:
        try:
            value = int(raw)
            if value > 0:
                return value
        except ValueError:
            pass
        raise RDMAError(f"ACTORMESH_RDMA_CHUNK_BYTES must be a positive integer, got {raw!r}")
    return default


def forced_backend() -> str:
    """``ACTORMESH_RDMA_BACKEND`` (``auto`` when unset); ValueError for an unknown name."""
    name = os.environ.get("ACTORMESH_RDMA_BACKEND", "auto").strip().lower() or "auto"
    if name not in _NAMES:
        raise ValueError(f"ACTORMESH_RDMA_BACKEND must be one of {', '.join(_NAMES)}; got {name!r}")
    return name


def same_host(handle: BufferHandle) -> bool:
    return handle.host == host_id()


def dropped_or_gone(handle: BufferHandle) -> RDMAError:
    """The registration no longer matches: tell a dropped buffer from an exited owner."""
    if proc_start_time(handle.pid) == handle.start_time:
        return BufferDroppedError(f"the RDMA buffer ({handle.nbytes} bytes) owned by {handle.describe_owner()} was dropped", owner=handle.owner)
    return OwnerGoneError(f"the owner of the RDMA buffer, {handle.describe_owner()}, has exited", owner=handle.owner)


class LocalBackend:
    """The owner's own process: a plain memmove, checked against the registry."""

    name = "local"

    def usable(self, handle: BufferHandle) -> bool:
        return handle.pid == os.getpid() and same_host(handle) and handle.device == "cpu"

    def export(self, reg: Registration) -> dict[str, Any]:
        return {}

    def _check(self, handle: BufferHandle) -> Registration:
        reg = registry.get(handle.reg_id)
        if reg is None:
            raise dropped_or_gone(handle)
        return reg

    def read(self, handle: BufferHandle, offset: int, local: int, nbytes: int, deadline: float) -> None:
        reg = self._check(handle)
        memmove(local, reg.region.address + offset, nbytes)

    def write(self, handle: BufferHandle, offset: int, local: int, nbytes: int, deadline: float) -> None:
        reg = self._check(handle)
        memmove(reg.region.address + offset, local, nbytes)


class VmBackend:
    """Same host: the kernel copies between the two address spaces (one memcpy)."""

    name = "vm"

    def __init__(self) -> None:
        self.denied: set[tuple[int, int]] = set()  # (pid, start time) that refused us (EPERM)

    def usable(self, handle: BufferHandle) -> bool:
        return same_host(handle) and handle.device == "cpu" and (handle.pid, handle.start_time) not in self.denied and vm_supported()

    def export(self, reg: Registration) -> dict[str, Any]:
        return {}

    def _check_slot(self, handle: BufferHandle) -> None:
        try:
            word = vm_read_u64(handle.pid, handle.slot_address)
        except OSError as exc:
            self._raise(handle, exc)
        if word != handle.reg_id:
            raise dropped_or_gone(handle)

    def _raise(self, handle: BufferHandle, exc: OSError) -> Any:
        if exc.errno == errno.EPERM:
            self.denied.add((handle.pid, handle.start_time))
            raise Unusable(f"process_vm access to pid {handle.pid} denied") from exc
        if exc.errno == errno.ESRCH:
            raise OwnerGoneError(f"the owner of the RDMA buffer, {handle.describe_owner()}, has exited", owner=handle.owner) from exc
        raise dropped_or_gone(handle) from exc

    def _copy(self, handle: BufferHandle, offset: int, local: int, nbytes: int, write: bool) -> None:
        self._check_slot(handle)
        try:
            vm_copy(handle.pid, local, handle.address + offset, nbytes, write=write, chunk=chunk_bytes(1 << 30), on_chunk=_progress(self.name))
        except OSError as exc:
            self._raise(handle, exc)
        if not write:
            self._check_slot(handle)  # a drop or exit during the copy may have torn it

    def read(self, handle: BufferHandle, offset: int, local: int, nbytes: int, deadline: float) -> None:
        self._copy(handle, offset, local, nbytes, write=False)

    def read_many(self, handle: BufferHandle, ranges: list[tuple[int, int, int]], deadline: float) -> None:
        """Several ``(offset, local, nbytes)`` reads in one scatter list (one system call per 1024)."""
        self._check_slot(handle)
        try:
            vm_copy_many(handle.pid, [(local, handle.address + offset, n) for offset, local, n in ranges], write=False,
                         chunk=chunk_bytes(1 << 30), on_chunk=_progress(self.name))
        except OSError as exc:
            self._raise(handle, exc)
        self._check_slot(handle)  # a drop or exit during the copy may have torn it

    def write(self, handle: BufferHandle, offset: int, local: int, nbytes: int, deadline: float) -> None:
        self._copy(handle, offset, local, nbytes, write=True)

    def read_scattered(self, reads: list[tuple[BufferHandle, list[tuple[int, int, int]]]], deadline: float) -> None:
        """``(handle, [(offset, local, nbytes)])`` reads from several buffers of one owner process in one
        scatter list; every registration is checked before the copy and after it (a drop may have torn it)."""
        handles = list({h.reg_id: h for h, _ in reads}.values())
        self._check_slots(handles)
        pairs = [(local, h.address + offset, n) for h, ranges in reads for offset, local, n in ranges]
        try:
            vm_copy_many(handles[0].pid, pairs, write=False, chunk=chunk_bytes(1 << 30), on_chunk=_progress(self.name))
        except OSError as exc:
            self._raise(handles[0], exc)
        self._check_slots(handles)

    def _check_slots(self, handles: list[BufferHandle]) -> None:
        """``_check_slot`` for many registrations of one process in one system call."""
        words = (ctypes.c_uint64 * len(handles))()
        base = ctypes.addressof(words)
        try:
            vm_copy_many(handles[0].pid, [(base + 8 * i, h.slot_address, 8) for i, h in enumerate(handles)], write=False)
        except OSError as exc:
            self._raise(handles[0], exc)
        for h, word in zip(handles, words):
            if word != h.reg_id:
                raise dropped_or_gone(h)


def read_many(backend: Backend, handle: BufferHandle, ranges: list[tuple[int, int, int]], deadline: float) -> None:
    """``(offset, local, nbytes)`` reads through ``backend``: its own ``read_many`` when it has one
    (optional: a scatter list in one operation), else one ``read`` per range."""
    many = getattr(backend, "read_many", None)
    if many is not None:
        return many(handle, ranges, deadline)
    for offset, local, nbytes in ranges:
        backend.read(handle, offset, local, nbytes, deadline)
    return None


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Make a backend available (a later one of the same name replaces it)."""
    BACKENDS[backend.name] = backend


def backends_for(handle: BufferHandle) -> list[Backend]:
    """Backends to try for ``handle``, best first. Raises RDMAError if none can reach it."""
    forced = forced_backend()
    if forced != "auto":
        backend = BACKENDS[forced]
        if not backend.usable(handle):
            raise RDMAError(
                f"ACTORMESH_RDMA_BACKEND={forced} cannot reach the buffer of {handle.describe_owner()} "
                f"(host {handle.host}, device {handle.device}; this process is on {host_id()})",
                owner=handle.owner,
            )
        return [backend]
    found = [b for name, b in BACKENDS.items() if b.usable(handle)]
    if not found:
        raise RDMAError(f"no RDMA backend can reach the buffer of {handle.describe_owner()}", owner=handle.owner)
    return found


register_backend(LocalBackend())
register_backend(VmBackend())
