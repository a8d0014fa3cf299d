"""Raw memory for the shared-memory path: mmap/munmap through libc, buffer addresses, a parallel memcpy.

Why through ctypes: the pool works with raw addresses (a segment is copied
into with memmove, a received mapping lives exactly as long as the buffers
handed out over it), which Python's ``mmap`` objects do not give without a
copy; and ``memmove`` through ctypes releases the GIL, so large copies can be
split over threads.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from typing import Any

__all__ = ["buffer_address", "peer_pid_uid"]

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_mmap.restype = ctypes.c_void_p
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map(fd: int, length: int, offset: int, flags: int) -> int:
    addr = _mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes failed: {os.strerror(err)}")
    return int(addr)


class _PyBuffer(ctypes.Structure):
    # The stable layout of CPython's Py_buffer (Include/pybuffer.h).
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def buffer_address(obj: Any) -> int:
    """Address of the first byte of a C-contiguous buffer (read-only ones too).

    The caller keeps ``obj`` alive while it uses the address.
    """
    view = _PyBuffer()
    if _get_buffer(obj, ctypes.byref(view), 0) != 0:  # pragma: no cover - callers pass buffers
        raise ValueError("cannot take the address of this buffer")
    try:
        return int(view.buf or 0)
    finally:
        _release_buffer(ctypes.byref(view))


def peer_pid_uid(sock: Any) -> tuple[int, int]:
    """The pid (in our pid namespace; 0 if invisible) and uid of a Unix socket's peer."""
    import socket

    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", raw)
    return pid, uid


# One memcpy thread does not saturate memory bandwidth: large copies are split.
_PARALLEL_MIN = 8 << 20
_copiers: Any = None


def _copy(dst: int, src: int, n: int) -> None:
    """memcpy, split over up to 4 cores for large sizes (ctypes releases the GIL)."""
    global _copiers
    ways = min(4, len(os.sched_getaffinity(0))) if n >= _PARALLEL_MIN else 1
    if ways == 1:
        ctypes.memmove(dst, src, n)
        return
    if _copiers is None:
        from concurrent.futures import ThreadPoolExecutor

        _copiers = ThreadPoolExecutor(3, thread_name_prefix="actormesh-copy")
    chunk = -(-n // ways) + 4095 & ~4095
    jobs = [_copiers.submit(ctypes.memmove, dst + off, src + off, min(chunk, n - off)) for off in range(chunk, n, chunk)]
    ctypes.memmove(dst, src, min(chunk, n))
    for job in jobs:
        job.result()


def _dumpable() -> bool:
    try:
        return int(_libc.prctl(3, 0, 0, 0, 0)) == 1  # PR_GET_DUMPABLE
    except (AttributeError, OSError):
        return False
