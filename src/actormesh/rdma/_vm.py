"""Same-host one-sided copies with ``process_vm_readv`` / ``process_vm_writev``.

The kernel copies straight between the two address spaces: one memcpy, no
registration with the kernel, no help from the owner (it may be busy or
blocked in user code). It needs ptrace-level access to the owner (same user
and no Yama restriction, or CAP_SYS_PTRACE); ``EPERM`` makes callers fall
back to the shared-memory path. ctypes releases the GIL during the call.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable

__all__ = ["vm_copy", "vm_copy_many", "vm_read_u64", "vm_supported"]

#: iovec entries one call may take (the kernel's UIO_MAXIOV)
IOV_MAX = 1024


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_fns: dict[bool, Callable[..., int]] = {}
for _write, _name in ((False, "process_vm_readv"), (True, "process_vm_writev")):
    _fn = getattr(_libc, _name, None)
    if _fn is not None:
        _fn.restype = ctypes.c_ssize_t
        _fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        _fns[_write] = _fn


def vm_copy(pid: int, local: int, remote: int, nbytes: int, *, write: bool, chunk: int = 1 << 62, on_chunk: Callable[[int], None] | None = None) -> None:
    """Copy ``nbytes`` between ``local`` (ours) and ``remote`` (in ``pid``).

    ``write=False`` reads remote -> local. Raises OSError with the errno:
    ESRCH (the process is gone), EPERM (no access), EFAULT (bad remote address).
    """
    fn = _fns.get(write)
    if fn is None:
        raise OSError(errno.ENOSYS, "process_vm_readv/writev are not available")
    done = 0
    liov, riov = _IoVec(), _IoVec()
    while done < nbytes:
        n = min(nbytes - done, chunk)
        liov.iov_base, liov.iov_len = local + done, n
        riov.iov_base, riov.iov_len = remote + done, n
        got = fn(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if got == 0:
            raise OSError(errno.EFAULT, "process_vm copy made no progress")
        done += got
        if on_chunk is not None:
            on_chunk(done)


def vm_copy_many(pid: int, pairs: list[tuple[int, int, int]], *, write: bool, chunk: int = 1 << 30,
                 on_chunk: Callable[[int], None] | None = None) -> None:
    """Copy many ``(local, remote, nbytes)`` ranges with as few system calls as possible.

    Up to ``IOV_MAX`` ranges go in one call (a scatter/gather list on both
    sides), so reading a hundred tensors costs a few calls, not a hundred.
    Ranges over ``chunk`` bytes are cut so ``on_chunk(bytes_done)`` reports
    progress at least that often. Raises OSError as :func:`vm_copy`.
    """
    fn = _fns.get(write)
    if fn is None:
        raise OSError(errno.ENOSYS, "process_vm_readv/writev are not available")
    cut = [(loc + o, rem + o, min(chunk, n - o)) for loc, rem, n in pairs if n for o in range(0, n, chunk)]
    done = 0
    i = 0
    while i < len(cut):
        batch = cut[i:i + IOV_MAX]
        liov = (_IoVec * len(batch))(*(_IoVec(loc, n) for loc, _, n in batch))
        riov = (_IoVec * len(batch))(*(_IoVec(rem, n) for _, rem, n in batch))
        got = fn(pid, liov, len(batch), riov, len(batch), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if got == 0:
            raise OSError(errno.EFAULT, "process_vm copy made no progress")
        done += got
        # The kernel stops at an element boundary (or inside one on a fault): go on from there.
        for loc, rem, n in batch:
            if got >= n:
                got -= n
                i += 1
                continue
            cut[i] = (loc + got, rem + got, n - got)
            break
        if on_chunk is not None:
            on_chunk(done)


def vm_read_u64(pid: int, remote: int) -> int:
    """Read one native 64-bit word from ``pid``'s memory."""
    word = ctypes.c_uint64(0)
    vm_copy(pid, ctypes.addressof(word), remote, 8, write=False)
    return word.value


_SUPPORTED: bool | None = None


def vm_supported() -> bool:
    """Whether the syscalls work at all here (a read of our own memory; seccomp may forbid them)."""
    global _SUPPORTED
    if _SUPPORTED is None:
        probe = ctypes.c_uint64(0x5EED)
        try:
            _SUPPORTED = vm_read_u64(os.getpid(), ctypes.addressof(probe)) == 0x5EED
        except OSError:
            _SUPPORTED = False
    return _SUPPORTED
