"""``PortForwarder``: TCP port forwarding between proc meshes over the job's own channels.

``forwarder.forward.call_one(dst_procs, dst_port, src_procs, "127.0.0.1:8000")``
makes every source proc listen on its address and relay each connection it
accepts to ``127.0.0.1:dst_port`` on the destination proc at the same mesh
point. The bytes travel as actor messages, so they ride the job's
authenticated (and, with TLS, encrypted) connections: a service bound to
loopback on a job host becomes reachable from the controller's machine with no
extra tunnel. Stopping the forwarder actor closes every forward it made.

Each relayed connection is two one-way pumps. A pump reads its socket and
sends ``("data", bytes)`` messages to the other side's port, then ``("eof",)``
(or ``("reset",)`` when its socket was reset); the receiving side writes the
data and half-closes on eof, or resets its own socket on reset. Every blocking wait
is bounded (socket timeouts, ``recv().get(timeout)``) and re-checks whether
the forward was closed, so cleanup never waits on a peer.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from ..mesh import Point, ProcMesh
from ..runtime import Actor, Channel, Port, context, endpoint
from ._inbox import Inbox

__all__ = ["PortForwarder"]

_CHUNK = 64 * 1024
_POLL_S = 0.5
_CONNECT_S = 10.0


def _check_port(what: str, port: Any) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"{what} must be a TCP port in 1..65535, got {port!r}")
    return port


def _parse_address(address: Any) -> tuple[str, int]:
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"src_address must be 'host:port' (e.g. '127.0.0.1:8000'), got {address!r}")
    host, _, port = address.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"src_address {address!r}: {port!r} is not a port number") from None
    return host.strip("[]") or "127.0.0.1", _check_port("the src_address port", number)


class _Relay:
    """The open connections of one forward actor; ``close()`` ends them all."""

    def __init__(self) -> None:
        self.closed = threading.Event()
        self.sockets: set[socket.socket] = set()
        self.lock = threading.Lock()

    def add(self, sock: socket.socket) -> None:
        with self.lock:
            if self.closed.is_set():
                sock.close()
                raise ConnectionAbortedError("the port forward was closed")
            self.sockets.add(sock)

    def close(self) -> None:
        self.closed.set()
        with self.lock:
            socks, self.sockets = list(self.sockets), set()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in sendall, which close() alone does not
            except OSError:
                pass
            s.close()

    def pump_out(self, sock: socket.socket, to: Port[Any], reset: threading.Event, out_done: threading.Event) -> None:
        """Socket -> port, until eof, error or close. A reset (an error reading)
        travels as ``("reset",)`` so the far side resets its socket too."""
        end: tuple[str, ...] = ("eof",)
        try:
            while not self.closed.is_set() and not reset.is_set():
                readable, _, _ = select.select([sock], [], [], _POLL_S)
                if not readable:
                    continue
                data = sock.recv(_CHUNK)
                if not data:
                    break
                to.send(("data", data))
        except (OSError, ValueError):  # reset by the peer, or closed under us
            end = ("reset",)
        to.send(end)
        out_done.set()

    def pump_in(self, sock: socket.socket, receiver: Any, to: Port[Any], reset: threading.Event, out_done: threading.Event) -> None:
        """Port -> socket, until reset or close, or eof once the other direction ended
        too: eof half-closes the socket; a reset (either end's) resets it and
        tells the far side. After eof it still listens for a reset."""
        inbox = Inbox(receiver)
        half_closed = False
        try:
            while not self.closed.is_set() and not (half_closed and out_done.is_set()):
                message = inbox.next(_POLL_S)
                if message is None:
                    continue
                if message[0] == "reset":
                    reset.set()  # our reader stops too (a peer still sending would keep it busy)
                    _reset(sock)
                    break
                if message[0] != "data":
                    if not half_closed:
                        half_closed = True
                        sock.shutdown(socket.SHUT_WR)
                    continue
                try:
                    sock.sendall(message[1])
                except OSError:
                    to.send(("reset",))  # our end was reset: so is the far one
                    reset.set()
                    _reset(sock)
                    break
        except OSError:
            pass
        finally:
            receiver.close()

    def relay(self, sock: socket.socket, to: Port[Any], receiver: Any) -> None:
        """Run both pumps for one connection on threads; the socket closes when both end."""
        reset, out_done = threading.Event(), threading.Event()
        threads = [threading.Thread(target=self.pump_out, args=(sock, to, reset, out_done), daemon=True),
                   threading.Thread(target=self.pump_in, args=(sock, receiver, to, reset, out_done), daemon=True)]
        for t in threads:
            t.start()

        def reap() -> None:
            for t in threads:
                while t.is_alive():  # each pump ends within _POLL_S of eof, an error or close()
                    t.join(_POLL_S * 4)
            with self.lock:
                self.sockets.discard(sock)
            sock.close()

        threading.Thread(target=reap, daemon=True).start()


def _reset(sock: socket.socket) -> None:
    """Abort a TCP connection: linger 0 makes the reaper's close() send RST, not FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Destination(Actor):
    """Connects to the service on its own loopback for every relayed connection."""

    def __init__(self) -> None:
        self.port: int | None = None
        self.relay = _Relay()

    @endpoint
    def configure(self, dst_port: int | Callable[[Point], int]) -> None:
        self.port = _check_port("dst_port", dst_port(context().message_rank) if callable(dst_port) else dst_port)

    @endpoint
    def open(self, to_source: Port[Any]) -> Port[Any]:
        if self.port is None:
            raise RuntimeError("this port forward's destination was not configured")
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=_CONNECT_S)
        self.relay.add(sock)
        port, receiver = Channel.open()
        self.relay.relay(sock, to_source, receiver)
        return port

    def __cleanup__(self, exc: Exception | None) -> None:
        self.relay.close()


class _Source(Actor):
    """Listens on its address and relays each accepted connection to its destination."""

    def __init__(self) -> None:
        self.relay = _Relay()
        self.listener: socket.socket | None = None
        self.acceptor: threading.Thread | None = None

    @endpoint
    def start(self, destination: Any, src_address: str | Callable[[Point], str]) -> str:
        point = context().message_rank
        host, port = _parse_address(src_address(point) if callable(src_address) else src_address)
        peer = destination.slice(**dict(point)) if len(point.extent) else destination
        # reuse_port: the procs of one host may share a source address (the kernel spreads connections).
        listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                        reuse_port=hasattr(socket, "SO_REUSEPORT"))
        listener.settimeout(_POLL_S)
        self.listener = listener
        self.acceptor = threading.Thread(target=self._accept, args=(listener, peer), name="actormesh-port-forward", daemon=True)
        self.acceptor.start()
        return f"{host}:{listener.getsockname()[1]}"

    def _accept(self, listener: socket.socket, peer: Any) -> None:
        while not self.relay.closed.is_set():
            try:
                sock, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                self.relay.add(sock)
                port, receiver = Channel.open()
                to_destination = peer.open.call_one(port).get(timeout=_CONNECT_S + 5)
            except Exception:  # the destination could not connect: drop this connection only
                sock.close()
                continue
            self.relay.relay(sock, to_destination, receiver)

    def __cleanup__(self, exc: Exception | None) -> None:
        self.relay.close()
        if self.listener is not None:
            try:
                # A thread blocked in accept() keeps a closed listener open until it returns; shutdown wakes it.
                self.listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.listener.close()
        if self.acceptor is not None:
            self.acceptor.join(_POLL_S * 4)  # the port is free once this returns


class PortForwarder(Actor):
    """Owns port forwards: spawn one (``this_proc().spawn("fwd", PortForwarder)``),
    call :meth:`forward` per forward, stop it to close them all."""

    def __init__(self) -> None:
        self.meshes: list[Any] = []

    @endpoint
    def forward(self, dst_proc_mesh: ProcMesh, dst_port: int | Callable[[Point], int], src_proc_mesh: ProcMesh,
                src_address: str | Callable[[Point], str]) -> list[str]:
        """Forward ``src_address`` on every source proc to ``127.0.0.1:dst_port`` on the destination
        proc at the same point; returns the listening addresses (rank order).

        The meshes must have the same extent. Static ``dst_port`` /
        ``src_address`` are checked here; per-point ones (functions of the
        proc's ``Point``) on each proc. A failure stops what was started.
        """
        if not isinstance(dst_proc_mesh, ProcMesh) or not isinstance(src_proc_mesh, ProcMesh):
            raise TypeError("forward() needs two ProcMeshes (destination, source)")
        if dict(dst_proc_mesh.extent) != dict(src_proc_mesh.extent):
            raise ValueError(f"destination and source proc meshes must have the same shape: {dst_proc_mesh.extent} != {src_proc_mesh.extent}")
        if not callable(dst_port):
            _check_port("dst_port", dst_port)
        if not callable(src_address):
            _parse_address(src_address)
        suffix = os.urandom(4).hex()
        destination = dst_proc_mesh.spawn(f"port_forward_destination_{suffix}", _Destination)
        source = src_proc_mesh.spawn(f"port_forward_source_{suffix}", _Source)
        try:
            destination.configure.call(dst_port).get(timeout=60)
            listening = source.start.call(destination, src_address).get(timeout=60)
        except BaseException:
            started: list[Any] = [source, destination]  # ActorMeshes (spawn is typed as returning the class)
            for mesh in started:
                try:
                    mesh.stop().get(timeout=30)
                except Exception:
                    pass
            raise
        self.meshes += [source, destination]
        return list(listening.values())

    def __cleanup__(self, exc: Exception | None) -> None:
        for mesh in self.meshes:
            try:
                mesh.stop().get(timeout=30)
            except Exception:
                pass
