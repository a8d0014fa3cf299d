"""Socket options of the data plane: both ends of every TCP connection, dialed or
accepted, are tuned as soon as they have a socket, and the receive buffer is
sized from the round trip (see transport/_sockets.py)."""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import Any

import pytest

from actormesh.transport import _sockets
from actormesh.transport._sockets import (AUTOTUNE_RCVBUF_BYTES, LINK_BYTES_PER_S, MIN_RCVBUF_BYTES, NOTSENT_LOWAT_BYTES,
                                          receive_window_bytes)

SECRET = b"k" * 32
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="TCP_NOTSENT_LOWAT and SO_RCVBUF doubling are Linux's")


def test_the_receive_window_is_one_round_trip_at_link_rate_with_a_floor_and_a_ceiling() -> None:
    assert receive_window_bytes(None) is None  # no estimate: the kernel's autotuning stays
    assert receive_window_bytes(0.0) is None
    assert receive_window_bytes(1e-6) == MIN_RCVBUF_BYTES  # loopback, veth under no load: the floor
    rtt = 3 * MIN_RCVBUF_BYTES / LINK_BYTES_PER_S
    assert receive_window_bytes(rtt) == int(rtt * LINK_BYTES_PER_S)
    assert receive_window_bytes(1.01 * AUTOTUNE_RCVBUF_BYTES / LINK_BYTES_PER_S) is None  # a long link: autotuning
    assert receive_window_bytes(0.5e-3) is None


async def _pair(monkeypatch: pytest.MonkeyPatch, rtt_s: float | None) -> tuple[Any, Any, list[Any]]:
    monkeypatch.setattr(_sockets, "_rtt_s", lambda sock: rtt_s)
    accepted: list[Any] = []
    got = asyncio.Event()

    def on_connection(conn: Any) -> None:
        accepted.append(conn)
        got.set()

    opts: dict[str, Any] = dict(on_frame=lambda c, f: None, on_close=lambda c, e: None, max_frame_bytes=1 << 20,
                                handshake_timeout_s=5.0)
    listener = await _sockets.listen("tcp:127.0.0.1:0", SECRET, on_connection=on_connection, **opts)
    dialed = await _sockets.connect(listener.address, SECRET, timeout_s=5.0, **opts)
    await asyncio.wait_for(got.wait(), 5.0)
    return listener, dialed, accepted


def _sockopts(conn: Any) -> tuple[int, int]:
    sock = conn._transport.get_extra_info("socket")
    return (sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_NOTSENT_LOWAT", 25)),
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))


@linux_only
def test_dialed_and_accepted_tcp_connections_both_bound_unsent_bytes_and_the_receive_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        listener, dialed, accepted = await _pair(monkeypatch, 5e-6)
        try:
            # A quarter of the window may wait unsent; Linux reports twice the buffer set (its bookkeeping).
            assert _sockopts(dialed) == (MIN_RCVBUF_BYTES // 4, 2 * MIN_RCVBUF_BYTES)
            assert _sockopts(accepted[0]) == (MIN_RCVBUF_BYTES // 4, 2 * MIN_RCVBUF_BYTES)
        finally:
            dialed.abort()
            accepted[0].abort()
            listener.close()

    asyncio.run(asyncio.wait_for(main(), 20))


@linux_only
def test_a_long_round_trip_leaves_the_receive_buffer_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:
        default = probe.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)

    async def main() -> None:
        listener, dialed, accepted = await _pair(monkeypatch, 2e-3)
        try:
            assert _sockopts(accepted[0])[0] == NOTSENT_LOWAT_BYTES
            assert _sockopts(accepted[0])[1] >= default  # not locked small: autotuning may grow it
        finally:
            dialed.abort()
            accepted[0].abort()
            listener.close()

    asyncio.run(asyncio.wait_for(main(), 20))


@linux_only
def test_the_round_trip_is_read_from_a_connected_socket() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv, socket.create_connection(srv.getsockname(), timeout=5) as c:
        rtt = _sockets._rtt_s(c)
        assert rtt is not None and 0 < rtt < 1.0
    with socket.socket() as unconnected:
        assert _sockets._rtt_s(unconnected) is None  # no handshake, no estimate: the kernel's buffer stays
