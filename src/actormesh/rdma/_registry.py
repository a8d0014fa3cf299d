"""The owner's side of registration: which memory of this process may be moved.

Theory of operation
-------------------
Each registration gets a random 64-bit id and one 8-byte *slot* in a table of
this process's memory. The slot holds the id while the registration lives and
0 after ``drop``. A same-host peer that copies with ``process_vm_readv`` (no
help from this process) reads the slot before the copy (and after a read) and
proceeds only if it still holds the id: so a dropped buffer, an exited owner or
a recycled pid is detected without asking the owner. Slots are reused; ids are
not, so a stale handle never matches a new registration.

Dropping removes the registration at once but keeps the memory alive for a
short grace period (``DROP_GRACE_S``): a one-sided write that checked the slot
just before the drop still lands in memory that is not yet freed.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from ._memory import Region

__all__ = ["Registration", "Registry", "registry", "DROP_GRACE_S"]

DROP_GRACE_S = 2.0
_PAGE_SLOTS = 1024


@dataclass
class Registration:
    """One registered region of this process's memory."""

    reg_id: int
    region: Region
    owner: str
    slot_address: int
    slot: tuple[int, int]
    #: (fd, mapping size, offset of the region in the mapping) when the memory is
    #: already shared memory (a torch tensor after ``share_memory_()``): same-host
    #: peers without process_vm access map it and copy once.
    shm: tuple[int, int, int] | None = None
    extras: dict[str, Any] = field(default_factory=dict)


class Registry:
    """Registrations of this process, by id. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pages: list[ctypes.Array[ctypes.c_uint64]] = []
        self._free: list[tuple[int, int]] = []
        self._by_id: dict[int, Registration] = {}

    def _take_slot(self) -> tuple[int, int]:
        if not self._free:
            page = (ctypes.c_uint64 * _PAGE_SLOTS)()
            self._pages.append(page)
            p = len(self._pages) - 1
            self._free.extend((p, i) for i in reversed(range(_PAGE_SLOTS)))
        return self._free.pop()

    def register(self, region: Region, owner: str) -> Registration:
        """Register ``region``; it stays valid (and alive) until :meth:`drop`."""
        with self._lock:
            while True:
                reg_id = int.from_bytes(os.urandom(8), "little") | 1  # never 0 (0 = free slot)
                if reg_id not in self._by_id:
                    break
            slot = self._take_slot()
            page = self._pages[slot[0]]
            page[slot[1]] = reg_id
            address = ctypes.addressof(page) + 8 * slot[1]
            reg = Registration(reg_id, region, owner, address, slot, shm=_shared_memory_of(region))
            self._by_id[reg_id] = reg
            return reg

    def get(self, reg_id: int) -> Registration | None:
        """The live registration with this id, or None (dropped or never existed)."""
        return self._by_id.get(reg_id)

    def drop(self, reg_id: int) -> bool:
        """Deregister; returns False if it was not registered. Idempotent."""
        with self._lock:
            reg = self._by_id.pop(reg_id, None)
            if reg is None:
                return False
            self._pages[reg.slot[0]][reg.slot[1]] = 0
        # Keep the memory (and the slot) out of reuse for the grace period.
        timer = threading.Timer(DROP_GRACE_S, self._release, args=(reg,))
        timer.daemon = True
        timer.start()
        return True

    def _release(self, reg: Registration) -> None:
        with self._lock:
            self._free.append(reg.slot)
        reg.region = Region(0, 0, True, "cpu", None)

    def __len__(self) -> int:
        return len(self._by_id)


def _shared_memory_of(region: Region) -> tuple[int, int, int] | None:
    """(fd, size, offset) if ``region`` is a CPU tensor already in fd-backed shared memory."""
    t = region.keep
    if not region.is_cpu or not hasattr(t, "is_shared"):
        return None
    try:
        if not t.is_shared():
            return None
        storage = t.untyped_storage()
        fd, size = storage._share_fd_cpu_()  # the existing fd when already shared that way
        offset = region.address - int(storage.data_ptr())
    except Exception:  # file_system strategy or an allocator we do not know
        return None
    if fd < 0 or not 0 <= offset <= size - region.nbytes:
        return None
    return int(fd), int(size), int(offset)


registry = Registry()
