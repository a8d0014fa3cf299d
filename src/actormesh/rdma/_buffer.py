"""``RDMABuffer``: a small picklable handle on registered memory, moved one-sided.

Contracts
---------
- Creating a buffer registers the memory in place (no copy) and keeps a
  reference to it in the owner process until ``drop()``.
- ``read_into``/``write_from`` check their arguments at once (``ValueError``
  or ``TypeError`` at the call site) and move the bytes on a background
  thread; the returned :class:`~actormesh.runtime.Future` completes with
  ``None`` or fails with an :class:`RDMAError` naming the owner (owner gone,
  buffer dropped, timeout). Nothing waits unless the caller calls ``.get()``.
  Exception: a copy of at most ``INLINE_MAX_BYTES`` (1 MiB) in the same
  process or by ``process_vm`` runs in the caller's thread. It takes tens of
  microseconds, less than waking a thread, and can wait on nothing.
- No locking, as in Monarch: a write racing a read or another write of the
  same bytes gives some interleaving of them; order transfers with messages.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ..runtime import Future, current_actor_name, current_runtime
from ._backends import BACKENDS, BufferHandle, Unusable, backends_for, forced_backend, read_many, same_host
from ._client import drop_remote
from ._errors import BufferDroppedError, RDMAError, RDMAReadTransferWarning, RDMATcpFallbackWarning, RDMAWriteTransferWarning
from ._memory import Region, advise_huge_pages, host_id, proc_start_time, region_of
from ._registry import registry
from ._server import ensure_server
from ._vm import vm_supported

__all__ = ["RDMABuffer", "get_rdma_backend", "same_host_backend", "is_rdma_available", "is_ibverbs_available", "submit"]


#: Transfers up to this size over ``local``/``vm`` run in the caller's thread (see ``_start``).
INLINE_MAX_BYTES = 1 << 20
#: CPU buffers from this size on get transparent huge pages for memory touched after registration.
HUGE_PAGES_MIN_BYTES = 4 << 20
_INLINE_BACKENDS = ("local", "vm")


class _Workers:
    """Daemon threads that run transfers: one more is started while the queue
    holds more work than there are idle threads; idle threads retire."""

    def __init__(self, max_threads: int = 32, idle_s: float = 30.0) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting on the queue
        self._threads = 0
        self._max = max_threads
        self._idle_s = idle_s

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._queue.put(fn)
            start = self._queue.qsize() > self._idle and self._threads < self._max
            if start:
                self._threads += 1
        if start:
            threading.Thread(target=self._run, name="actormesh-rdma-transfer", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                fn = self._queue.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    if self._queue.empty():  # checked under the lock submit() puts under
                        self._threads -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
            fn()


_workers = _Workers()


def submit(fn: Callable[[], Any]) -> Future[Any]:
    """Run ``fn`` on a transfer thread; its result or exception completes the future."""
    fut: Future[Any] = Future._create()

    def run() -> None:
        try:
            value = fn()
        except BaseException as exc:  # delivered to the waiter, not lost in a thread
            fut._set_exception(exc)
        else:
            fut._set_result(value)

    _workers.submit(run)
    return fut


def _check_timeout(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


class RDMABuffer:
    """Memory of this process that other processes read and write one-sided.

    ``RDMABuffer(t)`` registers a 1-D contiguous tensor (CPU, or CUDA when a
    GPU is present) or memoryview without copying it. The object is a small
    handle: return it from endpoints, pass it through other actors. Any holder
    can ``read_into`` a local tensor or ``write_from`` one.

    Raises ValueError for empty, non-1-D or non-contiguous memory.

    Example::

        class Owner(Actor):
            def __init__(self):
                self.weights = torch.randn(1 << 20)

            @endpoint
            def handle(self) -> RDMABuffer:
                return RDMABuffer(self.weights)

        buf = owner.handle.call_one().get()
        local = torch.empty(1 << 20)
        buf.read_into(local).get()
    """

    def __init__(self, data: Any) -> None:
        region = region_of(data, role="RDMABuffer data")
        if region.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(region.keep.device)  # its bytes must be in memory before anyone reads
        elif region.nbytes >= HUGE_PAGES_MIN_BYTES:
            advise_huge_pages(region.address, region.nbytes)
        rt = current_runtime()
        server = ensure_server(lambda: current_runtime().secret, registry)
        owner = current_actor_name()
        reg = registry.register(region, owner)
        extras: list[tuple[str, Any]] = []
        for backend in BACKENDS.values():
            extras.extend(sorted(backend.export(reg).items()))
        self._handle = BufferHandle(
            owner=owner,
            proc=rt.address,
            host=host_id(),
            pid=os.getpid(),
            start_time=proc_start_time(os.getpid()) or 0,
            reg_id=reg.reg_id,
            nbytes=region.nbytes,
            address=region.address,
            slot_address=reg.slot_address,
            device=region.device,
            readonly=region.readonly,
            tcp=server.tcp_address,
            unix=server.unix_address,
            extras=tuple(extras),
        )
        self._dropped = False
        self._backend: str | None = None

    @classmethod
    def _from_handle(cls, handle: BufferHandle) -> RDMABuffer:
        self = cls.__new__(cls)
        self._handle = handle
        self._dropped = False
        self._backend = None
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (RDMABuffer._from_handle, (self._handle,))

    def __repr__(self) -> str:
        state = " dropped" if self._dropped else ""
        return f"<RDMABuffer {self._handle.nbytes} bytes owned by {self._handle.owner} (pid {self._handle.pid}){state}>"

    def size(self) -> int:
        """The buffer's size in bytes."""
        return self._handle.nbytes

    @property
    def owner(self) -> str:
        """The id of the actor that registered the buffer."""
        return self._handle.owner

    @property
    def backend(self) -> str:
        """The backend the last transfer through this handle used ("local", "vm", "shm"
        or "tcp"); before any transfer, the one a transfer would try first."""
        if self._backend is not None:
            return self._backend
        try:
            return backends_for(self._handle)[0].name
        except (RDMAError, ValueError):
            return "none"

    def read_into(self, dst: Any, *, timeout: float = 60) -> Future[None]:
        """Copy the whole buffer into the start of ``dst`` (a 1-D contiguous tensor or memoryview).

        Raises ValueError at once if ``dst`` is smaller than the buffer, read-only,
        not 1-D or not contiguous. The future fails with OwnerGoneError,
        BufferDroppedError or RDMATimeoutError.
        """
        local = region_of(dst, role="dst", allow_empty=True)
        if local.nbytes < self.size():
            raise ValueError(f"dst is too small: {local.nbytes} bytes, the RDMA buffer holds {self.size()}")
        if local.readonly:
            raise ValueError("dst is read-only: read_into needs writable memory")
        if not local.is_cpu:
            warnings.warn(f"read_into a {local.device} tensor: the bytes are staged through host memory (one extra copy)",
                          RDMAReadTransferWarning, stacklevel=2)
        return self._start(local, self.size(), write=False, timeout=_check_timeout(timeout))

    def read_ranges(self, ranges: Sequence[tuple[int, Any]], *, timeout: float = 60) -> Future[None]:
        """Copy several parts of the buffer, each into its own local memory, as one transfer.

        ``ranges``: ``(offset, dst)`` pairs; bytes ``offset .. offset + len(dst)``
        of the buffer land in ``dst`` (a 1-D contiguous CPU tensor or
        memoryview). Same host, the whole list is one scatter copy by the
        kernel (one system call per 1024 ranges): reading a model's tensors
        straight into their places costs no more than one ``read_into``.
        Raises ValueError at once for a range outside the buffer or a
        read-only or non-CPU ``dst``; the future fails as ``read_into``'s does.
        """
        regions = self._check_ranges(ranges)
        deadline = time.monotonic() + _check_timeout(timeout)
        if self._dropped:
            return self._dropped_here()
        if sum(local.nbytes for _, local in regions) <= INLINE_MAX_BYTES and self._inline_ok():
            try:  # small and same host: here, as in _start
                self._transfer_ranges(regions, deadline)
            except Exception as exc:
                return Future._failed(exc)
            return Future._completed(None)
        return submit(lambda: self._transfer_ranges(regions, deadline))

    def _check_ranges(self, ranges: Sequence[tuple[int, Any]]) -> list[tuple[int, Region]]:
        """``(offset, dst)`` ranges as ``(offset, Region)``; ValueError for one outside the buffer or a bad ``dst``."""
        regions = []
        for offset, dst in ranges:
            local = region_of(dst, role="dst", allow_empty=True)
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset + local.nbytes > self.size():
                raise ValueError(f"range at offset {offset!r} of {local.nbytes} bytes is outside the RDMA buffer of {self.size()} bytes")
            if local.readonly or not local.is_cpu:
                raise ValueError(f"read_ranges needs writable CPU memory, got {'read-only' if local.readonly else local.device} dst")
            regions.append((offset, local))
        return regions

    def _transfer_ranges(self, regions: list[tuple[int, Region]], deadline: float) -> None:
        ranges = [(offset, local.address, local.nbytes) for offset, local in regions if local.nbytes]
        for backend in backends_for(self._handle):
            try:
                read_many(backend, self._handle, ranges, deadline)
            except Unusable:
                continue
            self._backend = backend.name
            return None
        raise RDMAError(f"no RDMA backend could reach the buffer of {self._handle.describe_owner()}", owner=self.owner)

    def write_from(self, src: Any, *, timeout: float = 60) -> Future[None]:
        """Copy all of ``src`` (a 1-D contiguous tensor or memoryview) into the start of the buffer.

        Raises ValueError at once if ``src`` is larger than the buffer (or empty,
        not 1-D, not contiguous) or the buffer was registered read-only.
        """
        local = region_of(src, role="src")
        if local.nbytes > self.size():
            raise ValueError(f"src is too large: {local.nbytes} bytes, the RDMA buffer holds {self.size()}")
        if self._handle.readonly:
            raise ValueError(f"the RDMA buffer owned by {self.owner} was registered from read-only memory; it cannot be written")
        if not local.is_cpu:
            warnings.warn(f"write_from a {local.device} tensor: the bytes are staged through host memory (one extra copy)",
                          RDMAWriteTransferWarning, stacklevel=2)
        return self._start(local, local.nbytes, write=True, timeout=_check_timeout(timeout))

    def _start(self, local: Region, nbytes: int, *, write: bool, timeout: float) -> Future[None]:
        if self._dropped:
            return self._dropped_here()
        deadline = time.monotonic() + timeout
        if nbytes <= INLINE_MAX_BYTES and local.is_cpu and self._inline_ok():
            # A small same-host copy takes less time than handing it to a thread
            # (tens of microseconds), and it cannot wait on the owner or the network.
            try:
                self._transfer(local, nbytes, write, deadline)
            except Exception as exc:
                return Future._failed(exc)
            return Future._completed(None)
        return submit(lambda: self._transfer(local, nbytes, write, deadline))

    def _dropped_here(self) -> Future[None]:
        h = self._handle
        return Future._failed(BufferDroppedError(f"this RDMA buffer ({h.nbytes} bytes, owned by {h.describe_owner()}) was dropped; it cannot be used", owner=h.owner))

    def _inline_ok(self) -> bool:
        try:
            return backends_for(self._handle)[0].name in _INLINE_BACKENDS
        except (RDMAError, ValueError):
            return False

    def _transfer(self, local: Region, nbytes: int, write: bool, deadline: float) -> None:
        if not local.is_cpu:
            return self._transfer_staged(local, nbytes, write, deadline)
        for backend in backends_for(self._handle):
            try:
                if write:
                    backend.write(self._handle, 0, local.address, nbytes, deadline)
                else:
                    backend.read(self._handle, 0, local.address, nbytes, deadline)
            except Unusable:
                continue
            self._backend = backend.name
            if backend.name == "tcp" and forced_backend() == "auto" and same_host(self._handle):
                warnings.warn(f"the RDMA buffer of {self._handle.describe_owner()} is on this host, but no same-host path could reach it; "
                              "this transfer used the TCP stream (slower)", RDMATcpFallbackWarning, stacklevel=2)
            return None
        raise RDMAError(f"no RDMA backend could reach the buffer of {self._handle.describe_owner()}", owner=self.owner)

    def _transfer_staged(self, local: Region, nbytes: int, write: bool, deadline: float) -> None:
        """GPU memory on this side: move through a (pinned) host buffer."""
        import torch

        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        flat = local.keep.view(torch.uint8)[:nbytes]
        if write:
            host.copy_(flat)
        staged = Region(int(host.data_ptr()), nbytes, False, "cpu", host)
        self._transfer(staged, nbytes, write, deadline)
        if not write:
            flat.copy_(host)
            torch.cuda.synchronize(flat.device)

    def drop(self) -> Future[None]:
        """Deregister the buffer; later transfers through any copy of the handle fail.

        Idempotent. From the owner's process it takes effect at once; from
        elsewhere it asks the owner (an owner that has exited has nothing to drop).
        """
        if self._dropped:
            return Future._completed(None)
        self._dropped = True
        h = self._handle
        if h.pid == os.getpid() and same_host(h):
            registry.drop(h.reg_id)
            return Future._completed(None)
        deadline = time.monotonic() + 10.0
        return submit(lambda: drop_remote(h, deadline))


def get_rdma_backend() -> str:
    """Monarch's answer to "which RDMA backend": ``"ibverbs"``, ``"tcp"`` or ``"none"``.

    actormesh has no ibverbs backend, so this is always ``"tcp"``: Monarch's name
    for moving buffers without RDMA hardware. Which of actormesh's own paths a
    same-host transfer takes is :func:`same_host_backend`.
    """
    return "tcp"


def same_host_backend() -> str:
    """The path a same-host transfer uses now: "vm" (process_vm_readv/writev), "shm",
    or the one forced with ``ACTORMESH_RDMA_BACKEND``. Across hosts it is "tcp"."""
    forced = forced_backend()
    if forced != "auto":
        return forced
    return "vm" if vm_supported() else "shm"


def is_rdma_available() -> bool:
    """True: some backend (at least the TCP stream) can always move buffers."""
    return bool(BACKENDS)


def is_ibverbs_available() -> bool:
    """False: no ibverbs backend is built in yet (see docs/rdma.md for the seam)."""
    return "ibverbs" in BACKENDS
