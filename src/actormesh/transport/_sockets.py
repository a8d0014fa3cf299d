"""Listening and dialing: sockets that become authenticated :class:`Connection` s.

``listen`` serves ``unix:/path`` (socket file 0600) or ``tcp:host:port``;
``connect`` dials with jittered back-off until its deadline. Both build their
connections with the same options (frame limit, handshake deadline, TLS,
shared-memory pool).
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import socket
import ssl
import struct
import sys
from collections.abc import Callable
from typing import Any

from ..errors import AuthenticationError, TransportError
from ._connection import CloseHandler, Connection, FrameHandler
from ._lanes import BULK_MIN_BYTES
from ._shm import ShmPool

__all__ = ["Listener", "connect", "listen", "parse_address", "receive_window_bytes", "tune_tcp"]


def parse_address(address: str) -> tuple[str, Any]:
    """Split ``unix:/path`` or ``tcp:host:port`` into (scheme, target)."""
    scheme, _, rest = address.partition(":")
    if scheme == "unix" and rest:
        return "unix", rest
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        host = host.strip("[]")
        if host and port.isdigit():
            return "tcp", (host, int(port))
    raise ValueError(f"bad address {address!r}: expected 'unix:/path' or 'tcp:host:port'")


class Listener:
    """A listening socket; ``address`` is what peers dial."""

    def __init__(self, server: asyncio.AbstractServer, address: str, path: str | None, gate: _HandshakeGate) -> None:
        self._server = server
        self.address = address
        self._path = path
        #: The connections still in their handshake (bounded).
        self.gate = gate

    def close(self) -> None:
        """Stop accepting (existing connections stay) and remove a Unix socket file."""
        self._server.close()
        if self._path:
            try:
                os.unlink(self._path)
            except OSError:
                pass


#: Connections a listener lets sit in the handshake at once; beyond it the oldest is shed.
MAX_UNAUTHENTICATED = 128


class _HandshakeGate:
    """Bounds the unauthenticated connections of one listener, shedding the oldest.

    A flood of connections that never authenticate would otherwise hold one
    descriptor each until their handshake deadline, and a full descriptor table
    breaks everything else the process does (opening shared memory, files).
    A real peer that gets shed retries (``connect`` backs off until its deadline).
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._pending: dict[Connection, None] = {}  # insertion order: oldest first
        #: Connections closed to make room (for diagnostics and tests).
        self.shed = 0

    def admit(self, conn: Connection) -> None:
        """Track ``conn`` until its handshake ends; shed the oldest beyond the limit."""
        if conn.ready.done() or conn.closed:
            return
        self._pending[conn] = None
        conn.ready.add_done_callback(lambda _f: self._pending.pop(conn, None))
        excess = len(self._pending) - self._limit
        for old in list(self._pending)[:max(0, excess)]:
            if old._transport is None:
                continue  # not connected yet (e.g. inside TLS): its own deadline bounds it
            del self._pending[old]
            self.shed += 1
            old._abort(AuthenticationError("shed: too many connections waiting to authenticate"))

    def __len__(self) -> int:
        return len(self._pending)


def _factory(secret: bytes, dialer: bool, loop: asyncio.AbstractEventLoop, opts: dict[str, Any]) -> Callable[[], Connection]:
    def make() -> Connection:
        return Connection(secret, dialer=dialer, loop=loop, **opts)

    return make


async def listen(
    address: str,
    secret: bytes,
    *,
    on_connection: Callable[[Connection], None],
    on_frame: FrameHandler,
    on_close: CloseHandler,
    max_frame_bytes: int,
    handshake_timeout_s: float,
    ssl_context: ssl.SSLContext | None = None,
    shm: ShmPool | None = None,
    max_unauthenticated: int = MAX_UNAUTHENTICATED,
    dead_after_s: float | None = None,
    bulk_lane_bytes: int = BULK_MIN_BYTES,
) -> Listener:
    """Listen on ``unix:/path`` or ``tcp:host:port`` (port 0 picks a free one).

    ``on_connection`` runs once a peer has authenticated. With ``shm``, large
    segments to same-host peers travel through that pool's shared memory. At
    most ``max_unauthenticated`` connections wait in the handshake at once:
    the oldest is closed to admit a new one. ``dead_after_s``: TCP keepalive and
    ``TCP_USER_TIMEOUT`` on accepted connections (see :func:`tune_tcp`).
    ``bulk_lane_bytes``: frames this large take the bulk lane (_lanes.py); 0 = never.
    """
    loop = asyncio.get_running_loop()
    scheme, target = parse_address(address)
    opts = dict(max_frame_bytes=max_frame_bytes, handshake_timeout_s=handshake_timeout_s, on_frame=on_frame, on_close=on_close, shm=shm,
                tune=functools.partial(tune_tcp, dead_after_s=dead_after_s), lanes=0 if ssl_context else bulk_lane_bytes)
    inner = _factory(secret, False, loop, opts)

    gate = _HandshakeGate(max_unauthenticated)

    def make() -> Connection:
        conn = inner()
        conn.ready.add_done_callback(lambda f: None if f.exception() else on_connection(conn))
        loop.call_soon(gate.admit, conn)  # once connection_made has given it a transport
        return conn

    if scheme == "unix":
        server = await loop.create_unix_server(make, target)
        os.chmod(target, 0o600)  # only our own user may even attempt a handshake
        return Listener(server, address, target, gate)
    host, port = target
    server = await loop.create_server(make, host, port, reuse_address=True, ssl=ssl_context, ssl_handshake_timeout=handshake_timeout_s if ssl_context else None)
    sock = server.sockets[0]
    bound_host, bound_port = sock.getsockname()[:2]
    if bound_host in ("0.0.0.0", "::"):
        bound_host = socket.gethostname()  # a wildcard cannot be dialed: advertise our name
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return Listener(server, f"tcp:{shown}:{bound_port}", None, gate)


#: The link rate a receive window is sized for (100 Gb/s): the window never holds a link back below it.
LINK_BYTES_PER_S = 12.5e9
#: The smallest receive buffer set (a window under load must not stall a fast hop).
MIN_RCVBUF_BYTES = 128 * 1024
#: Windows this large or more are left to the kernel's autotuning.
AUTOTUNE_RCVBUF_BYTES = 4 << 20
_TCP_INFO = getattr(socket, "TCP_INFO", 11 if sys.platform == "linux" else None)
_TCPI_RTT = struct.Struct("<I")  # tcpi_rtt, microseconds, at byte 68 of Linux's struct tcp_info
_TCPI_RTT_OFFSET = 68


def receive_window_bytes(rtt_s: float | None) -> int | None:
    """The receive buffer for a link with round trip ``rtt_s``, or None to leave it to the kernel.

    The bytes a ``LINK_BYTES_PER_S`` link carries in one round trip (what TCP
    needs in flight to fill it); at least ``MIN_RCVBUF_BYTES``. A
    hop within a rack (tens of microseconds) gets a few hundred KiB instead of
    the megabytes autotuning reaches; a long link (at or over
    ``AUTOTUNE_RCVBUF_BYTES``) or an unknown round trip keeps the kernel's.

    >>> receive_window_bytes(5e-6) == MIN_RCVBUF_BYTES, receive_window_bytes(40e-6), receive_window_bytes(1e-3)
    (True, 500000, None)
    """
    if not rtt_s or rtt_s <= 0:
        return None
    window = int(rtt_s * LINK_BYTES_PER_S)
    if window >= AUTOTUNE_RCVBUF_BYTES:
        return None
    return max(MIN_RCVBUF_BYTES, window)


def _rtt_s(sock: Any) -> float | None:
    """The kernel's round-trip estimate for a connected TCP socket (from its handshake), if it has one."""
    if _TCP_INFO is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 104)
    except OSError:
        return None
    if len(info) < _TCPI_RTT_OFFSET + 4:
        return None
    rtt_us = _TCPI_RTT.unpack_from(info, _TCPI_RTT_OFFSET)[0]
    return rtt_us / 1e6 if rtt_us else None


#: Unsent bytes the kernel holds per TCP socket before it stops taking more (Linux),
#: on a link whose receive buffer is left to autotuning; with a window set, a quarter of it.
NOTSENT_LOWAT_BYTES = 128 * 1024
_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25 if sys.platform == "linux" else None)


def tune_tcp(sock: Any, dead_after_s: float | None) -> None:
    """No Nagle delay; at most ``NOTSENT_LOWAT_BYTES`` unsent in the kernel; a
    receive buffer sized for the link (see :func:`receive_window_bytes`); with
    ``dead_after_s``, the kernel gives up on a dead link by then.

    Runs on every TCP connection as soon as it has a socket (dialed and accepted).

    Why the unsent limit: the kernel's send buffer grows to megabytes, and a small
    frame written behind a large one waits until all of it is on the wire (a few
    ms at link speed). Large frames are written a batch at a time (see
    _outgoing.py), so with the limit a small frame waits for about a batch.
    A short link gets a quarter of its window: the event loop refills the
    kernel long before that much has gone out at its rate, and a small frame
    waits for less of a large one.
    Why the receive buffer: what the sender has sent and the receiving process
    has not yet read is bounded by the receiver's window, and a small frame
    waits behind all of it. The kernel's autotuning grows that to tens of
    megabytes when the reading process is slower than the link (a busy host),
    which is tens of milliseconds ahead of every small message.

    Keepalive probes an idle link and ``TCP_USER_TIMEOUT`` bounds how long sent
    data may stay unacknowledged, so a peer behind a network partition is never
    held for the kernel's default of about 15 minutes. The runtime's own link
    watch (heartbeats) decides first; this is the backstop.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    window = receive_window_bytes(_rtt_s(sock))
    if window:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, window)
    if _NOTSENT_LOWAT is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _NOTSENT_LOWAT, window // 4 if window else NOTSENT_LOWAT_BYTES)
        except OSError:
            pass  # an older kernel: small frames may wait behind more of a large one
    if not dead_after_s:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(dead_after_s / 2))
    interval = max(1, int(dead_after_s / 6))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", int(dead_after_s * 1000))):
        option = getattr(socket, name, None)
        if option is not None:  # Linux has all four; others keep what they support
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


async def connect(
    address: str,
    secret: bytes,
    *,
    on_frame: FrameHandler,
    on_close: CloseHandler,
    max_frame_bytes: int,
    handshake_timeout_s: float,
    timeout_s: float,
    ssl_context: ssl.SSLContext | None = None,
    shm: ShmPool | None = None,
    dead_after_s: float | None = None,
    bulk_lane_bytes: int = BULK_MIN_BYTES,
) -> Connection:
    """Dial and authenticate, retrying with jittered back-off until ``timeout_s``.

    ``dead_after_s``: TCP keepalive and ``TCP_USER_TIMEOUT`` (see :func:`tune_tcp`).
    ``bulk_lane_bytes``: frames this large take the bulk lane (_lanes.py); 0 = never.
    Raises TransportError (or AuthenticationError) naming the address on failure.
    """
    loop = asyncio.get_running_loop()
    scheme, target = parse_address(address)
    # The handshake deadline protects a listener from idle clients. A dialer
    # trusts the server it chose: a server slow to answer (e.g. a host agent
    # starting dozens of procs on few cores) gets the whole connect budget.
    make = _factory(secret, True, loop, dict(
        max_frame_bytes=max_frame_bytes, handshake_timeout_s=max(handshake_timeout_s, timeout_s), on_frame=on_frame, on_close=on_close,
        shm=shm, tune=functools.partial(tune_tcp, dead_after_s=dead_after_s), lanes=0 if ssl_context else bulk_lane_bytes))
    deadline = loop.time() + timeout_s
    delay = 0.005
    refused_since = 0.0
    last: BaseException | None = None
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TransportError(f"could not connect to {address} within {timeout_s:.1f}s: {last}") from last
        try:
            return await _dial_once(loop, scheme, target, make, ssl_context, handshake_timeout_s, remaining)
        except AuthenticationError:
            raise
        except FileNotFoundError as exc:
            if scheme == "unix" and _job_dir_gone(target):
                raise TransportError(
                    f"nothing at {address}: its directory {os.path.dirname(target)} no longer exists, so the "
                    "process (and the job) that made this address has ended"
                ) from exc
            last = exc
        except ConnectionRefusedError as exc:
            if scheme == "unix":
                # The socket file exists but nobody listens: its process is gone
                # (after a short grace for a listener caught between bind and listen).
                refused_since = refused_since or loop.time()
                if loop.time() - refused_since > 0.5:
                    raise TransportError(f"nothing listens at {address} (its process has exited)") from exc
            last = exc
        except (OSError, asyncio.TimeoutError, TransportError) as exc:
            last = exc
        await asyncio.sleep(min(delay * (1 + random.random()), max(0.0, deadline - loop.time())))
        delay = min(delay * 2, 0.5)


async def _dial_once(loop: asyncio.AbstractEventLoop, scheme: str, target: Any, make: Callable[[], Connection],
                     ssl_context: ssl.SSLContext | None, handshake_timeout_s: float, remaining: float) -> Connection:
    """One connection attempt and its handshake, both within ``remaining`` seconds."""
    if scheme == "unix":
        coro = loop.create_unix_connection(make, target)
    else:
        coro = loop.create_connection(
            make, target[0], target[1], ssl=ssl_context, server_hostname="" if ssl_context else None,
            ssl_handshake_timeout=handshake_timeout_s if ssl_context else None,
        )
    _, conn = await asyncio.wait_for(coro, remaining)
    try:
        await asyncio.wait_for(asyncio.shield(conn.ready), remaining)
    except asyncio.TimeoutError:
        conn._abort(TransportError("connect deadline passed during the handshake"))
        raise
    return conn


def _job_dir_gone(path: str) -> bool:
    """Whether a unix socket's directory is missing (its owner removed it on exit)."""
    if not path or path.startswith("\0"):
        return False  # an abstract socket has no directory
    return not os.path.isdir(os.path.dirname(path) or ".")
