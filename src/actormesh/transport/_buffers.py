"""Receive memory for large segments, allocated once at its final size and type.

A large out-of-band segment is received straight into the object the
application will get: a ``bytes`` argument lands in a ``bytes`` object, a
``bytearray`` in a ``bytearray``, a tensor's or array's buffer in plain memory
that torch/numpy wrap without copying. The sender marks each large segment with
a *kind* (see :func:`kind_of`); the frame header carries it.

Why through the C API: ``bytes(n)`` and ``bytearray(n)`` zero every byte first
(a pass over memory the socket is about to overwrite anyway), and a ``bytes``
object cannot be filled after creation from Python. ``PyBytes_FromStringAndSize
(NULL, n)`` and ``PyByteArray_FromStringAndSize(NULL, n)`` return uninitialised
objects that C code fills before anyone sees them; the decoder does the same: it
writes into the new object through a view and hands the object out only when
every byte has arrived. Big allocations come from ``mmap`` in the C allocator,
so the pages are fresh (zeroed by the kernel, never another frame's data) and
go back to the system when the object is freed.

Why huge pages: faulting in fresh 4 KiB pages costs more than the copy into
them (64 MiB: about 23 ms of faults against 4 ms of memcpy on the reference
box). Segments of ``_HUGE_MIN_BYTES`` or more are marked ``MADV_HUGEPAGE``
before the first byte lands, so they fault in 2 MiB at a time where the kernel
has transparent huge pages (``madvise`` or ``always`` mode); elsewhere the call
is a harmless no-op.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any

from ._memory import _map, _munmap

__all__ = ["KIND_VIEW", "KIND_BYTES", "KIND_BYTEARRAY", "alloc_segment", "kind_of"]

#: Plain memory, handed out as a writable memoryview (tensors, arrays, raw buffers).
KIND_VIEW = 0
#: Handed out as the ``bytes`` object itself.
KIND_BYTES = 1
#: Handed out as the ``bytearray`` object itself.
KIND_BYTEARRAY = 2
KINDS = (KIND_VIEW, KIND_BYTES, KIND_BYTEARRAY)

_CPYTHON = sys.implementation.name == "cpython"
_HUGE_MIN_BYTES = 4 << 20
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise if sys.platform == "linux" else None
except (OSError, AttributeError):
    _madvise = None
if _madvise is not None:
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _madvise.restype = ctypes.c_int


def _prefer_huge_pages(address: int, nbytes: int) -> None:
    """Ask for transparent huge pages over the whole 2 MiB pages inside [address, address + nbytes)."""
    start = (address + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    end = (address + nbytes) & ~(_HUGE_PAGE - 1)
    if _madvise is not None and end > start:
        _madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: a failure changes nothing
if _CPYTHON:
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.restype = ctypes.py_object
    _new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    _new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
    _new_bytearray.restype = ctypes.py_object
    _new_bytearray.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    # ob_sval: the data of a bytes object starts where its fixed part ends (the +1 is the NUL).
    _BYTES_DATA_OFFSET = bytes.__basicsize__ - 1


_ANON_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) if sys.platform == "linux" else 0


class _Unmap:
    """Owns one anonymous mapping; unmaps it when the last view of it goes.

    Why not a ``bytes`` object: freeing one runs ``munmap`` with the GIL held
    (0.8 ms for 256 MiB of huge pages here), and every other thread of the
    process, the event loop with a small message included, waits that long.
    ``munmap`` through ctypes releases the GIL.
    """

    __slots__ = ("address", "nbytes")

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes = address, nbytes

    def __del__(self) -> None:
        try:
            _munmap(self.address, self.nbytes)
        except Exception:  # interpreter shutdown: the process is going, and its memory with it
            pass


def _anonymous(nbytes: int) -> tuple[memoryview, memoryview]:
    address = _map(-1, nbytes, 0, _ANON_FLAGS)  # zeroed by the kernel, never another frame's data
    _prefer_huge_pages(address, nbytes)
    raw = (ctypes.c_char * nbytes).from_address(address)
    raw._owner = _Unmap(address, nbytes)  # type: ignore[attr-defined]  # unmapped with the last view
    view = memoryview(raw).cast("B")
    return view, view


def kind_of(segment: Any) -> int:
    """The kind a receiver should allocate for ``segment``: by its exact type."""
    t = type(segment)
    if t is bytes:
        return KIND_BYTES
    if t is bytearray:
        return KIND_BYTEARRAY
    return KIND_VIEW


def alloc_segment(nbytes: int, kind: int = KIND_VIEW) -> tuple[Any, memoryview]:
    """A new, uninitialised segment of ``nbytes``: (what to hand out, a writable byte view of it).

    The first item must not be given to anyone until the view has been filled.
    Raises MemoryError when the memory is not there.
    """
    if kind == KIND_BYTEARRAY:
        arr = _new_bytearray(None, nbytes) if _CPYTHON else bytearray(nbytes)
        if nbytes >= _HUGE_MIN_BYTES and _CPYTHON:
            _prefer_huge_pages(ctypes.addressof(ctypes.c_char.from_buffer(arr)), nbytes)
        return arr, memoryview(arr)
    if nbytes == 0:
        return (b"" if kind == KIND_BYTES else memoryview(bytearray())), memoryview(bytearray())
    if not _CPYTHON:  # no way to fill a bytes object in place: the codec copies once
        view = memoryview(bytearray(nbytes))
        return view, view
    if kind == KIND_VIEW and nbytes >= _HUGE_MIN_BYTES and _ANON_FLAGS:
        return _anonymous(nbytes)
    data = _new_bytes(None, nbytes)
    address = id(data) + _BYTES_DATA_OFFSET
    if nbytes >= _HUGE_MIN_BYTES:
        _prefer_huge_pages(address, nbytes)
    raw = (ctypes.c_char * nbytes).from_address(address)
    raw._owner = data  # type: ignore[attr-defined]  # the view keeps the bytes object alive
    view = memoryview(raw).cast("B")
    return (data if kind == KIND_BYTES else view), view
