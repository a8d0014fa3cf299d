"""The owner's bulk server: serves reads and writes of this process's registered memory.

Started lazily by the first ``RDMABuffer`` of a process. It listens on TCP
(``ACTORMESH_RDMA_BIND_HOST``, default the job's ``bind_host``, port chosen by
the kernel) for peers on other hosts, and on an abstract Unix socket (no file
to clean up; it vanishes with the process) for same-host peers that need the
shared-memory path or a dropped-buffer notice. One thread per connection:
copies run with the GIL released (``sendall``/``recv_into``/``memmove``).
Every connection must pass the job's HMAC handshake before a byte of request
is read. Same-host ``process_vm`` transfers never reach this server.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from ..config import get_config
from . import _wire as W
from ._backends import chunk_bytes
from ._errors import RDMATimeoutError
from ._memory import memmove, view_at
from ._registry import Registration, Registry

log = logging.getLogger("actormesh.rdma")

__all__ = ["BulkServer", "ensure_server"]


class BulkServer:
    """Listening sockets plus their accept threads; lives as long as the process."""

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
        for sock, kind in ((self._tcp, "tcp"), (self._unix, "unix")):
            threading.Thread(target=self._accept_loop, args=(sock, kind), name=f"actormesh-rdma-accept-{kind}", daemon=True).start()

    def __repr__(self) -> str:
        return f"<BulkServer tcp={self.tcp_address} unix={self.unix_address[1:]!r}>"

    def _accept_loop(self, listener: socket.socket, kind: str) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # listener closed
            threading.Thread(target=self._serve, args=(conn, kind), name="actormesh-rdma-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, kind: str) -> None:
        session = _Session(conn, kind, self._registry)
        try:
            if kind == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            W.handshake(conn, self._secret(), dialer=False, deadline=time.monotonic() + get_config().handshake_timeout)
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

