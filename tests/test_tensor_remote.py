"""Free remote functions of the tensor engine (actormesh/tensor/_remote.py,
_remote_worker.py) over real procs: propagation modes, adverbs, ordering with
tensor ops, poisoning and recovery, misuse errors, a proc that dies mid-call.

The functions live at module level so the workers import them by name (they
get the controller's sys.path); lambdas and closures travel by cloudpickle.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

import actormesh.tensor as T
from actormesh.actor import Channel, SupervisionError, send
from actormesh.errors import RemoteException
from actormesh.tensor._client import client_for
from actormesh.tensor import remote
from conftest import module_procs

W = 60  # deadline (s) of every wait on a worker

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def procs() -> Any:
    for pm in module_procs({"hosts": 2, "gpus": 2}):
        yield pm
        # Free this module's shards while the engine still runs: a handle collected after
        # the stop would make the next actor call's flush fail (a core issue, reported).
        gc.collect()
        pm_client = client_for(pm)
        pm_client.flush()


def eq(value: torch.Tensor, expected: Any) -> bool:
    """A fetched shard equals ``expected`` (nested lists); compared locally even inside activate()."""
    from actormesh.tensor._client import local_torch  # no_mesh inside activate() still intercepts ops

    with local_torch():
        return torch.equal(value, torch.tensor(expected, dtype=value.dtype))


# -- functions the workers import by name --------------------------------------------------------
@remote
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@remote
def split_pair(x: torch.Tensor, k: int) -> dict[str, Any]:
    return {"head": x[:k].clone(), "rest": (x[k:] + 1,), "k": k}


@remote(propagate=lambda x: x)
def nope(x: torch.Tensor) -> torch.Tensor:
    raise ValueError("nope from the worker")


@remote(propagate=lambda x: torch.empty(3))
def lies_about_shape(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros(5)


@remote
def from_values(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros(int(x.sum().item()))  # data-dependent: fake tensors cannot tell the size


@remote(propagate=lambda x: x.add_(1))
def bump(x: torch.Tensor) -> torch.Tensor:
    return x.add_(1)


@remote(propagate=lambda x: x.add_(1))
def bump_then_fail(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("failed while bumping")


@remote
def allsum(x: torch.Tensor, pg: Any) -> torch.Tensor:
    torch.distributed.all_reduce(x, group=pg)
    return x * 1


@remote
def allsum_by_value(x: torch.Tensor, pg: Any) -> torch.Tensor:
    torch.distributed.all_reduce(x, group=pg)
    return torch.zeros(int(x.sum().item()))


@remote(propagate="inspect")
def where_am_i(offset: int = 0) -> int:
    from actormesh.actor import context

    return context().actor_instance.rank.rank + offset


@remote(propagate="inspect")
def total(x: torch.Tensor) -> float:
    return float(x.sum())


@remote(propagate="inspect")
def pid() -> int:
    return os.getpid()


@remote(propagate="inspect")
def add_in_place(x: torch.Tensor, v: float) -> None:
    x.add_(v)


@remote(propagate="inspect")
def hang_until_killed(victim: int) -> None:
    from actormesh.actor import context

    if context().actor_instance.rank.rank != victim:
        return
    deadline = time.monotonic() + 120  # the test kills this proc long before
    while time.monotonic() < deadline:
        threading.Event().wait(0.05)


# -- propagation modes -----------------------------------------------------------------------------
def test_cached_propagation_gives_shapes_without_a_round_trip_and_caches_per_metadata(procs):
    with procs.activate():
        x = torch.arange(6.0).reshape(2, 3)
        y = double(x)
        assert isinstance(y, T.Tensor) and y.shape == (2, 3) and y.dtype == torch.float32
        assert len(double._cache) == 1
        double(x + 1)  # same metadata: cache hit
        assert len(double._cache) == 1
        double(torch.ones(4))
        assert len(double._cache) == 2
        assert eq(T.inspect(y, hosts=1, gpus=1), [[0, 2, 4], [6, 8, 10]])


def test_pytree_results_keep_their_structure_and_plain_values(procs):
    with procs.activate():
        out = split_pair(torch.arange(5.0), 2)
        assert set(out) == {"head", "rest", "k"} and out["k"] == 2
        assert out["head"].shape == (2,) and out["rest"][0].shape == (3,)
        assert eq(T.inspect(out["rest"][0]), [3, 4, 5])


def test_callable_propagate_lambda_and_path_names(procs):
    with procs.activate():
        x = torch.ones(2, 2)
        sub = remote(lambda a, b: a - b, propagate=lambda a, b: a)  # cloudpickled
        assert eq(T.inspect(sub(x, 3)), [[-2, -2], [-2, -2]])
        by_name = remote("torch.mul")
        assert eq(T.inspect(by_name(x, 5)), [[5, 5], [5, 5]])

        def local(a: torch.Tensor) -> torch.Tensor:  # a closure: by value too
            return a.t() + x.shape[0]

        assert eq(T.inspect(remote(local)(torch.ones(2, 3))), [[3, 3]] * 3)


def test_function_that_cannot_run_on_fake_tensors_is_propagated_on_a_worker(procs):
    with procs.activate():
        z = from_values(torch.ones(2, 3) * 2)
        assert z.shape == (12,)
        assert eq(T.inspect(z, hosts=1, gpus=0), [0] * 12)


def test_inspect_mode_returns_none_and_call_returns_plain_values(procs):
    with procs.activate():
        assert where_am_i(1) is None
        got = where_am_i.call(10).get(timeout=W)
    assert got.values() == [10, 11, 12, 13]
    assert got.item(hosts=1, gpus=0) == 12


def test_mocked_is_refused_and_bad_propagate_is_a_type_error(procs):
    mocked = remote(lambda x: x, propagate="mocked")
    with procs.activate():
        with pytest.raises(NotImplementedError, match="mocked"):
            mocked(torch.ones(1))
    with pytest.raises(TypeError, match="propagate must be"):
        remote(propagate="sometimes")
    with pytest.raises(TypeError, match="function or a 'package.module.function'"):
        remote(42)


def test_in_place_remote_mutation_is_seen_and_a_failure_poisons_the_mutated_input(procs):
    with procs.activate():
        x = torch.zeros(3)
        bump(x)
        bump(x)
        assert eq(T.inspect(x), [2, 2, 2])
        bump_then_fail(x)
        with pytest.raises(RemoteException, match="failed while bumping"):
            T.inspect(x)


def test_process_group_argument_is_mocked_for_propagation_and_real_on_the_workers(procs):
    with procs.activate():
        pg = procs.process_group("gpus")
        x = torch.ones(2) + procs.rank_tensor("gpus") + 10 * procs.rank_tensor("hosts")
        y = allsum(x, pg)  # fake run with a dummy group: no worker involved
        assert y.shape == (2,)
        assert eq(T.inspect(y, hosts=0, gpus=0), [3, 3]) and eq(T.inspect(y, hosts=1, gpus=1), [23, 23])
        with pytest.raises(ValueError, match="process group.*propagate=fn"):
            allsum_by_value(x, pg)  # a lone proc would wait forever in the collective


# -- errors ---------------------------------------------------------------------------------------
def test_worker_exception_poisons_dependents_only_and_workers_live_on(procs):
    with procs.activate():
        x = torch.ones(2)
        bad = nope(x)
        later = bad + 1
        good = x + 1
        for t in (bad, later):
            with pytest.raises(RemoteException) as info:
                T.inspect(t, hosts=0, gpus=1)
            text = str(info.value)
            assert "A remote function has failed asynchronously on rank 1" in text
            assert "nope from the worker" in text and "Traceback" in text
            assert "test_tensor_remote.py" in info.value.issued_at
        assert eq(T.inspect(good), [2, 2])
        assert eq(T.inspect(double(x)), [2, 2])  # the engine keeps serving
        with pytest.raises(RemoteException, match="nope from the worker"):
            nope.call(x).get(timeout=W)
        assert total.call(x).get(timeout=W).values() == [2.0] * 4


def test_result_disagreeing_with_propagation_poisons_with_a_clear_message(procs):
    with procs.activate():
        y = lies_about_shape(torch.ones(1))
        assert y.shape == (3,)
        with pytest.raises(RemoteException, match=r"returned a tensor \[5\].*propagation said \[3\].*propagate="):
            T.inspect(y)


def test_misuse_is_reported_at_the_call_site(procs):
    with pytest.raises(ValueError, match=r"with mesh.activate\(\):"):
        where_am_i()
    with pytest.raises(ValueError, match=r"with mesh.activate\(\):"):
        where_am_i.call()
    local = torch.ones(2)
    with procs.activate():
        with pytest.raises(TypeError, match="LOCAL_TENSOR"):
            double(local)
        t = torch.ones(2)
        t.drop()
        with pytest.raises(TypeError, match="DROPPED"):
            double(t)
        mine = torch.ones(2)
    with procs.slice(hosts=0).activate():
        with pytest.raises(TypeError, match="WRONG_MESH"):
            double(mine)
    with pytest.raises(TypeError, match="needs a remote function"):
        T.call_on_shard_and_fetch(lambda: 1)


# -- adverbs, ordered with tensor ops ----------------------------------------------------------
def test_call_sees_every_op_issued_before_it(procs):
    with procs.activate():
        x = torch.zeros(4)
        for _ in range(5):
            x.add_(1)
        first = total.call(x)
        x.mul_(10)
        second = total.call(x)
    assert first.get(timeout=W).values() == [20.0] * 4
    assert second.get(timeout=W).values() == [200.0] * 4


def test_call_on_a_slice_is_shaped_like_the_slice_and_call_one_needs_one_proc(procs):
    with procs.slice(hosts=1).activate():
        got = where_am_i.call().get(timeout=W)
        assert got.values() == [2, 3] and got.item(gpus=1) == 3
        with pytest.raises(ValueError, match="exactly 1"):
            where_am_i.call_one()
    with procs.slice(hosts=1, gpus=0).activate():
        assert where_am_i.call_one(5).get(timeout=W) == 7


def test_choose_stream_broadcast_and_send(procs):
    with procs.activate():
        assert where_am_i.choose().get(timeout=W) in (0, 1, 2, 3)
        assert sorted(f.get(timeout=W) for f in where_am_i.stream(100)) == [100, 101, 102, 103]
        x = torch.zeros(2)
        assert add_in_place.broadcast(x, 4.0) is None
        assert eq(T.inspect(x, hosts=1, gpus=1), [4, 4])
        port, receiver = Channel.open()
        assert send(where_am_i, (), {"offset": 50}, port=port) is None
        assert sorted(receiver.recv().get(timeout=W) for _ in range(4)) == [50, 51, 52, 53]


def test_call_on_shard_and_fetch_runs_on_one_shard(procs):
    with procs.activate():
        r = procs.rank_tensor("gpus") + 10 * procs.rank_tensor("hosts")
        assert T.call_on_shard_and_fetch(total, r, shard={"hosts": 1, "gpus": 1}).get(timeout=W) == 11.0
        assert T.call_on_shard_and_fetch(total, r).get(timeout=W) == 0.0
        fut = T.call_on_shard_and_fetch(nope, r, shard={"hosts": 0, "gpus": 1})
        with pytest.raises(RemoteException, match="nope from the worker"):
            fut.get(timeout=W)
        with pytest.raises(ValueError, match="missing gpus"):
            T.call_on_shard_and_fetch(total, r, shard={"hosts": 1})


def test_a_dead_proc_fails_a_pending_call(spawn_procs):
    pm = spawn_procs(per_host={"gpus": 2})
    with pm.activate():
        victim = pid.call().get(timeout=W).item(gpus=1)
        pending = hang_until_killed.call(1)
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(SupervisionError):
            pending.get(timeout=W)
