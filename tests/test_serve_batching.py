"""``@batched`` endpoints (gathering, splitting, errors per request) and the routers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from actormesh.actor import Actor, endpoint
from actormesh.serve import LeastLoaded, RoundRobin, Service, batched
from actormesh.serve._router import make_router

GET_S = 30


class Doubler(Actor):
    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    @batched(max_batch_size=4, max_wait_ms=10_000)
    async def full(self, xs: list[int]) -> list[int]:
        self.batches.append(list(xs))
        return [2 * x for x in xs]

    @batched(max_batch_size=100, max_wait_ms=20)
    async def timed(self, xs: list[int]) -> list[int]:
        self.batches.append(list(xs))
        return [x + 1 for x in xs]

    @batched(max_batch_size=8, max_wait_ms=20)
    async def picky(self, xs: list[int]) -> list[object]:
        return [ValueError(f"negative: {x}") if x < 0 else x for x in xs]

    @batched(max_batch_size=8, max_wait_ms=20)
    async def broken(self, xs: list[int]) -> list[int]:
        raise RuntimeError(f"batch of {len(xs)} failed")

    @batched(max_batch_size=8, max_wait_ms=20)
    async def short(self, xs: list[int]) -> list[int]:
        return xs[:-1]

    @endpoint
    async def seen(self) -> list[list[int]]:
        return self.batches


@pytest.fixture(scope="module")
def doubler():
    from conftest import module_procs

    for procs in module_procs({"gpus": 1}):
        mesh = procs.spawn("doubler", Doubler)
        yield mesh


def test_full_batches_are_gathered_and_split_back(doubler):
    futures = [doubler.full.call_one(i) for i in range(8)]
    assert [f.get(timeout=GET_S) for f in futures] == [2 * i for i in range(8)]
    batches = doubler.seen.call_one().get(timeout=GET_S)
    assert [len(b) for b in batches[-2:]] == [4, 4]
    assert sorted(x for b in batches[-2:] for x in b) == list(range(8))


def test_a_partial_batch_runs_after_max_wait(doubler):
    futures = [doubler.timed.call_one(i) for i in range(3)]
    assert [f.get(timeout=GET_S) for f in futures] == [1, 2, 3]


def test_errors_are_per_request_or_per_batch(doubler):
    futures = [doubler.picky.call_one(x) for x in (1, -2, 3)]
    assert futures[0].get(timeout=GET_S) == 1 and futures[2].get(timeout=GET_S) == 3
    with pytest.raises(ValueError, match="negative: -2"):
        futures[1].get(timeout=GET_S)
    failing = [doubler.broken.call_one(x) for x in range(3)]
    for f in failing:
        with pytest.raises(RuntimeError, match="failed"):
            f.get(timeout=GET_S)
    with pytest.raises(TypeError, match="must return a list of 1 results"):
        doubler.short.call_one(1).get(timeout=GET_S)
    assert doubler.timed.call_one(5).get(timeout=GET_S) == 6  # the actor lives on


def test_batched_through_a_service():
    svc = Service(1, 1, Doubler, max_concurrency=16)
    try:
        svc.ready().get(timeout=60)
        futures = [svc.full.route(i) for i in range(8)]
        assert [f.get(timeout=GET_S) for f in futures] == [2 * i for i in range(8)]
        with pytest.raises(TypeError, match="bad arguments"):
            svc.full.route(1, 2)
    finally:
        svc.stop().get(timeout=60)


def test_batched_is_checked_at_decoration():
    with pytest.raises(TypeError, match="async def"):
        batched()(lambda self, xs: xs)
    with pytest.raises(TypeError, match="exactly one argument"):

        async def two(self, xs, ys):
            return xs

        batched()(two)
    with pytest.raises(ValueError, match="max_batch_size"):
        batched(max_batch_size=0)
    with pytest.raises(ValueError, match="max_wait_ms"):
        batched(max_wait_ms=-1)
    with pytest.raises(TypeError, match="instead of @endpoint"):

        async def one(self, xs):
            return xs

        batched()(endpoint(one))


@dataclass
class _R:
    slot: int
    in_flight: int = 0
    queued: int = 0

    @property
    def load(self) -> int:
        return self.in_flight + self.queued


def test_round_robin_cycles_and_skips_missing_replicas():
    rr = RoundRobin()
    reps = [_R(0), _R(1), _R(2)]
    assert [rr.pick(reps, "e").slot for _ in range(4)] == [0, 1, 2, 0]
    assert rr.pick([reps[0], reps[2]], "e").slot == 2  # replica 1 is full: skipped
    assert rr.pick([reps[0], reps[2]], "e").slot == 0


def test_least_loaded_picks_the_lowest_load_and_spreads_ties():
    ll = LeastLoaded()
    reps = [_R(0, 3, 1), _R(1, 1, 0), _R(2, 0, 2)]
    assert ll.pick(reps, "e").slot == 1
    idle = [_R(0), _R(1)]
    assert {ll.pick(idle, "e").slot for _ in range(4)} == {0, 1}


def test_make_router_names_the_choices():
    assert isinstance(make_router("round_robin"), RoundRobin)
    with pytest.raises(ValueError, match="least_loaded"):
        make_router("random")


def test_batcher_cancelled_callers_are_skipped():
    from actormesh.serve._batching import _Batcher

    calls: list[list[int]] = []

    async def fn(obj, xs):
        calls.append(list(xs))
        return xs

    async def main() -> None:
        b = _Batcher(fn, None, 4, 0.05)
        t1 = asyncio.ensure_future(b.submit(1))
        t2 = asyncio.ensure_future(b.submit(2))
        await asyncio.sleep(0)
        t1.cancel()
        assert await t2 == 2

    asyncio.run(main())
    assert calls == [[2]]
