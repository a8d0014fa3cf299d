"""The bulk lane (transport/_lanes.py): large frames on a second TCP connection,
released in send order where order matters, with small frames passing them.

The merge rule is tested pure; the lanes between two real TCP connections on
loopback, in one process."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from actormesh.transport import _lanes, _sockets
from actormesh.transport._lanes import LaneMerger, lane_message, parse_lane_message
from actormesh.errors import ProtocolError

SECRET = b"k" * 32
MiB = 1 << 20


# -- the merge rule, pure ---------------------------------------------------------------
def test_a_lane_frame_waits_for_the_connection_frames_sent_before_it() -> None:
    out: list[str] = []
    m = LaneMerger(out.append)
    m.bulk(2, "L1")
    m.control("c1")
    assert out == ["c1"]
    m.control("c2")
    assert out == ["c1", "c2", "L1"]


def test_a_barrier_holds_the_connection_until_the_lane_caught_up() -> None:
    out: list[str] = []
    m = LaneMerger(out.append)
    m.control("c1")
    m.barrier(2)
    m.control("c2")
    m.control("c3")
    assert out == ["c1"] and m.holding == 2
    m.bulk(1, "L1")
    assert out == ["c1", "L1"]
    m.bulk(1, "L2")  # sent after c1 only: released, and so are c2, c3 behind the barrier
    assert out == ["c1", "L1", "L2", "c2", "c3"] and m.holding == 0


def test_a_barrier_already_met_holds_nothing() -> None:
    out: list[str] = []
    m = LaneMerger(out.append)
    m.bulk(0, "L1")
    m.barrier(1)
    m.control("c1")
    assert out == ["L1", "c1"]


def test_every_interleaving_of_arrival_keeps_the_send_order_where_it_was_asked_for() -> None:
    # Send order: c1, L1(after 1), c2, L2(after 2), barrier(2), c3. The two streams may
    # arrive interleaved in any way.
    control = [("c", "c1"), ("c", "c2"), ("b", 2), ("c", "c3")]
    lane = [("l", (1, "L1")), ("l", (2, "L2"))]
    for slots in itertools.combinations(range(6), 2):
        events, ci, li = [], iter(control), iter(lane)
        for i in range(6):
            events.append(next(li) if i in slots else next(ci))
        out: list[str] = []
        m = LaneMerger(out.append)
        for kind, item in events:
            if kind == "c":
                m.control(item)
            elif kind == "b":
                m.barrier(item)
            else:
                m.bulk(*item)
        pos = {x: out.index(x) for x in out}
        assert sorted(out) == ["L1", "L2", "c1", "c2", "c3"], events
        # Each stream in its order; a lane frame after the connection frames sent before
        # it; c3 (behind barrier(2)) after both lane frames. c2 may pass L1: no barrier.
        assert pos["c1"] < pos["c2"] < pos["c3"] and pos["L1"] < pos["L2"], events
        assert pos["c1"] < pos["L1"] and pos["c2"] < pos["L2"] < pos["c3"], events


def test_what_a_peer_can_make_the_merge_hold_is_bounded() -> None:
    m = LaneMerger(lambda f: None, max_held=3, max_bulk=2)
    m.barrier(1)  # a barrier the lane never meets
    m.control("a")
    m.control("b")
    with pytest.raises(ProtocolError, match="held behind a barrier"):
        m.control("c")
    m = LaneMerger(lambda f: None, max_held=3, max_bulk=2)
    m.bulk(5, "L1")  # lane frames sent after connection frames that never come
    m.bulk(5, "L2")
    with pytest.raises(ProtocolError, match="never came"):
        m.bulk(5, "L3")


def test_lane_messages_round_trip_and_garbage_is_a_protocol_error() -> None:
    token = bytes(range(32))
    assert parse_lane_message([lane_message("offer", 4242, token)]) == ("offer", 4242, token)
    assert parse_lane_message([lane_message("barrier", 7)]) == ("barrier", 7, b"")
    for bad in ([b""], [b"X" * 9], [lane_message("barrier", 1)[:-1]], [b"B" * 9, b"extra"]):
        with pytest.raises(ProtocolError):
            parse_lane_message(bad)


# -- two real connections ---------------------------------------------------------------
async def _pair(on_frame: Any, max_frame: int = 1 << 30) -> tuple[Any, Any, Any]:
    accepted: list[Any] = []
    got = asyncio.Event()

    def on_connection(conn: Any) -> None:
        accepted.append(conn)
        got.set()

    opts: dict[str, Any] = dict(on_close=lambda c, e: None, max_frame_bytes=max_frame, handshake_timeout_s=5.0)
    listener = await _sockets.listen("tcp:127.0.0.1:0", SECRET, on_connection=on_connection, on_frame=on_frame, **opts)
    dialed = await _sockets.connect(listener.address, SECRET, timeout_s=5.0, on_frame=lambda c, f: None, **opts)
    await asyncio.wait_for(got.wait(), 5.0)
    return listener, dialed, accepted[0]


@contextlib.asynccontextmanager
async def _connected(on_frame: Any, on_close: Any = None) -> AsyncIterator[tuple[Any, Any]]:
    """A dialled and an accepted connection on loopback (frames to ``on_frame`` on the accepted one)."""
    listener, dialed, accepted = await _pair(on_frame)
    if on_close is not None:
        accepted.rebind(on_frame=on_frame, on_close=on_close)
    try:
        yield dialed, accepted
    finally:
        dialed.abort()
        accepted.abort()
        listener.close()


async def _until(cond: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)  # polling state another thread sets


async def _lane_up(dialed: Any) -> None:
    """Offer a lane and wait until the next large frame takes it (up, and the
    frame that offered it, chunked on the connection, written)."""
    dialed.send(_msg("warm", 2 * MiB), order_key="w")
    await _until(lambda: dialed._lanes.send_lane is not None and dialed._lanes.send_lane.state == "up" and not dialed._out.chunked,
                 "the lane")


def _msg(tag: str, nbytes: int = 0) -> list[Any]:
    return [tag.encode(), bytes(nbytes)] if nbytes else [tag.encode(), b"x"]


def test_large_frames_take_the_lane_and_keep_their_order_with_small_ones_of_the_same_key() -> None:
    async def main() -> None:
        got: list[tuple[str, int]] = []
        done = asyncio.Event()

        def on_frame(conn: Any, frame: list[Any]) -> None:
            got.append((bytes(frame[0]).decode(), sum(memoryview(s).nbytes for s in frame[1:])))
            if got[-1][0] == "end":
                done.set()

        async with _connected(on_frame) as (dialed, accepted):
            for i in range(3):  # frames before the lane existed count too (a lane frame's c)
                dialed.send(_msg(f"before-{i}"), order_key="a")
            dialed.send(_msg("first-big", 2 * MiB), order_key="a")  # offers the lane, goes on the connection
            await _until(lambda: dialed._lanes.send_lane is not None and dialed._lanes.send_lane.state == "up"
                         and not dialed._out.chunked, "the lane")
            sent = []
            for i in range(12):
                key = "ab"[i % 2] if i % 5 else None
                tag = f"{i}-{key}"
                size = 3 * MiB if i % 3 == 0 else 0
                dialed.send(_msg(tag, size), order_key=key)
                sent.append((tag, size or 1))
            dialed.send(_msg("end"))
            await asyncio.wait_for(done.wait(), 30)
            assert dialed._lanes.send_lane.sent >= 3  # the large ones went by the lane
            assert got[:4] == [("before-0", 1), ("before-1", 1), ("before-2", 1), ("first-big", 2 * MiB)]
            received = got[4:-1]
            assert sorted(received) == sorted(sent)
            # Per key (and unkeyed against everything): send order.
            for key in ("a", "b"):
                mine = [t for t, _ in received if t.endswith(f"-{key}") or t.endswith("-None")]
                assert mine == [t for t, _ in sent if t.endswith(f"-{key}") or t.endswith("-None")]

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_small_frame_of_another_key_passes_a_large_one_on_the_lane() -> None:
    async def main() -> None:
        got: list[str] = []
        small = asyncio.Event()
        big = asyncio.Event()
        gate = threading.Event()

        def on_frame(conn: Any, frame: list[Any]) -> None:
            tag = bytes(frame[0]).decode()
            got.append(tag)
            (big if tag == "big" else small).set()

        listener, dialed, accepted = await _pair(on_frame)
        real_read = _lanes._read_frames

        def slow_read(sock: Any, decoder: Any, on_frame: Any) -> None:
            gate.wait(30)  # the receiving lane reads nothing until the small frame is in
            real_read(sock, decoder, on_frame)

        try:
            _lanes._read_frames = slow_read  # type: ignore[assignment]
            await _lane_up(dialed)
            await asyncio.wait_for(small.wait(), 10)  # "warm" went on the connection
            small.clear()
            dialed.send(_msg("big", 64 * MiB), order_key="a")
            dialed.send(_msg("small"), order_key="b")
            await asyncio.wait_for(small.wait(), 10)
            assert got[-1] == "small" and "big" not in got
            gate.set()
            await asyncio.wait_for(big.wait(), 30)
            assert dialed._lanes.send_lane.sent == 1  # "big" went by the lane
        finally:
            gate.set()
            _lanes._read_frames = real_read  # type: ignore[assignment]
            dialed.abort()
            accepted.abort()
            listener.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_lane_nobody_dials_leaves_large_frames_on_the_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    from actormesh.transport import _lane_conn

    monkeypatch.setattr(_lanes, "OFFER_TIMEOUT_S", 0.3)
    monkeypatch.setattr(_lane_conn, "dial_lane", lambda *a, **k: (lambda: None))  # a firewall, in effect

    async def main() -> None:
        got: list[str] = []
        async with _connected(lambda c, f: got.append(bytes(f[0]).decode())) as (dialed, accepted):
            dialed.send(_msg("big-0", 2 * MiB), order_key="a")
            await _until(lambda: dialed._lanes.send_lane is not None and dialed._lanes.send_lane.state == "failed",
                         "the offer to expire")
            for i in range(1, 4):
                dialed.send(_msg(f"big-{i}", 2 * MiB), order_key="a")
            dialed.send(_msg("end"), order_key="a")
            await _until(lambda: got and got[-1] == "end", "every frame")
            assert got == ["big-0", "big-1", "big-2", "big-3", "end"]

    asyncio.run(asyncio.wait_for(main(), 60))


def test_what_a_peer_wrote_on_its_lane_before_it_closed_still_arrives() -> None:
    async def main() -> None:
        got: list[tuple[str, int]] = []
        closed = asyncio.Event()

        def on_frame(conn: Any, frame: list[Any]) -> None:
            got.append((bytes(frame[0]).decode(), sum(memoryview(s).nbytes for s in frame[1:])))

        accepted_box: list[Any] = []
        listener, dialed, accepted = await _pair(on_frame)
        accepted.rebind(on_frame=on_frame, on_close=lambda c, e: closed.set())
        accepted_box.append(accepted)
        try:
            await _lane_up(dialed)
            dialed.send(_msg("last-big", 32 * MiB), order_key="a")
            dialed.send(_msg("bye"), order_key="a")
            dialed.close()  # after its queued frames, lane included
            await asyncio.wait_for(closed.wait(), 30)
            assert got[-2:] == [("last-big", 32 * MiB), ("bye", 1)]
        finally:
            listener.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_peer_gone_in_the_middle_of_a_lane_frame_fails_the_connection_not_a_hang() -> None:
    async def main() -> None:
        got: list[str] = []
        closed = asyncio.Event()
        listener, dialed, accepted = await _pair(lambda c, f: got.append(bytes(f[0]).decode()))
        accepted.rebind(on_frame=lambda c, f: got.append(bytes(f[0]).decode()), on_close=lambda c, e: closed.set())
        try:
            await _lane_up(dialed)
            lane = dialed._lanes.send_lane
            real = _lanes._send_all

            def half_then_die(sock: Any, parts: list[Any]) -> None:
                if sum(memoryview(p).nbytes for p in parts) > MiB:
                    sock.sendall(b"".join(bytes(memoryview(p)) for p in parts)[: 4 * MiB])
                    sock.shutdown(2)  # the process died here, as far as the peer can tell
                    raise OSError("killed")
                real(sock, parts)

            _lanes._send_all = half_then_die  # type: ignore[assignment]
            try:
                flushed = dialed.send(_msg("doomed", 16 * MiB), order_key="a", wait_flushed=True)
                await asyncio.wait_for(closed.wait(), 20)
                assert await asyncio.to_thread(flushed.wait, 10)  # the sender is not left waiting on a dead lane
            finally:
                _lanes._send_all = real  # type: ignore[assignment]
            assert "doomed" not in got
            assert lane.state in ("up", "closed")
        finally:
            dialed.abort()
            listener.close()

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("body", [b"", b"Q" * 9, b"B" * 3, lane_message("offer", 1, bytes(32)) + b"x"])
def test_a_malformed_lane_frame_closes_that_connection_only(body: bytes) -> None:
    from actormesh.transport._frames import FLAG_LANE

    async def main() -> None:
        closed = asyncio.Event()
        listener, dialed, accepted = await _pair(lambda c, f: None)
        accepted.rebind(on_frame=lambda c, f: None, on_close=lambda c, e: closed.set())
        other_listener, other, other_accepted = await _pair(lambda c, f: None)
        try:
            dialed._outbox.append(([body], FLAG_LANE, None, None))  # what a hostile peer would write
            dialed._flush()
            await asyncio.wait_for(closed.wait(), 10)
            assert not other.closed and not other_accepted.closed
        finally:
            for c in (dialed, other, other_accepted):
                c.abort()
            listener.close()
            other_listener.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_stranger_at_the_offered_port_neither_gets_the_lane_nor_stops_the_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from actormesh.transport import _lane_conn

    real_dial = _lane_conn.dial_lane
    strangers: list[bytes] = []

    def stranger_first(host: str, port: int, *args: Any) -> Any:
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(bytes(32))  # a wrong token
            strangers.append(s.recv(1))  # the lane closes on it: b""
        return real_dial(host, port, *args)

    monkeypatch.setattr(_lane_conn, "dial_lane", stranger_first)

    async def main() -> None:
        got: list[str] = []
        async with _connected(lambda c, f: got.append(bytes(f[0]).decode())) as (dialed, accepted):
            await _lane_up(dialed)
            dialed.send(_msg("by-lane", 2 * MiB), order_key="a")
            await _until(lambda: "by-lane" in got, "the frame")
            assert strangers == [b""] and dialed._lanes.send_lane.sent == 1

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 400 Bad Request\r\n\r\n"])
def test_an_offer_that_reaches_some_other_listener_costs_the_lane_not_the_connection(
        monkeypatch: pytest.MonkeyPatch, answer: bytes) -> None:
    import socket

    from actormesh.transport import _lane_conn

    monkeypatch.setattr(_lanes, "OFFER_TIMEOUT_S", 0.5)
    other = socket.create_server(("127.0.0.1", 0))
    real_dial = _lane_conn.dial_lane

    def serve_other() -> None:
        conn, _ = other.accept()
        conn.recv(64)
        conn.sendall(answer)
        conn.close()

    threading.Thread(target=serve_other, daemon=True).start()
    # As through a port forward: the peer's address is not where the offer listens.
    monkeypatch.setattr(_lane_conn, "dial_lane", lambda host, port, *a: real_dial(host, other.getsockname()[1], *a))

    async def main() -> None:
        got: list[str] = []
        listener, dialed, accepted = await _pair(lambda c, f: got.append(bytes(f[0]).decode()))
        try:
            dialed.send(_msg("big-0", 2 * MiB), order_key="a")
            await _until(lambda: dialed._lanes.send_lane is not None and dialed._lanes.send_lane.state == "failed",
                         "the offer to expire")
            dialed.send(_msg("big-1", 2 * MiB), order_key="a")
            await _until(lambda: got == ["big-0", "big-1"], "both frames")
            assert not dialed.closed and not accepted.closed
        finally:
            dialed.abort()
            accepted.abort()
            listener.close()
            other.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_peer_that_makes_this_side_hold_too_much_loses_its_connection_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import functools

    from actormesh.transport import _lane_conn
    from actormesh.transport._frames import FLAG_LANE

    monkeypatch.setattr(_lane_conn, "LaneMerger", functools.partial(LaneMerger, max_held=4))

    async def main() -> None:
        closed = asyncio.Event()
        async with _connected(lambda c, f: None, on_close=lambda c, e: closed.set()) as (dialed, accepted):
            async with _connected(lambda c, f: None) as (other, other_accepted):
                dialed._outbox.append(([lane_message("barrier", 10**9)], FLAG_LANE, None, None))  # never met
                dialed._flush()
                for i in range(6):
                    dialed.send(_msg(f"held-{i}"))
                await asyncio.wait_for(closed.wait(), 10)
                assert not other.closed and not other_accepted.closed

    asyncio.run(asyncio.wait_for(main(), 30))


def _send_from_a_thread(conn: Any, frame: list[Any], key: str) -> float:
    """``conn.send`` from a thread other than the loop's, as a caller does; its seconds."""
    took: list[float] = []

    def run() -> None:
        import time

        t0 = time.monotonic()
        conn.send(frame, order_key=key)
        took.append(time.monotonic() - t0)

    t = threading.Thread(target=run)
    t.start()
    return took  # type: ignore[return-value]  # filled when the thread ends


def test_the_first_large_frame_from_a_caller_waits_for_its_lane_and_takes_it() -> None:
    async def main() -> None:
        got: list[tuple[str, int]] = []
        async with _connected(lambda c, f: got.append((bytes(f[0]).decode(), memoryview(f[1]).nbytes))) as (dialed, accepted):
            took = _send_from_a_thread(dialed, _msg("first-big", 8 * MiB), "a")
            await _until(lambda: took, "the send to return")
            lane = dialed._lanes.send_lane
            assert lane is not None and lane.state == "up" and lane.sent == 1  # it went by the lane
            assert took[0] < _lanes.LANE_WAIT_S
            await _until(lambda: got == [("first-big", 8 * MiB)], "the frame")

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_lane_that_does_not_come_up_delays_the_first_large_frame_by_at_most_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    from actormesh.transport import _lane_conn

    monkeypatch.setattr(_lanes, "LANE_WAIT_S", 0.2)
    monkeypatch.setattr(_lane_conn, "dial_lane", lambda *a, **k: (lambda: None))  # a firewall, in effect

    async def main() -> None:
        got: list[str] = []
        async with _connected(lambda c, f: got.append(bytes(f[0]).decode())) as (dialed, accepted):
            took = _send_from_a_thread(dialed, _msg("big", 2 * MiB), "a")
            await _until(lambda: took, "the send to return")
            assert 0.15 < took[0] < 0.45, took  # the wait (0.2 s here), not the offer's 5 s
            await _until(lambda: got == ["big"], "the frame, on the connection")
            assert dialed._lanes.send_lane.sent == 0

    asyncio.run(asyncio.wait_for(main(), 60))
