"""grad_generator / grad_function (actormesh/tensor/_grad.py), coalescing,
OpaqueRef, NDSlice and Selection: local checks against torch / by hand, and
over real procs where the feature is about the workers."""

from __future__ import annotations

import gc
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.nn.functional import relu

import actormesh.tensor as T
from actormesh.actor import Actor, endpoint
from actormesh.tensor._opaque import opaque_table_size

from conftest import module_procs, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def procs() -> Iterator[Any]:
    yield from module_procs({"gpus": 2})


def _same(got: list[Any], want: tuple[Any, ...]) -> bool:
    """True when every gradient matches (None where torch's is None)."""
    return len(got) == len(want) and all((g is None and w is None) or (g is not None and w is not None and torch.allclose(g, w)) for g, w in zip(got, want))


# -- grad_generator on local tensors: the same values as torch.autograd.grad -------------------
def test_grad_generator_two_roots_of_one_node() -> None:
    t, t2 = torch.rand(2, requires_grad=True), torch.rand(2, requires_grad=True)
    a, b = torch.std_mean(t + t2)
    want = torch.autograd.grad([a, b], [t2, t], retain_graph=True)
    assert _same(list(T.grad_generator([a, b], [t2, t])), want)


def test_grad_generator_pipeline_like_with_unused_and_intermediate() -> None:
    t = torch.rand(3, 3, requires_grad=True)
    w = [torch.rand(3, 2, requires_grad=True) for _ in range(3)]
    v = [torch.rand(2, 3, requires_grad=True) for _ in range(3)]
    u = torch.rand(3, 2, requires_grad=True)
    _ = u * u  # u is not used by the loss: its gradient is None
    a = relu(t @ (w[0] @ v[0]))
    mid = relu(a @ (w[1] @ v[1]))
    a = relu(mid @ (w[2] @ v[2]))
    std, _mean = torch.std_mean(a)
    loss = std + std
    order = [t, w[2], v[2], u, mid, w[1], v[1]]  # any order, intermediates too
    want = torch.autograd.grad([loss], order, allow_unused=True, retain_graph=True)
    got = list(T.grad_generator(loss, order))
    assert got[3] is None
    assert _same(got, want)


def test_grad_generator_diamond_and_broadcast() -> None:
    t = torch.rand(3, 3, requires_grad=True)
    t2, t3, t4, t5 = t + t, t * t, t / t, t - t
    loss = (t2 * t3 + t4 * t5 + t2 * t4 + t3 * t5).sum()
    want = torch.autograd.grad([loss], [t2, t], retain_graph=True)
    assert _same(list(T.grad_generator(loss, [t2, t])), want)
    s = torch.rand(3, requires_grad=True)  # broadcast: the engine's sum_to must apply
    r = (t * (s / s)).sum()
    want = torch.autograd.grad([r], [t, s], retain_graph=True)
    assert _same(list(T.grad_generator(r, [t, s], grad_roots=[torch.tensor(2.0)])), tuple(2 * g for g in want))


def test_grad_generator_runs_backward_one_stage_at_a_time() -> None:
    torch.manual_seed(0)
    l1, l2, l3 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    h1 = relu(l1(torch.rand(8, 4)))
    reached: list[str] = []
    h1.register_hook(lambda g: reached.append("h1"))
    loss = l3(relu(l2(h1))).sum()
    params = [l3.weight, l3.bias, l2.weight, l2.bias, l1.weight, l1.bias]
    want = torch.autograd.grad(loss, params, retain_graph=True)
    reached.clear()  # (the reference backward passed h1 too)
    gen = T.grad_generator(loss, params)
    first = next(gen)
    assert torch.allclose(first, want[0]) and reached == []  # the first layers' backward has not run
    rest = list(gen)
    assert reached and set(reached) == {"h1"}  # (a stage boundary runs it at the boundary too: see _grad.py)
    assert _same([first, *rest], want)
    assert l1.weight.grad is None  # like autograd.grad: nothing accumulates into .grad


def test_grad_generator_errors_like_autograd() -> None:
    x = torch.rand(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="not a scalar"):
        list(T.grad_generator(x * 2, [x]))
    with pytest.raises(RuntimeError, match="does not require grad|not possible to get the gradient edge"):
        list(T.grad_generator(torch.rand(()), [x]))
    with pytest.raises(ValueError, match="2 grad_roots for 1 roots"):
        T.grad_generator((x * 2).sum(), [x], grad_roots=[None, None])


def test_grad_function_backward_continuation() -> None:
    @T.grad_function
    def scaled(x: torch.Tensor, k: float) -> Any:
        return x * k, lambda g: (g * 10, None)

    x = torch.rand(3, requires_grad=True)
    (g,) = T.grad_generator(scaled(x, 2.0).sum(), [x])
    assert torch.equal(g, torch.full((3,), 10.0))
    assert scaled.__name__ == "scaled"


# -- on distributed tensors ---------------------------------------------------------------------
def test_grad_generator_on_the_mesh_matches_local(procs: Any) -> None:
    def model() -> Any:
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)), torch.rand(5, 4)

    with procs.activate():
        net, x = model()
        params = list(reversed(list(net.parameters())))
        grads = []
        for g in T.grad_generator(net(x).sum(), params):
            grads.append(g * 1)  # work issued between backward stages
        assert all(isinstance(g, T.Tensor) for g in grads)
    net2, x2 = model()
    want = torch.autograd.grad(net2(x2).sum(), list(reversed(list(net2.parameters()))))
    for g, w in zip(grads, want):
        assert torch.allclose(T.inspect(g), w) and torch.allclose(T.inspect(g, gpus=1), w)


def test_grad_function_on_the_mesh(procs: Any) -> None:
    @T.grad_function
    def halve_grad(x: torch.Tensor) -> Any:
        return x * 1, lambda g: g / 2

    with procs.activate():
        x = torch.ones(3, requires_grad=True)
        (g,) = T.grad_generator(halve_grad(x * 3).sum(), [x])
    assert torch.equal(T.inspect(g), torch.full((3,), 1.5))


def test_coalescing_sends_the_block_at_its_end(procs: Any) -> None:
    with procs.activate():
        x = torch.zeros(2)
    client = x._view.client
    before = client.seq
    with T.coalescing():
        with T.coalescing():  # nested: joins the outer block
            y = x + 1
        z = y * 3
        assert client.seq == before  # nothing sent yet
    assert client.seq == before + 1  # one flush for the whole block
    assert torch.equal(T.inspect(z), torch.full((2,), 3.0))
    with pytest.raises(KeyError):
        with T.coalescing():
            w = x + 5
            raise KeyError("boom")
    assert torch.equal(T.inspect(w), torch.full((2,), 5.0))  # sent despite the error


# -- OpaqueRef ---------------------------------------------------------------------------------
class Holder(Actor):
    @endpoint
    def put(self, ref: Any, what: str) -> None:
        from actormesh.actor import current_rank

        ref.value = {"what": what, "rank": current_rank().rank}

    @endpoint
    def get(self, ref: Any) -> Any:
        return ref.value

    @endpoint
    def count(self) -> int:
        gc.collect()
        return opaque_table_size()


def test_opaque_ref_lives_on_each_worker_and_dies_with_its_key(procs: Any) -> None:
    holders = procs.spawn("holders", Holder)
    with procs.activate():
        key = torch.tensor(7)  # the key's shard on each proc: what a remote function's OpaqueRef carries
    ref = T.OpaqueRef._create(key)
    holders.put.call(ref, "model").get(timeout=30)
    got = holders.get.call(ref).get(timeout=30)
    assert sorted(v["rank"] for v in got.values()) == [0, 1] and {v["what"] for v in got.values()} == {"model"}
    for what in ("access", "set"):
        with pytest.raises(RuntimeError, match=f"controller is attempting to {what} an OpaqueRef"):
            if what == "access":
                ref.value
            else:
                ref.value = 1
    with pytest.raises(RuntimeError, match="controller is attempting to create"):
        T.OpaqueRef(object())
    rebuilt = pickle.loads(pickle.dumps(T.OpaqueRef._create(torch.tensor(3))))
    assert int(rebuilt._key) == 3
    leaves, spec = torch.utils._pytree.tree_flatten([ref])
    assert leaves == [key] and torch.utils._pytree.tree_unflatten(leaves, spec)[0]._key is key
    assert set(holders.count.call().get(timeout=30).values()) == {1}
    del ref, leaves, spec, key
    gc.collect()
    wait_for(lambda: set(holders.count.call().get(timeout=30).values()) == {0}, timeout=30)


def test_opaque_ref_made_while_propagating_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        r = T.OpaqueRef(None)  # a remote function's `propagate` makes these: allowed
    assert r._key.shape == () and r._key.dtype == torch.int64


# -- NDSlice, Selection -----------------------------------------------------------------------
def test_ndslice() -> None:
    s = T.NDSlice(offset=4, sizes=[2, 3], strides=[10, 2])
    assert list(s) == [4, 6, 8, 14, 16, 18] and len(s) == 6 and s.ndim == 2
    assert s.nditem([1, 2]) == 18 and s.coordinates(16) == [1, 1] and s.index(16) == 4 and s.get(4) == 16
    assert s[1:3] == (6, 8) and s[-1] == 18
    with pytest.raises(ValueError, match="not in"):
        s.index(5)
    with pytest.raises(IndexError):
        s.nditem([2, 0])
    assert pickle.loads(pickle.dumps(s)) == s and hash(s) == hash(T.NDSlice(offset=4, sizes=[2, 3], strides=[10, 2]))
    assert T.NDSlice.new_row_major([2, 3]) == T.NDSlice(offset=0, sizes=[2, 3], strides=[3, 1])
    assert T.NDSlice.from_list([5, 1, 3, 6, 7]) == [T.NDSlice(offset=1, sizes=[3], strides=[2]), T.NDSlice(offset=6, sizes=[2], strides=[1])]
    assert repr(s) == "NDSlice(offset=4, sizes=[2, 3], strides=[10, 2])"
    with pytest.raises(ValueError, match="2 sizes but 1 strides"):
        T.NDSlice(offset=0, sizes=[1, 2], strides=[1])


def test_selection() -> None:
    s = T.NDSlice.new_row_major([2, 3])
    ev = lambda text: T.Selection.from_string(text).eval(s)  # noqa: E731
    assert ev("*") == ev("*, *") == list(range(6))
    assert ev("(*, 0:2)") == [0, 1, 3, 4] and ev("1") == [3, 4, 5] and ev("1, ::2") == [3, 5]
    assert ev("0,1 | 1,2") == [1, 5] and ev("*,* & *,1") == [1, 4] and ev("*, (0 | 2)") == [0, 2, 3, 5]
    assert T.Selection.all().eval(s) == list(range(6))
    one = T.Selection.any().eval(s)
    assert len(one) == 1 and one[0] in range(6)
    assert len(ev("?")) == 3  # `?` picks along the first dim only; the rest is taken whole
    assert repr(T.Selection.from_string("*, 0:4")) == "All(Range(Range(0, Some(4), 1), True))"
    for bad in ("*,", "(1", "x", "1::", "1:2:0"):
        with pytest.raises(ValueError, match="parse error"):
            T.Selection.from_string(bad)
    with pytest.raises(ValueError, match="deeper than"):
        ev("*, *, *")
    assert pickle.loads(pickle.dumps(T.Selection.from_string("0 & (1 | 2)"))) == T.Selection.from_string("0&(1|2)")
