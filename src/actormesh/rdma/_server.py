"""The owner's bulk server: serves reads and writes of this process's registered memory.

Started lazily by the first ``RDMABuffer`` of a process. It listens on TCP
(``ACTORMESH_RDMA_BIND_HOST``, default the job's ``bind_host``, port chosen by
the kernel) for peers on other hosts, and on an abstract Unix socket (no file
to clean up; it vanishes with the process) for same-host peers that need the
shared-memory path or a dropped-buffer notice. One selector thread accepts
and authenticates (a bounded number of handshakes at once, oldest shed); each
authenticated connection then gets a thread whose copies run with the GIL
released (``sendall``/``recv_into``/``memmove``). Every connection must pass
the job's HMAC handshake before a byte of request is read. Same-host ``process_vm`` transfers never reach this server.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ..config import get_config
from ..errors import AuthenticationError
from ..transport import HANDSHAKE_BYTES, Handshake
from . import _wire as W
from ._backends import chunk_bytes
from ._errors import RDMATimeoutError
from ._memory import memmove, view_at
from ._registry import Registration, Registry

log = logging.getLogger("actormesh.rdma")

__all__ = ["BulkServer", "ensure_server"]


#: Connections that may sit in the handshake at once; beyond it the oldest is shed.
MAX_PENDING_HANDSHAKES = 64
# After accept() fails for want of descriptors, the listeners rest this long
# (else a listener that stays readable spins the handshake thread).
_ACCEPT_PAUSE_S = 0.5


class _Pending:
    """A connection inside the handshake (sans-I/O Handshake, non-blocking socket)."""

    __slots__ = ("sock", "kind", "hs", "got", "deadline")

    def __init__(self, sock: socket.socket, kind: str, hs: Handshake, deadline: float) -> None:
        self.sock, self.kind, self.hs, self.got, self.deadline = sock, kind, hs, 0, deadline


class BulkServer:
    """Listening sockets, one handshake thread, one thread per authenticated connection.

    Unauthenticated connections cost no thread: one selector thread accepts
    and runs every handshake, at most ``MAX_PENDING_HANDSHAKES`` at a time
    (the oldest is shed for a new one), each bounded by ``handshake_timeout``.
    Only a peer that proved the job secret gets a serving thread.
    """

    def __init__(self, secret: Callable[[], bytes], registry: Registry, bind_host: str) -> None:
        self._secret = secret  # read per connection: a restarted runtime has a new job secret
        self._registry = registry
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._tcp = socket.socket(family, socket.SOCK_STREAM)
        self._tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._tcp.bind((bind_host, 0))
        self._tcp.listen(128)
        host, port = self._tcp.getsockname()[:2]
        self.tcp_address: tuple[str, int] = (host, port)
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix_address = f"\0actormesh-rdma-{os.getpid()}-{os.urandom(8).hex()}"
        self._unix.bind(self.unix_address)
        self._unix.listen(128)
        self._pending: dict[socket.socket, _Pending] = {}  # insertion order: oldest first
        #: Connections shed to make room, and handshakes that failed or timed out.
        self.shed = 0
        self.refused = 0
        threading.Thread(target=self._handshake_loop, name="actormesh-rdma-accept", daemon=True).start()

    def __repr__(self) -> str:
        return f"<BulkServer tcp={self.tcp_address} unix={self.unix_address[1:]!r}>"

    def _handshake_loop(self) -> None:
        try:
            self._run_handshakes()
        except Exception:  # pragma: no cover - a bug here must at least be visible
            log.exception("rdma server: the handshake thread failed; no new connections are accepted")

    def _run_handshakes(self) -> None:
        sel = selectors.DefaultSelector()
        listeners = {self._tcp: "tcp", self._unix: "unix"}
        for sock in listeners:
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
        paused_until = 0.0
        while True:
            now = time.monotonic()
            if paused_until and now >= paused_until:
                paused_until = 0.0
                for sock in listeners:
                    sel.register(sock, selectors.EVENT_READ)
            deadlines = [p.deadline for p in self._pending.values()] + ([paused_until] if paused_until else [])
            events = sel.select(max(0.0, min(deadlines) - now) if deadlines else None)
            for key, _ in events:
                ready: Any = key.fileobj  # a listener or a pending connection's socket
                if ready in listeners:
                    if not self._accept(sel, ready, listeners[ready]):
                        for lsock in listeners:
                            sel.unregister(lsock)
                        paused_until = time.monotonic() + _ACCEPT_PAUSE_S
                        break
                else:
                    self._advance(sel, self._pending.get(ready))  # type: ignore[arg-type]
            now = time.monotonic()
            for pending in [p for p in self._pending.values() if p.deadline <= now]:
                log.debug("rdma handshake timed out")
                self._drop(sel, pending)

    def _accept(self, sel: selectors.BaseSelector, listener: socket.socket, kind: str) -> bool:
        """Accept one connection; False when out of descriptors (pause accepting)."""
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                log.warning("rdma server: cannot accept a connection: %s", exc)
                return False
            return True
        try:
            conn.setblocking(False)
            if kind == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hs = Handshake(self._secret(), dialer=False)
            conn.send(hs.start())  # a few dozen bytes: an empty socket buffer takes them
        except Exception as exc:  # one peer (or a runtime without a secret yet) must not stop the server
            log.debug("rdma connection ended before its handshake: %s", exc)
            conn.close()
            return True
        pending = _Pending(conn, kind, hs, time.monotonic() + get_config().handshake_timeout)
        self._pending[conn] = pending
        sel.register(conn, selectors.EVENT_READ)
        while len(self._pending) > MAX_PENDING_HANDSHAKES:
            self.shed += 1
            self._drop(sel, next(iter(self._pending.values())))
        return True

    def _advance(self, sel: selectors.BaseSelector, p: _Pending | None) -> None:
        if p is None:
            return
        try:
            data = p.sock.recv(HANDSHAKE_BYTES - p.got)  # never past the handshake
            if not data:
                raise W.ConnectionClosed("peer closed the connection during the handshake")
            p.got += len(data)
            reply = p.hs.receive(data)
            if reply:
                p.sock.send(reply)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, W.ConnectionClosed, AuthenticationError) as exc:
            log.debug("rdma handshake failed: %s", exc)
            self.refused += 1
            self._drop(sel, p)
            return
        if p.hs.done:
            sel.unregister(p.sock)
            del self._pending[p.sock]
            p.sock.setblocking(True)
            threading.Thread(target=self._serve, args=(p.sock, p.kind), name="actormesh-rdma-conn", daemon=True).start()

    def _drop(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        self._pending.pop(p.sock, None)
        try:
            sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        p.sock.close()

    def pending_handshakes(self) -> int:
        """Connections in the handshake now (at most MAX_PENDING_HANDSHAKES)."""
        return len(self._pending)

    def _serve(self, conn: socket.socket, kind: str) -> None:
        session = _Session(conn, kind, self._registry)
        try:
            session.run()
        except (OSError, W.ConnectionClosed, RDMATimeoutError) as exc:
            log.debug("rdma connection ended: %s", exc)
        except Exception:  # never let one bad peer take anything else down
            log.exception("rdma connection failed")
        finally:
            session.close()


class _Session:
    """One authenticated connection: serves requests one at a time until EOF."""

    def __init__(self, conn: socket.socket, kind: str, registry: Registry) -> None:
        self.conn = conn
        self.kind = kind
        self.registry = registry
        self.read_stage: W.Staging | None = None  # ours: staged reads are copied out through it
        self.write_stage: W.Staging | None = None  # the client's: staged writes arrive in it
        self.header = bytearray(W.REQUEST.size)

    def close(self) -> None:
        for stage in (self.read_stage, self.write_stage):
            if stage is not None:
                stage.close()
        self.conn.close()

    def reply(self, status: int, flags: int = 0, a: int = 0, b: int = 0) -> None:
        self.conn.sendall(W.REPLY.pack(status, flags, a, b))

    def fail(self, status: int, message: str) -> None:
        data = message.encode()
        self.conn.sendall(W.REPLY.pack(status, 0, len(data), 0) + data)

    def run(self) -> None:
        view = memoryview(self.header)
        while True:
            try:
                W.recv_exact(self.conn, view, None)
            except W.ConnectionClosed:
                return  # the peer is done with this connection
            op, flags, timeout_ms, reg_id, offset, nbytes = W.REQUEST.unpack(self.header)
            deadline = time.monotonic() + max(timeout_ms, 1) / 1000.0
            if op == W.DROP:
                self.registry.drop(reg_id)
                self.reply(W.OK)
                continue
            reg = self.registry.get(reg_id)
            if reg is None:
                self.refuse(op, flags, deadline, W.NOT_FOUND, "the buffer was dropped (no such registration)")
                continue
            if op == W.CHECK:
                self.reply(W.OK)
                continue
            if op == W.SHM_MAP and self.kind == "unix":
                self.shm_map(reg)
                continue
            if offset + nbytes > reg.region.nbytes:
                self.refuse(op, flags, deadline, W.BAD_RANGE, f"bytes [{offset}, {offset + nbytes}) are outside the buffer of {reg.region.nbytes} bytes")
                continue
            writing = op in (W.WRITE, W.SHM_WRITE)
            if writing and reg.region.readonly:
                self.refuse(op, flags, deadline, W.READONLY, "the buffer is read-only (registered from read-only memory)")
                continue
            if op == W.READ:
                self.reply(W.OK)
                _send_region(self.conn, reg, offset, nbytes, deadline)
            elif op == W.WRITE:
                self.reply(W.OK)
                _recv_region(self.conn, reg, offset, nbytes, deadline)
                self.reply(W.OK)
            elif op in (W.SHM_READ, W.SHM_WRITE) and self.kind == "unix":
                self.staged(op, flags, reg, offset, nbytes, deadline)
            else:
                self.fail(W.FAILED, f"unknown or unsupported request {op} on a {self.kind} connection")

    def refuse(self, op: int, flags: int, deadline: float, status: int, message: str) -> None:
        """Refuse a request; consume a staging descriptor that was already on its way."""
        if op == W.SHM_WRITE and flags & W.FD:
            self.take_stage(W.recv_fd(self.conn, deadline))
        self.fail(status, message)

    def take_stage(self, fd: int) -> None:
        if self.write_stage is not None:
            self.write_stage.close()
        self.write_stage = W.Staging(os.fstat(fd).st_size, fd=fd)

    def shm_map(self, reg: Registration) -> None:
        if reg.shm is None or not reg.region.is_cpu:
            self.reply(W.OK)  # not shared memory: use staged requests
            return
        fd, size, base = reg.shm
        self.reply(W.OK, W.DIRECT | W.FD, size, base)
        W.send_fd(self.conn, fd)

    def staged(self, op: int, flags: int, reg: Registration, offset: int, nbytes: int, deadline: float) -> None:
        if op == W.SHM_WRITE and flags & W.FD:  # the client's (new) staging area comes first
            self.take_stage(W.recv_fd(self.conn, deadline))
        if nbytes > W.STAGE_MAX or not reg.region.is_cpu:
            self.fail(W.BAD_RANGE, f"a staged request moves at most {W.STAGE_MAX} bytes of CPU memory")
            return
        if op == W.SHM_READ:
            new = self.read_stage is None or self.read_stage.capacity < nbytes
            if new:
                if self.read_stage is not None:
                    self.read_stage.close()
                self.read_stage = W.Staging(W.Staging.size_for(nbytes))
            stage = self.read_stage
            assert stage is not None
            memmove(stage.address, reg.region.address + offset, nbytes)
            self.reply(W.OK, W.FD if new else 0, stage.capacity, 0)
            if new:
                assert stage.fd is not None  # a new staging area has its descriptor
                W.send_fd(self.conn, stage.fd)
            return
        if self.write_stage is None or self.write_stage.capacity < nbytes:
            self.fail(W.FAILED, "staged write without a large enough staging area from the client")
            return
        memmove(reg.region.address + offset, self.write_stage.address, nbytes)
        self.reply(W.OK)


def _send_region(conn: socket.socket, reg: Registration, offset: int, nbytes: int, deadline: float) -> None:
    region = reg.region
    if region.is_cpu:
        W.send_exact(conn, view_at(region.address + offset, nbytes), deadline, chunk=chunk_bytes())
        return
    # GPU memory: stage through host memory, one chunk at a time.
    import torch

    flat = region.keep.view(torch.uint8)
    step = chunk_bytes()
    for start in range(offset, offset + nbytes, step):
        host = flat[start : min(offset + nbytes, start + step)].cpu()
        W.send_exact(conn, view_at(host.data_ptr(), host.numel()), deadline)


def _recv_region(conn: socket.socket, reg: Registration, offset: int, nbytes: int, deadline: float) -> None:
    region = reg.region
    if region.is_cpu:
        W.recv_exact(conn, view_at(region.address + offset, nbytes), deadline, chunk=chunk_bytes())
        return
    import torch

    flat = region.keep.view(torch.uint8)
    step = chunk_bytes()
    host = torch.empty(min(step, nbytes), dtype=torch.uint8)
    for start in range(offset, offset + nbytes, step):
        n = min(offset + nbytes, start + step) - start
        W.recv_exact(conn, view_at(host.data_ptr(), n), deadline)
        flat[start : start + n].copy_(host[:n])


_server: BulkServer | None = None
_server_lock = threading.Lock()


def ensure_server(secret: Callable[[], bytes], registry: Registry, bind_host: str | None = None) -> BulkServer:
    """This process's bulk server, started on first use."""
    global _server
    if _server is None:
        with _server_lock:
            if _server is None:
                host = bind_host or os.environ.get("ACTORMESH_RDMA_BIND_HOST") or get_config().bind_host
                _server = BulkServer(secret, registry, host)
    return _server

