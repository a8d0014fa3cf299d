"""Local memory as the data plane sees it: an address, a length, and what keeps it alive.

torch is never imported here: a tensor is recognised only if the caller's
process already imported torch (it could not hold a tensor otherwise).
Memoryviews (and anything with the buffer protocol) need nothing beyond ctypes.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

from ..transport import buffer_address

__all__ = ["Region", "region_of", "view_at", "memmove", "advise_huge_pages", "host_id", "proc_start_time"]


@dataclass(frozen=True)
class Region:
    """``nbytes`` bytes at ``address`` on ``device``; ``keep`` holds the memory alive."""

    address: int
    nbytes: int
    readonly: bool
    device: str  # "cpu" or e.g. "cuda:0"
    keep: Any

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def region_of(obj: Any, *, role: str, allow_empty: bool = False) -> Region:
    """Describe ``obj`` (a 1-D contiguous tensor or buffer) without copying it.

    ``role`` names the argument in errors ("dst", "src", "RDMABuffer data").
    Raises ValueError naming the problem: not 1-D, not contiguous, empty,
    unsupported device; TypeError for objects that are neither.
    """
    if _is_tensor(obj):
        return _tensor_region(obj, role=role, allow_empty=allow_empty)
    try:
        mv = obj if isinstance(obj, memoryview) else memoryview(obj)
    except TypeError:
        raise TypeError(f"{role} must be a torch.Tensor or a memoryview (or another buffer), got {type(obj).__name__}") from None
    if mv.ndim > 1:
        raise ValueError(f"{role} must be 1-D, got a memoryview of shape {mv.shape}; pass mv.cast('B') or a 1-D view")
    if not mv.c_contiguous:
        raise ValueError(f"{role} must be contiguous, got a memoryview with strides {mv.strides}")
    if mv.nbytes == 0 and not allow_empty:
        raise ValueError(f"{role} has size 0: an RDMA buffer needs at least one byte")
    address = buffer_address(mv) if mv.nbytes else 0
    return Region(address, mv.nbytes, bool(mv.readonly), "cpu", mv)


def _tensor_region(t: Any, *, role: str, allow_empty: bool) -> Region:
    import torch

    if t.layout != torch.strided:
        raise ValueError(f"{role} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dim() != 1:
        raise ValueError(f"{role} must be a 1-D tensor, got shape {tuple(t.shape)}; pass t.view(-1) (or t.flatten())")
    if not t.is_contiguous():
        raise ValueError(f"{role} must be contiguous, got a tensor with stride {t.stride()}; pass t.contiguous()")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0 and not allow_empty:
        raise ValueError(f"{role} has size 0: an RDMA buffer needs at least one byte")
    device = t.device.type
    if device not in ("cpu", "cuda"):
        raise ValueError(f"{role} lives on device {t.device}; only CPU and CUDA tensors can be used")
    return Region(int(t.data_ptr()), nbytes, False, str(t.device), t)


def view_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of raw memory (the caller keeps the memory alive)."""
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def memmove(dst: int, src: int, nbytes: int) -> None:
    """Copy bytes between two addresses of this process (releases the GIL)."""
    if nbytes:
        ctypes.memmove(dst, src, nbytes)


_HUGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) transparent huge page size
_MADV_HUGEPAGE = 14
_libc = ctypes.CDLL(None, use_errno=True)


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask the kernel to back the 2 MiB-aligned inside of this range with transparent huge pages.

    Why: a same-host peer reads registered memory with ``process_vm_readv``,
    which pins the owner's pages one 4 KiB page at a time; over huge pages it
    copies at memcpy speed (over 4 KiB pages, about half of it). Only pages
    faulted in after this call become huge (already-touched memory keeps its
    pages; khugepaged may merge them later), so it costs nothing now. Where
    THP is off, or the range is not anonymous memory, it does nothing.
    Returns whether the kernel accepted the advice.
    """
    start = -(-address // _HUGE) * _HUGE
    end = (address + nbytes) // _HUGE * _HUGE
    if end <= start or sys.platform != "linux":
        return False
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0


_HOST_ID: str | None = None


def host_id() -> str:
    """Who can reach this process's memory directly: hostname, boot id and pid namespace.

    Two processes with the same host id share a kernel and a pid namespace, so
    a pid means the same process to both.
    """
    global _HOST_ID
    if _HOST_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            boot = "no-boot-id"
        try:
            pidns = str(os.stat("/proc/self/ns/pid").st_ino)
        except OSError:
            pidns = "no-pidns"
        _HOST_ID = f"{socket.gethostname()}/{boot}/{pidns}"
    return _HOST_ID


def proc_start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot) of ``pid``, or None if it is gone.

    Together with the pid it names one process for good: a recycled pid has a
    different start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: split after it.
    fields = data[data.rfind(b")") + 2 :].split()
    if fields and fields[0] in (b"Z", b"X"):
        return None  # a zombie's memory is gone already
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None
