"""Waits that used to never end: port receives, late reordered messages, an actor
waiting on a call to itself. Each must complete or fail with a clear error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actormesh.actor import Actor, Channel, concurrent_endpoint, endpoint
from actormesh.errors import ActorError, PortClosedError
from actormesh.runtime._ordering import Reorder

T = 20  # bound of every .get()


# --------------------------------------------------------------------------- receives claim at observation


def test_recv_futures_claim_in_observation_order():
    port, receiver = Channel[int].open()
    port.send(11)
    port.send(22)
    first, second = receiver.recv(), receiver.recv()
    assert second.get(timeout=T) == 11
    assert first.get(timeout=T) == 22


@pytest.mark.parametrize("once", [False, True])
def test_discarded_recv_claims_nothing(once):
    port, receiver = Channel.open(once=once)
    port.send(31)
    discarded = receiver.recv()
    del discarded
    assert receiver.recv().get(timeout=T) == 31


def test_awaited_recv_claims_its_message():
    async def main() -> Any:
        port, receiver = Channel.open()
        port.send("x")
        return await receiver.recv()

    assert asyncio.run(main()) == "x"


# --------------------------------------------------------------------------- closed ports fail their waiters


def test_recv_after_close_fails():
    _, receiver = Channel.open()
    receiver.close()
    with pytest.raises(PortClosedError, match="close"):
        receiver.recv().get(timeout=T)


def test_recv_pending_when_close_is_called_fails():
    _, receiver = Channel.open()
    pending = receiver.recv()
    assert not pending.done()  # observed: now waiting on the port
    receiver.close()
    with pytest.raises(PortClosedError):
        pending.get(timeout=T)


def test_second_recv_on_a_once_port_fails():
    port, receiver = Channel.open(once=True)
    port.send(1)
    assert receiver.recv().get(timeout=T) == 1
    with pytest.raises(PortClosedError, match="once=True"):
        receiver.recv().get(timeout=T)


def test_waiters_on_a_once_port_beyond_the_first_fail_when_it_arrives():
    port, receiver = Channel.open(once=True)
    a, b = receiver.recv(), receiver.recv()
    assert not a.done() and not b.done()
    port.send("only")
    assert a.get(timeout=T) == "only"
    with pytest.raises(PortClosedError):
        b.get(timeout=T)


def test_sends_after_close_are_dropped_not_queued():
    port, receiver = Channel.open()
    receiver.close()
    port.send(1)  # must not raise: fire and forget
    with pytest.raises(PortClosedError):
        receiver.recv().get(timeout=T)


# --------------------------------------------------------------------------- reorder buffer, virtual time


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[tuple[float, Any]] = []

    def schedule(self, delay: float, fn: Any) -> None:
        self.timers.append((self.now + delay, fn))

    def advance(self, dt: float) -> None:
        self.now += dt
        due = [t for t in self.timers if t[0] <= self.now]
        self.timers = [t for t in self.timers if t[0] > self.now]
        for _, fn in due:
            fn()


def _reorder() -> tuple[Reorder, list[Any], _Clock]:
    out: list[Any] = []
    clock = _Clock()
    return Reorder(lambda env, _: out.append(env), clock.schedule, 1.0, clock=lambda: clock.now), out, clock


def test_message_arriving_after_its_gap_was_skipped_is_delivered():
    r, out, clock = _reorder()
    r.push("s", 0, "m0", None)
    r.push("s", 2, "m2", None)  # m1 is late
    assert out == ["m0"]
    clock.advance(1.5)  # the gap is skipped
    assert out == ["m0", "m2"]
    r.push("s", 1, "m1", None)  # it came after all: delivered, not dropped
    assert out == ["m0", "m2", "m1"]
    r.push("s", 1, "m1-again", None)  # a true duplicate is still dropped
    r.push("s", 0, "m0-again", None)
    assert out == ["m0", "m2", "m1"]


def test_skipped_range_is_tracked_per_number():
    r, out, clock = _reorder()
    r.push("s", 4, "m4", None)  # 0..3 missing
    clock.advance(1.5)
    r.push("s", 2, "m2", None)
    r.push("s", 0, "m0", None)
    r.push("s", 3, "m3", None)
    r.push("s", 1, "m1", None)
    r.push("s", 2, "dup", None)
    assert out == ["m4", "m2", "m0", "m3", "m1"]


# --------------------------------------------------------------------------- an actor waiting on itself


class SelfCaller(Actor):
    def __init__(self) -> None:
        self.me: Any = None

    @endpoint
    def remember(self, me: Any) -> None:
        self.me = me

    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def ping_self_blocking(self) -> str:
        return self.me.ping.call_one().get(timeout=30)

    @endpoint
    def ping_self_in_thread(self) -> str:
        import threading

        box: list[Any] = []
        fut = self.me.ping.call_one()
        t = threading.Thread(target=lambda: box.append(fut.get(timeout=30)))
        t.start()
        return "started"  # the reply can run once this endpoint returns; the thread's wait is fine


class AsyncSelfCaller(Actor):
    def __init__(self) -> None:
        self.me: Any = None

    @endpoint
    async def remember(self, me: Any) -> None:
        self.me = me

    @endpoint
    async def ping(self) -> str:
        return "pong"

    @endpoint
    async def get_self(self) -> str:
        return self.me.ping.call_one().get(timeout=30)

    @endpoint
    async def await_self(self) -> str:
        return await self.me.ping.call_one()

    @concurrent_endpoint
    async def await_self_concurrently(self) -> str:
        return await self.me.ping.call_one()


@pytest.fixture
def self_callers(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    sync = procs.spawn("selfcall", SelfCaller)
    asyn = procs.spawn("aselfcall", AsyncSelfCaller)
    sync.remember.call_one(sync).get(timeout=T)
    asyn.remember.call_one(asyn).get(timeout=T)
    return sync, asyn


def test_sync_actor_blocking_on_a_call_to_itself_raises_at_once(self_callers):
    sync, _ = self_callers
    with pytest.raises(ActorError, match="to itself.*concurrent_endpoint") as ei:
        sync.ping_self_blocking.call_one().get(timeout=T)
    assert isinstance(ei.value.exception, RuntimeError)
    assert sync.ping.call_one().get(timeout=T) == "pong"  # the actor is not wedged


def test_self_call_waited_on_from_another_thread_is_allowed(self_callers):
    sync, _ = self_callers
    assert sync.ping_self_in_thread.call_one().get(timeout=T) == "started"
    assert sync.ping.call_one().get(timeout=T) == "pong"


def test_async_actor_get_on_a_call_to_itself_raises(self_callers):
    _, asyn = self_callers
    with pytest.raises(ActorError, match="event loop.*concurrent_endpoint"):
        asyn.get_self.call_one().get(timeout=T)
    assert asyn.ping.call_one().get(timeout=T) == "pong"


def test_async_actor_awaiting_itself_from_a_plain_endpoint_raises(self_callers):
    _, asyn = self_callers
    with pytest.raises(ActorError, match="not concurrent.*concurrent_endpoint"):
        asyn.await_self.call_one().get(timeout=T)


def test_async_actor_awaiting_itself_from_a_concurrent_endpoint_works(self_callers):
    _, asyn = self_callers
    assert asyn.await_self_concurrently.call_one().get(timeout=T) == "pong"
