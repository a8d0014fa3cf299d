"""The peer side of the owner's bulk server: authenticated pooled connections, and
the ``shm`` and ``tcp`` backends built on them.

Connections are kept per owner address and reused (the handshake costs a
round trip); one transfer uses a connection at a time. A failure on a reused
connection before the owner answered is retried once on a fresh one (the
owner may have closed an idle connection); a fresh connection that fails
means the owner is gone.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from ..runtime import current_runtime
from . import _wire as W
from ._backends import BufferHandle, Unusable, _progress, chunk_bytes, dropped_or_gone, register_backend, same_host
from ._errors import BufferDroppedError, OwnerGoneError, RDMAError, RDMATimeoutError
from ._memory import memmove, proc_start_time, view_at
from ._registry import Registration

__all__ = ["ShmBackend", "TcpBackend", "drop_remote"]

_MAX_IDLE = 8


class _Conn:
    """One authenticated connection to an owner, plus its staging areas."""

    def __init__(self, sock: socket.socket, key: tuple[str, Any]) -> None:
        self.sock = sock
        self.key = key
        self.fresh = True
        self.read_stage: W.Staging | None = None  # the owner's, mapped here
        self.write_stage: W.Staging | None = None  # ours, sent to the owner once
        self.write_stage_sent = False

    def close(self) -> None:
        for stage in (self.read_stage, self.write_stage):
            if stage is not None:
                stage.close()
        self.sock.close()


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, Any], list[_Conn]] = {}

    def take(self, key: tuple[str, Any], deadline: float) -> _Conn:
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                conn = idle.pop()
                conn.fresh = False
                return conn
        kind, address = key
        sock = socket.socket(socket.AF_UNIX if kind == "unix" else (socket.AF_INET6 if ":" in address[0] else socket.AF_INET), socket.SOCK_STREAM)
        try:
            sock.settimeout(W.remaining(deadline))
            sock.connect(address)
            if kind == "tcp":
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            W.handshake(sock, current_runtime().secret, dialer=True, deadline=deadline)
        except BaseException:
            sock.close()
            raise
        return _Conn(sock, key)

    def give_back(self, conn: _Conn) -> None:
        with self._lock:
            idle = self._idle.setdefault(conn.key, [])
            if len(idle) < _MAX_IDLE:
                idle.append(conn)
                return
        conn.close()

    def forget(self, key: tuple[str, Any]) -> None:
        with self._lock:
            conns = self._idle.pop(key, [])
        for conn in conns:
            conn.close()


_pool = _Pool()


def _check(conn: _Conn, handle: BufferHandle, deadline: float) -> Any:
    """Is the registration still there (the owner answers, or raises what happened to it)."""
    _request(conn, W.CHECK, handle, 0, 0, deadline)
    return _reply(conn, handle, deadline)


def _drop(conn: _Conn, handle: BufferHandle, deadline: float) -> Any:
    _request(conn, W.DROP, handle, 0, 0, deadline)
    return _reply(conn, handle, deadline)


def _request(conn: _Conn, op: int, handle: BufferHandle, offset: int, nbytes: int, deadline: float, flags: int = 0) -> None:
    timeout_ms = min(int((deadline - time.monotonic()) * 1000) + 1, 2**32 - 1)
    conn.sock.settimeout(W.remaining(deadline))
    conn.sock.sendall(W.REQUEST.pack(op, flags, max(timeout_ms, 1), handle.reg_id, offset, nbytes))


def _reply(conn: _Conn, handle: BufferHandle, deadline: float) -> tuple[int, int, int]:
    raw = bytearray(W.REPLY.size)
    W.recv_exact(conn.sock, memoryview(raw), deadline)
    status, flags, a, b = W.REPLY.unpack(raw)
    if status == W.OK:
        return flags, a, b
    msg = bytearray(min(a, 1 << 16))
    W.recv_exact(conn.sock, memoryview(msg), deadline)
    text = msg.decode(errors="replace")
    if status == W.NOT_FOUND:
        raise BufferDroppedError(f"the RDMA buffer ({handle.nbytes} bytes) owned by {handle.describe_owner()} was dropped", owner=handle.owner)
    raise RDMAError(f"the owner of the RDMA buffer, {handle.describe_owner()}, refused the transfer: {text}", owner=handle.owner)


def _gone(handle: BufferHandle, exc: BaseException, how: str) -> OwnerGoneError:
    return OwnerGoneError(f"the owner of the RDMA buffer, {handle.describe_owner()}, died or is unreachable over {how}: {exc}", owner=handle.owner)


@contextmanager
def _connection(handle: BufferHandle, kind: str, deadline: float) -> Iterator[_Conn]:
    """A connection for one exchange; broken ones are closed, healthy ones pooled."""
    key: tuple[str, Any] = (kind, handle.unix if kind == "unix" else handle.tcp)
    try:
        conn = _pool.take(key, deadline)
    except RDMATimeoutError:
        raise
    except (OSError, W.ConnectionClosed) as exc:
        if isinstance(exc, TimeoutError):
            raise RDMATimeoutError(f"timed out connecting to the owner of the RDMA buffer, {handle.describe_owner()}", owner=handle.owner) from exc
        if kind == "unix" and proc_start_time(handle.pid) == handle.start_time:
            # Alive but not reachable this way (another network namespace): try the next backend.
            raise Unusable(f"the owner's Unix socket is unreachable from here: {exc}") from exc
        raise _gone(handle, exc, kind) from exc
    try:
        yield conn
    except BaseException:
        conn.close()
        raise
    _pool.give_back(conn)


def _exchange(handle: BufferHandle, kind: str, deadline: float, body: Callable[[_Conn], Any]) -> Any:
    """Run ``body`` on a connection; retry once on a fresh one if a pooled one was stale."""
    for attempt in (0, 1):
        try:
            with _connection(handle, kind, deadline) as conn:
                fresh = conn.fresh
                return body(conn)
        except (RDMAError, ValueError, Unusable):
            raise
        except TimeoutError as exc:
            raise RDMATimeoutError(f"the transfer with the owner of the RDMA buffer, {handle.describe_owner()}, timed out", owner=handle.owner) from exc
        except (OSError, W.ConnectionClosed) as exc:
            if attempt == 0 and not fresh:
                _pool.forget((kind, handle.unix if kind == "unix" else handle.tcp))
                continue
            if same_host(handle):
                gone = dropped_or_gone(handle)
                if isinstance(gone, OwnerGoneError):
                    raise gone from exc
            raise _gone(handle, exc, kind) from exc
    raise AssertionError("unreachable")


class TcpBackend:
    """A bulk TCP stream between the two processes, in chunks, raw bytes only."""

    name = "tcp"

    def usable(self, handle: BufferHandle) -> bool:
        return True

    def export(self, reg: Registration) -> dict[str, Any]:
        return {}

    def read(self, handle: BufferHandle, offset: int, local: int, nbytes: int, deadline: float) -> None:
        def body(conn: _Conn) -> None:
            _request(conn, W.READ, handle, offset, nbytes, deadline)
            _reply(conn, handle, deadline)
            W.recv_exact(conn.sock, view_at(local, nbytes), deadline, chunk_bytes(), _progress(self.name))

        _exchange(handle, "tcp", deadline, body)

    def write(self, handle: BufferHandle, offset: int, local: int, nbytes: int, deadline: float) -> None:
        def body(conn: _Conn) -> None:
            _request(conn, W.WRITE, handle, offset, nbytes, deadline)
            _reply(conn, handle, deadline)
            W.send_exact(conn.sock, view_at(local, nbytes), deadline, chunk_bytes(), _progress(self.name))
            _reply(conn, handle, deadline)

        _exchange(handle, "tcp", deadline, body)


class ShmBackend:
    """Same host without process_vm access: shared memory handed over the owner's Unix socket.

    Memory that is already shared (``tensor.share_memory_()``) is mapped once
    and copied directly (one memcpy). Other memory is staged through a memfd
    per connection: the owner copies it in (or out), the peer copies it out
    (or in), at most ``STAGE_MAX`` bytes per round trip.
    """

    name = "shm"

    def __init__(self) -> None:
        self._maps: dict[tuple[str, int], W.Staging | None] = {}
        self._lock = threading.Lock()

    def usable(self, handle: BufferHandle) -> bool:
        return same_host(handle) and handle.device == "cpu"

    def export(self, reg: Registration) -> dict[str, Any]:
        return {}

    def forget(self, handle: BufferHandle) -> None:
        """Unmap a direct mapping (the kernel unmaps when the last user lets go)."""
        with self._lock:
            self._maps.pop((handle.unix, handle.reg_id), None)

    def _direct(self, handle: BufferHandle, deadline: float) -> W.Staging | None:
        key = (handle.unix, handle.reg_id)
        with self._lock:
            if key in self._maps:
                return self._maps[key]

        def ask(conn: _Conn) -> W.Staging | None:
            _request(conn, W.SHM_MAP, handle, 0, 0, deadline)
            flags, size, base = _reply(conn, handle, deadline)
            if not flags & W.DIRECT:
                return None
            return W.Staging(size, fd=W.recv_fd(conn.sock, deadline), offset=base)

        mapping = _exchange(handle, "unix", deadline, ask)
        with self._lock:
            if len(self._maps) > 256:
                self._maps.clear()
            self._maps[key] = mapping
        return mapping

    def _move(self, handle: BufferHandle, offset: int, local: int, nbytes: int, deadline: float, write: bool) -> None:
        try:
            mapping = self._direct(handle, deadline)
            if mapping is not None:
                _exchange(handle, "unix", deadline, partial(_check, handle=handle, deadline=deadline))
                if write:
                    memmove(mapping.address + offset, local, nbytes)
                else:
                    memmove(local, mapping.address + offset, nbytes)
                return
            _exchange(handle, "unix", deadline, lambda conn: self._staged(conn, handle, offset, local, nbytes, deadline, write))
        except BufferDroppedError:
            self.forget(handle)
            raise

    def _staged(self, conn: _Conn, handle: BufferHandle, offset: int, local: int, nbytes: int, deadline: float, write: bool) -> None:
        progress = _progress(self.name)
        step = min(W.STAGE_MAX, chunk_bytes(W.STAGE_MAX))
        for start in range(0, nbytes, step):
            n = min(step, nbytes - start)
            if write:
                flags = 0
                if conn.write_stage is None or conn.write_stage.capacity < n:
                    if conn.write_stage is not None:
                        conn.write_stage.close()
                    conn.write_stage = W.Staging(W.Staging.size_for(n))
                    flags = W.FD
                memmove(conn.write_stage.address, local + start, n)
                _request(conn, W.SHM_WRITE, handle, offset + start, n, deadline, flags)
                if flags:
                    assert conn.write_stage.fd is not None
                    W.send_fd(conn.sock, conn.write_stage.fd)
                _reply(conn, handle, deadline)
            else:
                _request(conn, W.SHM_READ, handle, offset + start, n, deadline)
                flags, capacity, _ = _reply(conn, handle, deadline)
                if flags & W.FD:
                    if conn.read_stage is not None:
                        conn.read_stage.close()
                    conn.read_stage = W.Staging(capacity, fd=W.recv_fd(conn.sock, deadline))
                assert conn.read_stage is not None
                memmove(local + start, conn.read_stage.address, n)
            if progress is not None:
                progress(start + n)

    def read(self, handle: BufferHandle, offset: int, local: int, nbytes: int, deadline: float) -> None:
        self._move(handle, offset, local, nbytes, deadline, write=False)

    def write(self, handle: BufferHandle, offset: int, local: int, nbytes: int, deadline: float) -> None:
        self._move(handle, offset, local, nbytes, deadline, write=True)


def drop_remote(handle: BufferHandle, deadline: float) -> None:
    """Ask the owner to deregister; an owner that is gone has nothing left to drop."""
    _shm_backend.forget(handle)
    for kind in ("unix", "tcp") if same_host(handle) else ("tcp",):
        try:
            _exchange(handle, kind, deadline, partial(_drop, handle=handle, deadline=deadline))
            return
        except Unusable:
            continue
        except OwnerGoneError:
            return


_shm_backend = ShmBackend()
register_backend(_shm_backend)
register_backend(TcpBackend())
