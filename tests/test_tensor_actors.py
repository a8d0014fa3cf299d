"""Actors and distributed tensors together, over real procs: a tensor passed to an
endpoint arrives as the proc's own shard, actor messages and tensor ops keep the
controller's order (Monarch's ``test_actor_tensor_ordering``), and
``Endpoint.rref`` / ``as_endpoint(..., propagate=)`` turn an endpoint's per-proc
return into a distributed tensor (Monarch's ``test_rref_actor``).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import actormesh.tensor as T
from actormesh.actor import Actor, as_endpoint, endpoint
from actormesh.errors import RemoteException
from actormesh.tensor._client import client_for
from conftest import module_procs

W = 60

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def procs() -> Any:
    for pm in module_procs({"gpus": 2}):
        yield pm
        # Free this module's shards while the engine still runs: a handle collected after
        # the stop would make the next actor call's flush fail (a core issue, reported).
        gc.collect()
        pm_client = client_for(pm)
        pm_client.flush()


def eq(value: torch.Tensor, expected: Any) -> bool:
    """A fetched shard equals ``expected`` (compared locally even inside activate())."""
    from actormesh.tensor._client import local_torch

    with local_torch():
        return torch.equal(value, torch.tensor(expected, dtype=value.dtype))


class Counter(Actor):
    def __init__(self) -> None:
        self.c = 0

    @endpoint
    def incr(self, x: Any) -> int:
        self.c += 1
        return self.c - 1


class Holder(Actor):
    """Keeps state as a tensor; reads and writes the shards it is given."""

    def __init__(self, state: Any = None) -> None:
        self.state = state

    @endpoint
    def read(self, t: Any) -> tuple[str, list[float]]:
        return type(t).__name__, t.flatten().tolist()

    @endpoint
    def bump(self, t: Any) -> None:
        t.add_(100)  # the engine's own shard: later tensor ops see it

    @endpoint
    def plus_state(self, x: Any) -> Any:
        return x + self.state


class Linear(Actor):
    def __init__(self, n: int, m: int) -> None:
        self.weight = torch.zeros((n, m))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # not an endpoint: via as_endpoint
        return x @ self.weight

    @endpoint(propagate="inspect")
    def update(self, w: torch.Tensor) -> None:
        self.weight += w

    @endpoint(propagate=lambda x: x.sum(0))
    def colsum(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0) + self.weight.sum()

    @endpoint(propagate=lambda x: torch.empty(2))
    def wrong(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(7)

    @endpoint(propagate=lambda x: x)
    def fails(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("actor failed on purpose")

    @endpoint
    def no_propagate(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_actor_tensor_ordering(procs):
    """Monarch's test: calls carrying tensors and plain calls are served in issue order."""
    with procs.activate():
        counter = procs.spawn("counter", Counter)
        results, keep = [], []
        for _ in range(0, 10, 2):
            # kept alive: a temporary dropped right after the call can be deleted on the
            # worker before the actor unpickles it (a core shard-ref bug, reported)
            keep.append(torch.ones(()))
            results.append(counter.incr.call(keep[-1]))
            results.append(counter.incr.call(1))
        assert [r.get(timeout=W).item(gpus=0) for r in results] == list(range(10))


def test_a_shard_sees_every_op_before_and_an_actor_write_is_seen_after(procs):
    with procs.activate():
        h = procs.spawn("holder", Holder)
        t = torch.zeros(3) + procs.rank_tensor("gpus")
        for _ in range(3):
            t.add_(1)
        seen = h.read.call(t)
        h.bump.call(t).get(timeout=W)
        after = t * 2
        got = seen.get(timeout=W)
        assert got.item(gpus=0) == ("Tensor", [3.0, 3.0, 3.0])
        assert got.item(gpus=1) == ("Tensor", [4.0, 4.0, 4.0])
        assert eq(T.inspect(after, gpus=1), [208, 208, 208])


def test_spawn_with_a_distributed_tensor_gives_each_actor_its_shard(procs):
    """Monarch's test_actor_with_tensors."""
    with procs.activate():
        state = torch.ones(()) + procs.rank_tensor("gpus")  # kept alive: see test_actor_tensor_ordering
        adder = procs.spawn("adder", Holder, state)
        one = torch.ones(())
        pending = adder.plus_state.call(one)
    out = pending.get(timeout=W)  # outside: replies holding tensors decode with torch ops (reported)
    assert out.item(gpus=0).item() == 2 and out.item(gpus=1).item() == 3


def test_rref_actor(procs):
    """Monarch's test_rref_actor (with the propagated shape the product really has)."""
    with procs.activate():
        lin = procs.spawn("linear", Linear, 3, 4)
        y = torch.ones((4, 3))
        fwd = as_endpoint(lin.forward, propagate=lambda x: torch.empty(4, 4))
        t = fwd.rref(y)
        assert isinstance(t, T.Tensor) and t.shape == (4, 4)
        first = T.inspect(t.sum())
        assert lin.update.rref(torch.ones((3, 4))) is None
        t = fwd.rref(y)
        second, other = T.inspect(t.sum()), T.inspect(t.sum(), gpus=1)
    assert first.item() == 0
    assert second.item() == other.item() == 3 * 4 * 4


def test_endpoint_propagate_decorator_and_ordering_with_tensor_ops(procs):
    with procs.activate():
        lin = procs.spawn("linear2", Linear, 2, 2)
        x = torch.ones(3, 2)
        x.mul_(5)  # issued before the rref: the actor sees it
        s = lin.colsum.rref(x)
        assert s.shape == (2,)
        lin.update.rref(torch.ones(2, 2))
        s2 = lin.colsum.rref(x)
        x.add_(1)  # issued after: not seen by s
        assert eq(T.inspect(s), [15, 15])
        assert eq(T.inspect(s2 + 0, gpus=1), [19, 19])


def test_rref_failures_poison_and_the_engine_and_actor_live_on(procs):
    with procs.activate():
        lin = procs.spawn("linear3", Linear, 2, 2)
        x = torch.ones(2)
        bad = lin.fails.rref(x)
        with pytest.raises(RemoteException, match="actor failed on purpose"):
            T.inspect(bad + 1)
        wrong = lin.wrong.rref(x)
        assert wrong.shape == (2,)
        with pytest.raises(RemoteException, match=r"returned a tensor \[7\].*propagation said \[2\]"):
            T.inspect(wrong)
        assert eq(T.inspect(lin.colsum.rref(torch.ones(3, 2))), [3, 3])  # still serving


def test_rref_of_a_poisoned_input_is_poisoned(procs):
    @T.remote(propagate=lambda a: a)
    def explode(a: torch.Tensor) -> torch.Tensor:
        raise ValueError("input broke")

    with procs.activate():
        lin = procs.spawn("linear4", Linear, 2, 2)
        bad = explode(torch.ones(3, 2))
        out = lin.colsum.rref(bad)
        with pytest.raises(RemoteException, match="input broke"):
            T.inspect(out)


def test_rref_misuse_is_reported_at_the_call_site(procs):
    lin = procs.spawn("linear5", Linear, 2, 2)
    with procs.activate():
        with pytest.raises(NotImplementedError, match=r"@endpoint\(propagate=fn\)"):
            lin.no_propagate.rref(torch.ones(2))
        with pytest.raises(NotImplementedError, match="mocked"):
            as_endpoint(lin.forward, propagate="mocked").rref(torch.ones(2))
        with pytest.raises(TypeError, match="bad arguments"):
            lin.colsum.rref()
        with pytest.raises(RuntimeError, match="not annotated as an endpoint.*as_endpoint"):
            lin.forward.rref(torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"with mesh.activate\(\):"):
        lin.update.rref(3)
    with procs.slice(gpus=0).activate():
        with pytest.raises(ValueError, match="spawn the actors on the active proc mesh"):
            lin.colsum.rref(torch.ones(2, 2))
