"""Endpoint adverbs with real processes: call, call_one, choose, stream,
broadcast, send(..., port=), Accumulator (MONARCH_API.md §1.1.1).

Ordering tests never rely on timing: a member that must be "slow" waits on an
asyncio.Event that a concurrent ``release`` endpoint sets once the test has
observed what it needs.
"""

from __future__ import annotations

import asyncio

import pytest

from actormesh.actor import (
    Accumulator,
    Actor,
    ActorError,
    Channel,
    ValueMesh,
    concurrent_endpoint,
    context,
    current_rank,
    endpoint,
    send,
)

T = 15


@pytest.fixture(autouse=True)
def _no_unhandled_faults(faults):  # type: ignore[no-untyped-def]
    """Nothing in these tests should reach ``unhandled_fault_hook``."""
    yield
    assert faults.failures == [], f"unexpected unhandled supervision events: {faults.failures}"


class Worker(Actor):
    def __init__(self) -> None:
        self.hits = 0
        self.last: object = None

    @endpoint
    def rank(self) -> int:
        return context().actor_instance.rank.rank

    @endpoint
    def message_rank(self) -> int:
        return current_rank().rank

    @endpoint
    def value(self, scale: int = 1) -> int:
        self.hits += 1
        return (context().actor_instance.rank.rank + 1) * scale

    @endpoint
    def set(self, x: object) -> None:
        self.last = x

    @endpoint
    def get_last(self) -> object:
        return self.last

    @endpoint
    def hit_count(self) -> int:
        return self.hits

    @endpoint
    def fail_on(self, ranks: list[int]) -> int:
        r = context().actor_instance.rank.rank
        if r in ranks:
            raise KeyError(f"rank {r} failed")
        return r


class Gated(Actor):
    """``work`` waits for ``release`` on the members told to wait (async, concurrent)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    @concurrent_endpoint
    async def work(self, wait_ranks: list[int], errors: dict[int, str]) -> int:
        r = context().actor_instance.rank.rank
        if r in wait_ranks:
            await asyncio.wait_for(self.gate.wait(), timeout=10)
        if r in errors:
            kind = errors[r]
            raise {"value": ValueError, "key": KeyError, "runtime": RuntimeError}[kind](f"rank {r}: {kind}")
        return r

    @concurrent_endpoint
    async def release(self) -> None:
        self.gate.set()

    @concurrent_endpoint
    async def ping(self) -> int:
        return context().actor_instance.rank.rank


# --------------------------------------------------------------------------- call


def test_call_returns_value_mesh_in_rank_order(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    w = procs.spawn("w", Worker)
    fut = w.value.call(scale=10)
    vm = fut.get(timeout=T)
    assert isinstance(vm, ValueMesh)
    assert len(vm) == 3
    assert vm.values() == [10, 20, 30]
    assert dict(vm.extent) == {"gpus": 3}
    assert [(p.rank, dict(p), v) for p, v in vm.items()] == [(0, {"gpus": 0}, 10), (1, {"gpus": 1}, 20), (2, {"gpus": 2}, 30)]


def test_call_on_a_slice_has_the_slice_extent(spawn_procs):
    procs = spawn_procs(per_host={"hosts": 2, "gpus": 2})
    w = procs.spawn("w", Worker)
    vm = w.slice(gpus=1).rank.call().get(timeout=T)
    assert dict(vm.extent) == {"hosts": 2}
    assert vm.values() == [1, 3]
    single = w.slice(hosts=1, gpus=0).rank.call().get(timeout=T)
    assert dict(single.extent) == {}
    assert single.values() == [2]
    assert single.item() == 2


def test_call_raises_first_error_in_rank_order(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 4})
    w = procs.spawn("w", Worker)
    with pytest.raises(KeyError, match="rank 1 failed") as info:
        w.fail_on.call([1, 3]).get(timeout=T)
    assert isinstance(info.value, ActorError)
    # all members are still alive
    assert w.fail_on.call([]).get(timeout=T).values() == [0, 1, 2, 3]


def test_call_first_error_in_rank_order_even_when_a_later_rank_fails_first(spawn_procs):
    """rank 2 fails at once (KeyError); ranks 0 and 1 wait; rank 1 then fails (ValueError)."""
    procs = spawn_procs(per_host={"gpus": 3})
    g = procs.spawn("g", Gated)
    fut = g.work.call([0, 1], {1: "value", 2: "key"})
    # rank 2's reply (the KeyError) is sent before its answer to this ping (one
    # sender, one receiver: FIFO), so the KeyError has reached us by now.
    assert g.slice(gpus=2).ping.call_one().get(timeout=T) == 2
    assert not fut.done()
    g.release.broadcast()
    with pytest.raises(ValueError, match="rank 1: value"):
        fut.get(timeout=T)


def test_call_waits_for_all_ranks(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    g = procs.spawn("g", Gated)
    fut = g.work.call([0], {})
    assert g.slice(gpus=1).ping.call_one().get(timeout=T) == 1
    with pytest.raises(TimeoutError):
        fut.get(timeout=0.05)
    g.release.call().get(timeout=T)
    assert fut.get(timeout=T).values() == [0, 1]


# --------------------------------------------------------------------------- call_one


def test_call_one_requires_exactly_one_member(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    w = procs.spawn("w", Worker)
    with pytest.raises(ValueError, match="call_one requires exactly 1 actor, but mesh has 3"):
        w.rank.call_one()
    with pytest.raises(ValueError, match="call_one requires exactly 1 actor, but mesh has 2"):
        w.slice(gpus=slice(1, 3)).rank.call_one()
    assert w.slice(gpus=2).rank.call_one().get(timeout=T) == 2
    kept = w.slice(gpus=slice(1, 2))  # keeps its dim, one member
    assert dict(kept.extent) == {"gpus": 1}
    assert kept.rank.call_one().get(timeout=T) == 1
    assert kept.message_rank.call_one().get(timeout=T) == 0


def test_call_one_on_two_dim_mesh_errors_even_for_one_dim_of_size_one(spawn_procs):
    procs = spawn_procs(per_host={"hosts": 1, "gpus": 2})
    w = procs.spawn("w", Worker)
    with pytest.raises(ValueError, match="but mesh has 2"):
        w.rank.call_one()
    assert w.slice(gpus=1).rank.call_one().get(timeout=T) == 1


# --------------------------------------------------------------------------- broadcast


def test_broadcast_returns_none_and_is_delivered_before_a_following_call(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    w = procs.spawn("w", Worker)
    assert w.set.broadcast("hello") is None
    assert w.get_last.call().get(timeout=T).values() == ["hello"] * 3
    assert w.slice(gpus=slice(0, 2)).set.broadcast("part") is None
    assert w.get_last.call().get(timeout=T).values() == ["part", "part", "hello"]


def test_broadcast_of_many_messages_in_order(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", Worker)
    for i in range(300):
        w.set.broadcast(i)
    assert w.get_last.call().get(timeout=T).values() == [299, 299]


# --------------------------------------------------------------------------- choose


def test_choose_hits_exactly_one_member(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    w = procs.spawn("w", Worker)
    n = 30
    results = [w.value.choose().get(timeout=T) for _ in range(n)]
    assert all(r in (1, 2, 3) for r in results)
    assert len(set(results)) > 1  # random, not always the same member (P(fail) = 3**-29)
    hits = w.hit_count.call().get(timeout=T).values()
    assert sum(hits) == n
    # each reply came from the member that counted the hit
    assert sorted(hits) == sorted(results.count(v) for v in (1, 2, 3))


def test_choose_on_a_slice_stays_in_the_slice(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    w = procs.spawn("w", Worker)
    sub = w.slice(gpus=slice(1, 3))
    ranks = {sub.rank.choose().get(timeout=T) for _ in range(20)}
    assert ranks <= {1, 2} and ranks
    message_ranks = {sub.message_rank.choose().get(timeout=T) for _ in range(20)}
    assert message_ranks <= {0, 1}
    assert w.slice(gpus=0).rank.choose().get(timeout=T) == 0


# --------------------------------------------------------------------------- stream


def test_stream_yields_one_future_per_member_in_arrival_order(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    g = procs.spawn("g", Gated)
    futures = list(g.work.stream([0], {}))  # rank 0 is slow: waits for release
    assert len(futures) == 3
    first_two = {futures[0].get(timeout=T), futures[1].get(timeout=T)}
    assert first_two == {1, 2}
    assert not futures[2].done()
    g.release.broadcast()
    assert futures[2].get(timeout=T) == 0


def test_stream_surfaces_errors_per_future(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    w = procs.spawn("w", Worker)
    outcomes = []
    for f in w.fail_on.stream([1]):
        try:
            outcomes.append(("ok", f.get(timeout=T)))
        except KeyError as exc:
            assert isinstance(exc, ActorError)
            outcomes.append(("err", "rank 1 failed" in str(exc)))
    assert sorted(outcomes) == [("err", True), ("ok", 0), ("ok", 2)]


# --------------------------------------------------------------------------- send / ports


def test_send_with_port_receives_one_value_per_member(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    w = procs.spawn("w", Worker)
    port, receiver = Channel.open()
    assert send(w.value, (), {"scale": 100}, port=port) is None
    got = sorted(receiver.recv().get(timeout=T) for _ in range(3))
    assert got == [100, 200, 300]
    assert w.hit_count.call().get(timeout=T).values() == [1, 1, 1]


def test_send_with_choose_selection_hits_one_member(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    w = procs.spawn("w", Worker)
    port, receiver = Channel.open()
    send(w.value, (), {}, port=port, selection="choose")
    v = receiver.recv().get(timeout=T)
    assert v in (1, 2, 3)
    assert sum(w.hit_count.call().get(timeout=T).values()) == 1


def test_send_without_port_is_like_broadcast(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", Worker)
    send(w.set, ("via-send",), {})
    assert w.get_last.call().get(timeout=T).values() == ["via-send"] * 2


def test_send_checks_arguments_and_selection(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("w", Worker)
    with pytest.raises(TypeError):
        send(w.set, (), {})
    with pytest.raises(ValueError):
        send(w.set, (1,), {}, selection="some")


# --------------------------------------------------------------------------- Accumulator


def test_accumulator_folds_replies(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 4})
    w = procs.spawn("w", Worker)
    total = Accumulator(w.value, 0, lambda acc, v: acc + v).accumulate(scale=2).get(timeout=T)
    assert total == 2 * (1 + 2 + 3 + 4)
    collected = Accumulator(w.rank, (), lambda acc, v: acc + (v,)).accumulate().get(timeout=T)
    assert sorted(collected) == [0, 1, 2, 3]
    on_slice = Accumulator(w.slice(gpus=slice(2, 4)).value, 100, lambda acc, v: acc + v).accumulate().get(timeout=T)
    assert on_slice == 100 + 3 + 4


def test_accumulator_folds_in_arrival_order(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    g = procs.spawn("g", Gated)
    fut = Accumulator(g.work, [], lambda acc, v: acc + [v]).accumulate([0], {})
    assert g.slice(gpus=1).ping.call_one().get(timeout=T) == 1
    assert g.slice(gpus=2).ping.call_one().get(timeout=T) == 2
    g.release.broadcast()
    order = fut.get(timeout=T)
    assert sorted(order[:2]) == [1, 2] and order[2] == 0


def test_accumulator_propagates_errors(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", Worker)
    with pytest.raises(KeyError):
        Accumulator(w.fail_on, 0, lambda a, v: a + v).accumulate([0]).get(timeout=T)


# --------------------------------------------------------------------------- adverbs used by actors


class Driver(Actor):
    """Uses every adverb on a mesh it was sent, from a sync endpoint."""

    @endpoint
    def drive(self, w: object) -> tuple[object, ...]:
        streamed = sorted(f.get(timeout=T) for f in w.rank.stream())
        total = Accumulator(w.value, 0, lambda a, v: a + v).accumulate().get(timeout=T)
        port, receiver = Channel.open()
        send(w.rank, (), {}, port=port)
        sent = sorted(receiver.recv().get(timeout=T) for _ in range(len(w)))
        chosen = w.rank.choose().get(timeout=T)
        w.set.broadcast("from-driver")
        last = w.get_last.call().get(timeout=T).values()
        return streamed, total, sent, chosen, last


class AsyncDriver(Actor):
    """The same from an async endpoint, awaiting the futures."""

    @endpoint
    async def drive(self, w: object) -> tuple[object, ...]:
        streamed = sorted([await f for f in w.rank.stream()])
        total = await Accumulator(w.value, 0, lambda a, v: a + v).accumulate()
        port, receiver = Channel.open()
        send(w.rank, (), {}, port=port)
        sent = sorted([await receiver.recv() for _ in range(len(w))])
        chosen = await w.rank.choose()
        w.set.broadcast("from-async-driver")
        last = (await w.get_last.call()).values()
        return streamed, total, sent, chosen, last


@pytest.mark.parametrize("driver_cls", [Driver, AsyncDriver])
def test_adverbs_from_inside_an_actor(spawn_procs, driver_cls):
    procs = spawn_procs(per_host={"gpus": 3})
    w = procs.spawn("w", Worker)
    driver = procs.slice(gpus=0).spawn("driver", driver_cls)
    streamed, total, sent, chosen, last = driver.drive.call_one(w).get(timeout=T)
    assert streamed == [0, 1, 2]
    assert total == 1 + 2 + 3
    assert sent == [0, 1, 2]
    assert chosen in (0, 1, 2)
    tag = "from-driver" if driver_cls is Driver else "from-async-driver"
    assert last == [tag] * 3


class _Plain(Actor):
    @endpoint
    def ok(self) -> int:
        return 1

    def helper(self, x: int) -> int:
        return x * 2


def test_plain_methods_need_as_endpoint(spawn_procs):
    from actormesh.actor import as_endpoint

    m = spawn_procs(per_host={"gpus": 2}).spawn("plain", _Plain)
    with pytest.raises(RuntimeError, match="not annotated as an endpoint"):
        m.helper.call(3)
    assert as_endpoint(m.helper).call(3).get(timeout=T).values() == [6, 6]
    with pytest.raises(ValueError):
        as_endpoint(m.ok)
