"""Large frame segments through shared memory between processes of one host.

Theory of operation
-------------------
A sender copies each segment of at least ``threshold`` bytes into a *segment*
of its :class:`ShmPool`: a sealed ``memfd`` (no name in /dev/shm, so nothing
can leak there), kept mapped in the sender. The frame then carries a small
manifest ``(segment index, fd number, capacity, nbytes, token)`` instead of
the bytes. The receiver, which knows the sender's pid from the Unix socket
(``SO_PEERCRED``, not from the message), opens ``/proc/<pid>/fd/<fd>``, checks
the file (size, seals, token), maps the data copy-on-write and hands the frame
on with that mapping in place of the segment: one memcpy per hop, none on
receive, and the receiver may modify what it got without the sender seeing it.

Reuse is what makes this fast: fresh pages cost more than the copy itself, so
segments are recycled. The page after a segment's data holds one shared
64-bit state word: the sender writes the send's token, the receiver writes
token+1 once mapped and 0 when its mapping is gone (the last reference to the
received buffer died). Only a segment in state 0 is reused. A segment whose
peer connection closed is dropped, never reused (its receiver may be gone or
still mapping it); the kernel frees it when the last mapping goes.

Snapshot semantics are those of the socket path: the bytes are copied before
``send`` returns, so the sender may change its tensor at once.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import logging
import mmap
import os
import stat
import struct
import threading
from collections.abc import Sequence
from typing import Any

from ..errors import ProtocolError
from ._memory import _copy, _dumpable, _map, _munmap, buffer_address

__all__ = ["ShmPool", "ShmError", "ShmExhausted"]

log = logging.getLogger("actormesh.transport")

_PAGE = mmap.PAGESIZE
# Capacity granule for large segments: huge-page sized, so shmem can back
# them with transparent huge pages (far fewer faults than 4 KiB pages).
_HUGE = 2 << 20
_ENTRY = struct.Struct("<HIQQQ")  # index, fd, capacity, nbytes, token
_COUNT = struct.Struct("<I")
# Beyond this many segments lent out, the oldest mapped ones are dropped
# (the sender's descriptors are bounded; their receivers keep the memory).
_MAX_LENT = 256
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class ShmError(ProtocolError):
    """A shared-memory segment named in a frame could not be mapped."""


class ShmExhausted(ShmError):
    """This process ran out of a resource (descriptors, memory) mapping a segment.

    Not the peer's fault and not the connection's: only the frame is lost.
    ``resource`` is ``"file descriptors"`` or ``"memory"``.
    """

    def __init__(self, message: str, resource: str) -> None:
        super().__init__(message)
        self.resource = resource


_EXHAUSTED = {errno.EMFILE: "file descriptors", errno.ENFILE: "file descriptors", errno.ENOMEM: "memory"}


def _exhausted(exc: BaseException, what: str) -> ShmExhausted | None:
    """The ShmExhausted that ``exc`` amounts to, or None if it is another failure."""
    if isinstance(exc, MemoryError):
        resource = "memory"
    else:
        resource = _EXHAUSTED.get(getattr(exc, "errno", None) or 0, "")
        if not resource:
            return None
    if resource == "file descriptors":
        import resource as _resource

        soft = _resource.getrlimit(_resource.RLIMIT_NOFILE)[0]
        limit = f" (RLIMIT_NOFILE={soft})" if getattr(exc, "errno", None) == errno.EMFILE else " (the system-wide table is full)"
        advice = "raise the limit (ulimit -n) or close descriptors in this process"
    else:
        limit, advice = "", "free memory in this process or send smaller arguments"
    return ShmExhausted(
        f"ran out of {resource}{limit} while {what}: {exc}; {advice}, or set ACTORMESH_SHM_THRESHOLD_BYTES=0 "
        "to send large payloads over the socket instead", resource)


def _nbytes(s: Any) -> int:
    return len(s) if type(s) is bytes else memoryview(s).nbytes


class _Segment:
    """One memfd of the pool, mapped shared in the sender: data, then the state page."""

    __slots__ = ("fd", "capacity", "addr", "state", "channel", "lent_at", "busy", "doomed")

    def __init__(self, nbytes: int) -> None:
        granule = _HUGE if nbytes >= _HUGE else _PAGE
        self.capacity = -(-nbytes // granule) * granule
        self.fd = os.memfd_create("actormesh-msg", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.capacity + _PAGE)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self.addr = _map(self.fd, self.capacity + _PAGE, 0, mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        self.state = ctypes.c_uint64.from_address(self.addr + self.capacity)
        self.channel: object = None
        self.lent_at = 0
        self.busy = False  # being copied into, outside the pool's lock
        self.doomed = False

    def close(self) -> None:
        if self.fd >= 0:
            _munmap(self.addr, self.capacity + _PAGE)
            os.close(self.fd)
            self.fd = -1


class _Mapping:
    """A received segment's mappings; when the last view of it dies, unmap and release."""

    __slots__ = ("data", "length", "header", "token", "__weakref__")

    def __init__(self, data: int, length: int, header: int, token: int) -> None:
        self.data, self.length, self.header, self.token = data, length, header, token

    def __del__(self) -> None:
        try:
            _munmap(self.data, self.length)
            # Only now may the sender reuse the segment: our view of it is gone.
            state = ctypes.c_uint64.from_address(self.header)
            if state.value in (self.token, self.token + 1):
                state.value = 0
            _munmap(self.header, _PAGE)
        except Exception:  # interpreter teardown may have cleared ctypes already; the kernel unmaps at exit
            pass


class ShmPool:
    """This process's shared-memory segments for outgoing frames, and the mapper for incoming ones.

    ``threshold``: segments of at least this many bytes go through shared
    memory; ``max_free_bytes``: idle segments kept for reuse beyond this are
    closed. Thread-safe.
    """

    def __init__(self, threshold: int, max_free_bytes: int) -> None:
        self.threshold = threshold
        self.max_free_bytes = max_free_bytes
        self._segments: list[_Segment] = []
        self._lock = threading.Lock()
        self._tokens = itertools.count(4, 4)
        self._clock = itertools.count()
        self.closed = False
        #: Statistics: segments sent through shared memory, and created.
        self.sent = 0
        self.created = 0
        #: Peers open our segments via /proc/<our pid>/fd, which needs us dumpable.
        self.usable = _dumpable() and os.path.isdir("/proc/self/fd")

    # -- sending --------------------------------------------------------------------
    def export(self, segments: Sequence[Any], channel: object) -> tuple[bytes, list[Any]] | None:
        """Copy large segments into shared memory.

        Returns ``(manifest, segments with placeholders)``, or None when no
        segment is large enough (or shared memory is unavailable): then the
        frame goes over the socket unchanged. ``channel`` names the connection,
        so :meth:`forget` can drop what it lent there.
        """
        if not self.threshold or self.closed:
            return None
        big = [i for i, s in enumerate(segments) if _nbytes(s) >= self.threshold and (type(s) is bytes or memoryview(s).c_contiguous)]
        if not big:
            return None
        out = list(segments)
        entries = []
        for i in big:
            src = out[i]
            n = _nbytes(src)
            try:
                seg, token = self._acquire(n, channel)
            except OSError as exc:  # out of memory or descriptors: the socket still works
                log.debug("shared memory unavailable for %d bytes: %s", n, exc)
                continue
            try:
                _copy(seg.addr, buffer_address(memoryview(src)), n)
            finally:
                with self._lock:
                    seg.busy = False
                    if seg.doomed or self.closed:
                        self._drop(seg)
            if seg.fd < 0:
                continue  # dropped while we copied (connection or pool closed): send it inline
            entries.append(_ENTRY.pack(i, seg.fd, seg.capacity, n, token))
            out[i] = b""
        if not entries:
            return None
        self.sent += len(entries)
        return _COUNT.pack(len(entries)) + b"".join(entries), out

    def _acquire(self, n: int, channel: object) -> tuple[_Segment, int]:
        with self._lock:
            if self.closed:
                raise OSError("shared-memory pool closed")
            best: _Segment | None = None
            lent: list[_Segment] = []
            for seg in self._segments:
                if seg.busy:
                    continue
                if seg.channel is not None:
                    if seg.state.value != 0:
                        lent.append(seg)
                        continue
                    seg.channel = None  # its receiver is done with it
                if n <= seg.capacity <= max(2 * n, n + _HUGE) and (best is None or seg.capacity < best.capacity):
                    best = seg
            if best is None:
                best = _Segment(n)
                self.created += 1
                self._segments.append(best)
            token = next(self._tokens)
            # The token marks it lent at once, before the copy: no other sender may take it.
            best.state.value = token
            best.channel, best.busy = channel, True
            best.lent_at = next(self._clock)
            self._trim(lent)
            return best, token

    def _trim(self, lent: list[_Segment]) -> None:
        """Bound idle bytes and lent segments (lock held)."""
        free = [s for s in self._segments if s.channel is None and not s.busy]
        excess = sum(s.capacity for s in free) - self.max_free_bytes
        for seg in sorted(free, key=lambda s: -s.capacity):
            if excess <= 0:
                break
            excess -= seg.capacity
            self._drop(seg)
        if len(lent) > _MAX_LENT:
            # Mapped ones only (odd state): an unmapped one may still be opened by its receiver.
            mapped = sorted((s for s in lent if s.state.value & 1), key=lambda s: s.lent_at)
            for seg in mapped[: len(lent) - _MAX_LENT]:
                self._drop(seg)

    def _drop(self, seg: _Segment) -> None:
        """Forget a segment for good (lock held); one being copied into goes when the copy ends."""
        if seg.busy:
            seg.doomed = True
            return
        if seg in self._segments:
            self._segments.remove(seg)
        seg.close()

    def forget(self, channel: object) -> None:
        """A connection closed: drop the segments lent on it (never reuse them)."""
        with self._lock:
            for seg in [s for s in self._segments if s.channel is channel and (s.busy or s.state.value != 0)]:
                self._drop(seg)

    def close(self) -> None:
        """Unmap and close every segment (receivers keep what they mapped)."""
        with self._lock:
            self.closed = True
            for seg in list(self._segments):
                self._drop(seg)

    # -- receiving ------------------------------------------------------------------
    @staticmethod
    def import_frame(manifest: Any, segments: list[Any], peer_pid: int) -> list[Any]:
        """Replace the placeholders of a received frame with mapped segments.

        Raises ShmError naming what is wrong (the caller closes the connection).
        """
        raw = bytes(manifest)
        if len(raw) < _COUNT.size:
            raise ShmError("shared-memory manifest too short")
        (count,) = _COUNT.unpack_from(raw)
        if len(raw) != _COUNT.size + count * _ENTRY.size or count == 0:
            raise ShmError("shared-memory manifest has the wrong length")
        if peer_pid <= 0:
            raise ShmError("shared memory from a peer whose pid is not visible here")
        out = list(segments)
        for k in range(count):
            index, fd, capacity, n, token = _ENTRY.unpack_from(raw, _COUNT.size + k * _ENTRY.size)
            if index >= len(out) or _nbytes(out[index]) != 0:
                raise ShmError(f"shared-memory manifest names segment {index}, which is not a placeholder")
            if not 0 < n <= capacity or capacity % _PAGE or token & 3:
                raise ShmError(f"shared-memory manifest entry is inconsistent ({n} bytes in {capacity})")
            try:
                out[index] = _open_segment(peer_pid, fd, capacity, n, token)
            except (OSError, MemoryError) as exc:
                what = f"mapping a {n}-byte shared-memory segment from pid {peer_pid}"
                exhausted = _exhausted(exc, what)
                if exhausted is not None:
                    raise exhausted from None
                raise ShmError(f"cannot map a {n}-byte shared-memory segment from pid {peer_pid}: {exc}") from None
        return out


def _open_segment(pid: int, fd: int, capacity: int, n: int, token: int) -> memoryview:
    path = f"/proc/{pid}/fd/{fd}"
    try:
        f = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in _EXHAUSTED:
            raise  # our own shortage, not the segment's: the caller says so
        raise ShmError(f"cannot open the sender's shared-memory segment {path}: {exc.strerror}; "
                       "set ACTORMESH_SHM_THRESHOLD_BYTES=0 (or configure(shm_threshold_bytes=0)) to send "
                       "large payloads over the socket instead") from None
    try:
        st = os.fstat(f)
        if not stat.S_ISREG(st.st_mode) or st.st_size != capacity + _PAGE:
            raise ShmError(f"{path} is not the announced shared-memory segment (size {st.st_size})")
        if fcntl.fcntl(f, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
            raise ShmError(f"{path} is not sealed against resizing")
        header = _map(f, _PAGE, capacity, mmap.MAP_SHARED)
        state = ctypes.c_uint64.from_address(header)
        if state.value != token:
            _munmap(header, _PAGE)
            raise ShmError(f"{path} does not hold the announced message (stale segment)")
        length = -(-n // _PAGE) * _PAGE
        try:
            data = _map(f, length, 0, mmap.MAP_PRIVATE)
        except OSError:
            _munmap(header, _PAGE)
            raise
    finally:
        os.close(f)
    state.value = token + 1
    owner = _Mapping(data, length, header, token)
    arr = (ctypes.c_char * n).from_address(data)
    arr._owner = owner  # type: ignore[attr-defined]  # the views keep the mapping alive
    return memoryview(arr).cast("B")
