"""The tensor engine end to end on real procs: ops, fetch, reduce, to_mesh, errors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import actormesh.tensor as te  # noqa: E402
from actormesh.actor import this_host  # noqa: E402
from actormesh.errors import RemoteException  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def procs():
    pm = this_host().spawn_procs({"host": 2, "gpu": 2})
    pm.initialized.get(timeout=60)  # its processes exist before the per-test leak check looks
    try:
        yield pm
    finally:
        pm.stop().get(timeout=60)


def test_ops_run_on_every_proc_and_shapes_are_known_at_once(procs):
    with procs.activate():
        t = torch.ones(3, 4)
        u = (t * 2) @ t.T
        assert isinstance(u, te.Tensor) and u.shape == (3, 3) and u.dtype == torch.float32
        v = u.sum(0)
    for h in range(2):
        for g in range(2):
            assert te.inspect(v, host=h, gpu=g).tolist() == [24.0, 24.0, 24.0]


def test_constants_views_and_inplace(procs):
    with procs.activate():
        c = torch.tensor([1.0, 2.0, 3.0, 4.0])
        view = c.view(2, 2)
        view.add_(10)  # writes through to c on every proc
        s = c[1:].clone()
    assert te.inspect(c).tolist() == [11.0, 12.0, 13.0, 14.0]
    assert te.inspect(s, host=1, gpu=1).tolist() == [12.0, 13.0, 14.0]


def test_ops_on_handles_outside_activate_run_on_their_mesh(procs):
    with procs.activate():
        t = torch.full((2,), 3.0)
    assert te.inspect(t.sum()).item() == 6.0  # as Monarch's docs: inspect(batch.sum()) after the block


def test_rank_tensor_and_reductions(procs):
    with procs.activate():
        r = procs.rank_tensor("gpu").float() + 10 * procs.rank_tensor("host").float()
        s = r.reduce("gpu", "sum")
        m = r.reduce(("host", "gpu"), "max")
        st = r.reduce("host", "stack")
        x = torch.arange(4.0).reshape(2, 2) + r
        sc = x.reduce("gpu", "sum", scatter=True)
        a2a = x.reduce("gpu", "stack", scatter=True)
        y = r.clone()
        y.reduce_("gpu", "avg")
    assert te.inspect(s, host=1, gpu=0).item() == 21.0
    assert te.inspect(m, host=0, gpu=0).item() == 11.0
    assert te.inspect(st, host=0, gpu=1).tolist() == [1.0, 11.0]
    assert te.inspect(sc, host=0, gpu=1).tolist() == [5.0, 7.0]
    # all-to-all: row j of mine is what gpu j held in my row
    assert te.inspect(a2a, host=0, gpu=1).tolist() == [[2.0, 3.0], [3.0, 4.0]]
    assert te.inspect(y, host=1, gpu=1).item() == 10.5


def test_reduce_misuse_is_refused_at_the_call(procs):
    with procs.activate():
        t = torch.ones(3)
        with pytest.raises(KeyError, match="nope"):
            t.reduce("nope")
        with pytest.raises(ValueError, match="twice"):
            t.reduce(("gpu", "gpu"))
        with pytest.raises(ValueError, match="multiple"):
            t.reduce(("host", "gpu"), "stack")
        with pytest.raises(ValueError, match="not supported"):
            t.reduce("gpu", "median")
        with pytest.raises(TypeError, match="outermost"):
            t.reduce("gpu", "sum", scatter=True)
        with pytest.raises(ValueError, match="in-place"):
            t.reduce_("gpu", "stack")
        with pytest.raises(ValueError, match="avg"):
            torch.ones(2, dtype=torch.long).reduce("gpu", "avg")


def test_to_mesh_moves_between_slices(procs):
    stages = [procs.slice(host=i) for i in range(2)]
    with stages[0].activate():
        z = torch.ones(3) + stages[0].rank_tensor("gpu")
    moved = z.to_mesh(stages[1])
    with stages[1].activate():
        w = moved * 2
    assert te.inspect(w, gpu=1).tolist() == [4.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="does not have dimensions"):
        z.to_mesh(procs.slice(host=1, gpu=0))


def test_misuse_raises_typeerror_naming_op_and_argument(procs):
    local = torch.ones(2)
    with procs.activate():
        t = torch.ones(2)
        # (a binary operator turns any TypeError into Python's "unsupported operand")
        with pytest.raises(TypeError, match=r"aten\.add\.Tensor[\s\S]*arg 1: LOCAL_TENSOR"):
            torch.add(t, local)
        with pytest.raises(TypeError, match="different meshes|WRONG_MESH"):
            with procs.slice(host=0).activate():
                t * 2
        t.drop()
        with pytest.raises(TypeError, match="DROPPED"):
            t + 1


def test_a_failing_op_poisons_only_its_dependents(procs):
    with procs.activate():
        good = torch.ones(2, 2)
        bad = torch.ones(2, 3)
        idx = torch.tensor([5])
        broken = bad.index_select(1, idx)  # fails on the workers only: index 5 out of range
        after = broken + 1
        fine = good * 3
    with pytest.raises(RemoteException, match="failed asynchronously on rank 0") as info:
        te.inspect(after)
    assert "index" in str(info.value) and "test_tensor_engine.py" in str(info.value)
    assert te.inspect(fine, host=1, gpu=1).tolist() == [[3.0, 3.0], [3.0, 3.0]]
    with procs.activate():
        again = torch.zeros(1) + 1  # the workers live on
    assert te.inspect(again).item() == 1.0


def test_fetch_coordinates_are_checked(procs):
    with procs.activate():
        t = torch.zeros(1)
    with pytest.raises(ValueError, match="missing gpu"):
        te.fetch_shard(t, host=1)
    with pytest.raises(KeyError, match="pp"):
        te.fetch_shard(t, pp=0)
    assert te.fetch_shard({"a": t, "b": 3}).result()["b"] == 3


def test_data_parallel_training_with_autograd_and_sgd(procs):
    dp = procs.flatten("dp")
    with dp.activate():
        torch.manual_seed(0)  # same init on every proc
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for _ in range(5):
            x = torch.rand(16, 4)  # different data per proc after the seed stream diverges? same seed: same data
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.grad.reduce_("dp", "avg")
            opt.step()
            losses.append(loss)
    first, last = te.inspect(losses[0]).item(), te.inspect(losses[-1]).item()
    assert last < first
    w0 = te.inspect(model[0].weight, dp=0)
    w3 = te.inspect(model[0].weight, dp=3)
    assert torch.equal(w0, w3)  # averaged gradients keep replicas identical


def test_item_asks_the_first_proc(procs):
    with procs.activate():
        t = torch.full((), 2.5)
        assert t.item() == 2.5


def test_workers_get_torchrun_variables(procs):
    import os

    with procs.activate():
        t = torch.zeros(1)
    engine = te._client.client_for(procs).engine  # noqa: SLF001 - the env lives in the engine's procs

    from actormesh.actor import Actor, endpoint

    class Env(Actor):
        @endpoint
        def env(self) -> dict:
            return {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}

    got = procs.spawn("env", Env).env.call().get(timeout=30)
    assert got.item(host=1, gpu=0) == {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert engine is not None and te.inspect(t).shape == (1,)


def test_two_meshes_keep_their_own_engines(procs):
    other = this_host().spawn_procs({"gpu": 2})
    try:
        with other.activate():
            a = torch.full((1,), 7.0)
        with procs.activate():
            b = torch.full((1,), 3.0)
        assert te.inspect(a, gpu=1).item() == 7.0 and te.inspect(b).item() == 3.0
        with pytest.raises(ValueError, match="same proc mesh"):
            a.to_mesh(procs.slice(host=0))
    finally:
        other.stop().get(timeout=60)


def test_slice_mesh_moves_only_the_selected_shards(procs):
    with procs.activate():
        r = procs.rank_tensor("host").float() * 10 + procs.rank_tensor("gpu").float()
    second_row = te.slice_mesh(r, host=1).to_mesh(procs.slice(host=0))
    assert te.inspect(second_row, gpu=1).item() == 11.0


def test_a_stopped_mesh_neither_breaks_other_meshes_nor_hides_its_own_end(procs):
    import gc

    from actormesh.errors import SupervisionError

    gone = this_host().spawn_procs({"gpu": 2})
    with gone.activate():
        t = torch.ones(2)
    assert te.inspect(t).tolist() == [1.0, 1.0]
    gone.stop().get(timeout=60)
    with pytest.raises(SupervisionError, match="cannot run"):
        with gone.activate():
            t + 1
    del t
    gc.collect()  # its delete is queued for a mesh that is gone
    with procs.activate():
        u = torch.ones(1) * 5
    assert te.inspect(u).item() == 5.0


def test_temporary_tensors_passed_to_actors_are_read_before_freed(procs):
    from actormesh.actor import Actor, endpoint

    class Counter(Actor):
        def __init__(self) -> None:
            self.n = 0.0

        @endpoint
        def incr(self, t) -> float:
            self.n += float(t)
            return self.n

    counter = procs.spawn("counter", Counter)
    with procs.activate():
        calls = [counter.incr.call(torch.ones(())) for _ in range(30)]  # each handle dies at once
        last = counter.incr.call(torch.ones(())).get(timeout=60)
    for f in calls:
        f.get(timeout=60)  # none failed with "not defined"
    assert set(last.values()) == {31.0}


def test_a_reduce_whose_input_failed_on_one_proc_fails_everywhere_without_hanging(procs):
    with procs.activate():
        idx = procs.rank_tensor("gpu").reshape(1)
        x = torch.ones(1, 3).index_select(0, idx)  # fails on gpu=1 only (index 1 of a size-1 dim)
        s = x.reduce("gpu", "sum")
        later = torch.ones(2).reduce("gpu", "sum")
    assert te.inspect(x, host=0, gpu=0).tolist() == [[1.0, 1.0, 1.0]]
    with pytest.raises(RemoteException, match="input failed on group rank"):
        te.inspect(s, host=0, gpu=0)
    with pytest.raises(RemoteException, match="index"):
        te.inspect(s, host=1, gpu=1)
    assert te.inspect(later, host=1, gpu=0).tolist() == [2.0, 2.0]
