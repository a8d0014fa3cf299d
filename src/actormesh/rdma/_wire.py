"""The bulk protocol between a reader/writer and a buffer's owner, and blocking socket helpers.

Theory of operation
-------------------
A connection (TCP, or a Unix socket on the same host) starts with the job's
HMAC handshake (:class:`actormesh.transport.Handshake`); nothing else is read
before it succeeds, and nothing is ever unpickled: requests and replies are
fixed-size structs, and data is raw bytes written straight from or into the
registered memory (``sendall`` / ``recv_into`` on a view of it, in chunks).

``REQUEST = op, flags, timeout_ms, reg_id, offset, nbytes`` (32 bytes).
``REPLY = status, flags, a, b`` (24 bytes); for an error ``a`` is the length
of a UTF-8 message that follows.

- ``READ``: reply ``OK``, then ``nbytes`` raw bytes.
- ``WRITE``: reply ``OK`` ("go"), then the client sends ``nbytes`` raw bytes,
  then a second reply ``OK`` once they are in the owner's memory.
- ``DROP`` / ``CHECK``: one reply.
- ``SHM_MAP`` (Unix sockets only): if the registered memory is itself shared
  memory (a torch tensor after ``share_memory_()``) the reply carries
  ``DIRECT``, ``a`` = size of the mapping, ``b`` = offset of the buffer in it,
  and the descriptor follows; the client maps it once and from then on copies
  directly (one memcpy), asking only ``CHECK`` before each transfer.
- ``SHM_READ`` / ``SHM_WRITE`` (Unix sockets only), for memory that is not
  shared: the owner copies into (or out of) a memfd staging area of the
  connection, at most ``STAGE_MAX`` bytes per request.

A descriptor travels with SCM_RIGHTS on one marker byte ``b"F"``, and only
when the peer does not hold it yet (flag ``FD``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import struct
import time
from collections.abc import Callable

from ..transport import HANDSHAKE_BYTES, Handshake
from ._errors import RDMATimeoutError

__all__ = [
    "REQUEST", "REPLY", "READ", "WRITE", "DROP", "CHECK", "SHM_READ", "SHM_WRITE", "SHM_MAP",
    "OK", "NOT_FOUND", "BAD_RANGE", "READONLY", "FAILED", "FD", "DIRECT",
    "STAGE_MAX", "handshake", "recv_exact", "send_exact", "send_fd", "recv_fd", "Staging",
    "remaining", "ConnectionClosed",
]

REQUEST = struct.Struct("!BBxxIQQQ")
REPLY = struct.Struct("!BBxxxxxxQQ")

READ, WRITE, DROP, CHECK, SHM_READ, SHM_WRITE, SHM_MAP = 1, 2, 3, 4, 5, 6, 7
OK, NOT_FOUND, BAD_RANGE, READONLY, FAILED = 0, 1, 2, 3, 4
# flags
FD, DIRECT = 1, 2

STAGE_MAX = 64 << 20


class ConnectionClosed(ConnectionError):
    """The peer closed the connection in the middle of a message."""


def remaining(deadline: float) -> float:
    """Seconds left before ``deadline`` (monotonic); raises RDMATimeoutError when none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise RDMATimeoutError("timed out")
    return left


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None, chunk: int = 1 << 62, on_chunk: Callable[[int], None] | None = None) -> None:
    """Fill ``view`` from ``sock`` (no over-read). Raises ConnectionClosed on EOF."""
    got, total = 0, len(view)
    while got < total:
        sock.settimeout(None if deadline is None else remaining(deadline))
        n = sock.recv_into(view[got : min(total, got + chunk)])
        if n == 0:
            raise ConnectionClosed(f"connection closed after {got} of {total} bytes")
        got += n
        if on_chunk is not None:
            on_chunk(got)


def send_exact(sock: socket.socket, view: memoryview, deadline: float | None, chunk: int = 1 << 62, on_chunk: Callable[[int], None] | None = None) -> None:
    """Send all of ``view`` in chunks, each bounded by the deadline."""
    sent, total = 0, len(view)
    while sent < total:
        sock.settimeout(None if deadline is None else remaining(deadline))
        end = min(total, sent + chunk)
        sock.sendall(view[sent:end])
        sent = end
        if on_chunk is not None:
            on_chunk(sent)


def handshake(sock: socket.socket, secret: bytes, *, dialer: bool, deadline: float) -> None:
    """Run the job's HMAC handshake on a blocking socket; AuthenticationError on failure.

    Reads exactly ``HANDSHAKE_BYTES``, never more, so the first request is untouched.
    """
    hs = Handshake(secret, dialer=dialer)
    sock.settimeout(remaining(deadline))
    sock.sendall(hs.start())
    got = 0
    while not hs.done:
        sock.settimeout(remaining(deadline))
        data = sock.recv(HANDSHAKE_BYTES - got)
        if not data:
            raise ConnectionClosed("peer closed the connection during the handshake")
        got += len(data)
        out = hs.receive(data)
        if out:
            sock.sendall(out)


def send_fd(sock: socket.socket, fd: int) -> None:
    """Pass ``fd`` to the peer (SCM_RIGHTS on one marker byte)."""
    socket.send_fds(sock, [b"F"], [fd])


def recv_fd(sock: socket.socket, deadline: float | None) -> int:
    """Receive one descriptor sent with :func:`send_fd`."""
    sock.settimeout(None if deadline is None else remaining(deadline))
    data, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if data != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ConnectionClosed("expected a file descriptor from the peer")
    return fds[0]


class Staging:
    """A memfd staging area: created by one side, mapped by both (no name in /dev/shm).

    ``Staging(n)`` creates one (keeps its descriptor to send it);
    ``Staging(n, fd=received)`` maps a received one and closes the descriptor
    (the mapping keeps the memory). The memory goes with the last mapping.
    """

    def __init__(self, nbytes: int, fd: int | None = None, offset: int = 0) -> None:
        self.capacity = nbytes
        self.fd: int | None = None
        if fd is None:
            fd = self.fd = os.memfd_create("actormesh-rdma-stage", os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
        try:
            self.map = mmap.mmap(fd, nbytes)
        finally:
            if self.fd is None:
                os.close(fd)
        # The address, for memmove; the temporary export is released at once.
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map)) + offset

    @staticmethod
    def size_for(nbytes: int) -> int:
        """Capacity for a request of ``nbytes``: a power of two, 1 MiB to STAGE_MAX."""
        cap = 1 << 20
        while cap < nbytes:
            cap <<= 1
        return min(cap, STAGE_MAX)

    def close(self) -> None:
        """Unmap and close the descriptor. Only when no other thread copies through it."""
        try:
            self.map.close()
        except (BufferError, ValueError):
            pass
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
