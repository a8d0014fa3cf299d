"""A busy route sends its small calls and replies as one Batch (runtime/_routes.py).

No processes: a Route over a connection that records its frames, a runtime whose
"loop" is a list of callbacks the test runs, and the receiving half fed frames
by hand. What must hold: send order (inside a batch, and between a batch and a
message that cannot join it), the direct path on an idle connection, the batch's
messages failed or kept when the connection goes, and a malformed batch refused.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest

from actormesh.errors import Cause, CauseKind, TransportError
from actormesh.runtime import messages as M
from actormesh.runtime._receive import Receiving
from actormesh.runtime._routes import Route


class Conn:
    """Records the frames sent; ``busy`` stands for a flush already scheduled."""

    def __init__(self, busy: bool = True) -> None:
        self.flush_scheduled = busy
        self.frames: list[tuple[list[Any], Any]] = []
        self.broken = False

    def send(self, segments: list[Any], *, wait_flushed: bool = False, order_key: Any = None) -> None:
        if self.broken:
            raise TransportError("connection to peer is closed")
        self.frames.append((list(segments), order_key))

    def messages(self) -> list[tuple[Any, tuple[Any, ...]]]:
        """Every message sent, in wire order, batches opened: ``(wire tuple, payload)``."""
        out = []
        for segments, _ in self.frames:
            t = pickle.loads(segments[0])
            if t[0] == M.BATCH:
                out += [(item, () if p is None else (p,)) for item, p in t[1]]
            else:
                out.append((t, tuple(segments[1:])))
        return out


class Runtime:
    def __init__(self) -> None:
        self.soon: list[Any] = []
        self.failed: list[tuple[Any, str, Any]] = []
        self.config = SimpleNamespace(message_delivery_timeout=1.0)

    def call_soon_anywhere(self, fn: Any) -> bool:
        self.soon.append(fn)
        return True

    def run_soon(self) -> None:
        soon, self.soon = self.soon, []
        for fn in soon:
            fn()

    def undeliverable(self, env: Any, address: str, reason: Any) -> None:
        self.failed.append((env, address, reason))

    def in_loop(self) -> bool:
        return False

    def peer_dead(self, address: str) -> None:
        return None


def call(i: int, actor: str = "a") -> tuple[Any, ...]:
    return (M.CALL, actor, "incr", ("unix:/me", i), 0, (), (), "unix:/me", i, i - 1)


def reply(port: int) -> tuple[Any, ...]:
    return (M.REPLY, port, 0, M.OK, "unix:/peer")


def route(conn: Conn, rt: Runtime | None = None) -> tuple[Route, Runtime]:
    rt = rt or Runtime()
    r = Route(rt, "unix:/peer")  # type: ignore[arg-type]
    r.conn = conn  # type: ignore[assignment]
    return r, rt


def test_an_idle_connection_sends_each_message_at_once() -> None:
    conn = Conn(busy=False)
    r, rt = route(conn)
    for i in range(3):
        r.send(call(i), [b"p%d" % i], "a")
    assert len(conn.frames) == 3 and rt.soon == [] and r.batched == 0


def test_a_busy_connection_sends_a_burst_as_one_frame_in_order() -> None:
    conn = Conn()
    r, rt = route(conn)
    sent = [(call(i), (b"p%d" % i,)) for i in range(50)] + [(reply(7), (b"r",)), (call(50), ())]
    for env, payload in sent:
        r.send(env, list(payload), env[1])
    assert conn.frames == [] and len(rt.soon) == 1  # one wake-up for the burst
    rt.run_soon()
    assert len(conn.frames) == 1 and conn.messages() == sent
    assert r.batched == len(sent)
    assert conn.frames[0][1] is None  # keys differ (actor "a", port 7): it keeps its place among all


def test_a_long_burst_goes_in_full_batches_in_order() -> None:
    conn = Conn()
    r, rt = route(conn)
    for i in range(600):
        r.send(call(i), [b"x"], "a")
    rt.run_soon()
    assert len(conn.frames) == 3  # 256 + 256 + 88: a frame stays small
    assert [t[-2] for t, _ in conn.messages()] == list(range(600))


def test_a_batch_of_one_key_keeps_the_key() -> None:
    conn = Conn()
    r, rt = route(conn)
    for i in range(3):
        r.send(call(i), [b"x"], "a")
    rt.run_soon()
    [(_, key)] = conn.frames
    assert key == "a"


def test_a_message_that_cannot_join_sends_the_batch_first() -> None:
    conn = Conn()
    r, rt = route(conn)
    r.send(call(0), [b"small"], "a")
    big = bytes(64 << 10)
    r.send(call(1), [big], "a")  # too big to join: the batch goes first, then it
    r.send(call(2), [b"head", memoryview(b"oob")], "a")  # out-of-band segments never join
    r.send(M.Ping(M.PING))  # nor do other kinds
    rt.run_soon()
    got = [t[-2] if t[0] == M.CALL else "ping" for t, _ in conn.messages()]
    assert got == [0, 1, 2, "ping"]


def test_a_closed_connection_keeps_the_batch_ahead_of_later_messages() -> None:
    conn = Conn()
    r, rt = route(conn)
    r.child = True  # its spawner reports how it ended: messages wait for that
    for i in range(3):
        r.send(call(i), [b"x"], "a")
    r.hold()  # the connection closed (loop thread)
    r.send(call(3), [b"x"], "a")
    rt.run_soon()  # the batch's flush finds nothing left to send
    assert conn.frames == []
    status = Cause("exited with non-zero code 3", CauseKind.EXITED)
    assert [M.typed(env).seq for env, _ in r.fail(status)] == [0, 1, 2, 3]


def test_a_failed_route_returns_the_batch_to_fail_its_replies() -> None:
    r, rt = route(Conn())
    r.send(call(0), [b"x"], "a")
    pending = r.fail(Cause("gone", CauseKind.UNREACHABLE))
    assert [type(env).__name__ for env, _ in pending] == ["Call"] and pending[0][1] == (b"x",)
    rt.run_soon()
    assert r.sending is False


def test_a_connection_that_breaks_under_the_flush_fails_each_message() -> None:
    conn = Conn()
    r, rt = route(conn)
    r.send(call(0), [b"x"], "a")
    r.send(call(1), [b"x"], "a")
    conn.broken = True
    rt.run_soon()
    assert [M.typed(env).seq for env, _, _ in rt.failed] == [0, 1]
    assert all(reason.kind is CauseKind.UNREACHABLE for _, _, reason in rt.failed)


class Receiver(Receiving):
    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.aborted = False

    def _dispatch(self, env: Any, payload: Any, conn: Any) -> None:  # type: ignore[override]
        if env.kind == M.BATCH:
            return super()._dispatch(env, payload, conn)
        self.seen.append((type(env).__name__, tuple(payload)))


class PeerConn:
    peer_name = "peer"
    tag = "unix:/peer"

    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_a_batch_is_dispatched_in_order_with_each_message_typed() -> None:
    rx, conn = Receiver(), PeerConn()
    frame = pickle.dumps((M.BATCH, [(call(0), b"a"), (reply(3), None), (call(1), b"b")]), 5)
    rx._on_frame(conn, [frame])  # type: ignore[arg-type]
    assert rx.seen == [("Call", (b"a",)), ("Reply", ()), ("Call", (b"b",))] and not conn.aborted


@pytest.mark.parametrize("items", [
    [(M.Ping(M.PING), None)],  # a kind that never travels in a batch
    [(call(0), bytearray(b"x"))],  # a payload that is not bytes
    [(call(0)[:5], b"x")],  # a short call
    "not a list of items",
])
def test_a_malformed_batch_closes_the_connection_and_dispatches_nothing(items: Any) -> None:
    rx, conn = Receiver(), PeerConn()
    good = [(call(9), b"first")] if isinstance(items, list) else []
    rx._on_frame(conn, [pickle.dumps((M.BATCH, good + items if good else items), 5)])  # type: ignore[arg-type]
    assert conn.aborted and rx.seen == []
