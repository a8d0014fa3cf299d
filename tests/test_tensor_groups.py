"""Worker-side collectives of the tensor engine (actormesh/tensor/_groups.py and
_collectives.py), over real processes.

Each scenario starts N plain Python processes (this file run as a script) that
connect to a TCPStore held by the test, run their part and save what they saw with
torch.save; the test then checks every rank's results against values computed
here. The processes are killed if the scenario fails or runs past its deadline.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve()
SRC = HERE.parent.parent / "src" / "actormesh" / "tensor"


def _load(name: str) -> Any:
    """Import a tensor-layer module by path (the layer's __init__ is not ours)."""
    full = f"actormesh.tensor.{name}"
    if full in sys.modules:
        return sys.modules[full]
    import actormesh  # noqa: F401  (parent package; actormesh.tensor may not exist yet)

    if "actormesh.tensor" not in sys.modules:
        try:
            import actormesh.tensor  # noqa: F401
        except ImportError:
            pkg = importlib.util.module_from_spec(
                importlib.util.spec_from_loader("actormesh.tensor", loader=None, is_package=True))
            pkg.__path__ = [str(SRC)]
            sys.modules["actormesh.tensor"] = pkg
    if full in sys.modules:  # the layer's __init__ imported it already
        return sys.modules[full]
    spec = importlib.util.spec_from_file_location(full, SRC / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[full] = mod
    spec.loader.exec_module(mod)
    return mod


G = _load("_groups")
C = _load("_collectives")
OPS = ["sum", "avg", "product", "min", "max"]
BITS = ["band", "bor", "bxor"]


# ---------------------------------------------------------------- child side

def _value(rank: int, shape: tuple[int, ...] = (4, 3), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank-dependent input every proc (and the test) can rebuild."""
    base = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    return (base * (rank + 1) % 7 + rank).to(dtype)


def _main_collectives(rank: int, world: int, groups: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pg = groups.group(tuple(range(world)))
    for red in OPS + ["stack"]:
        for scatter in (False, True):
            out[f"{red}/{scatter}"] = C.collective(_value(rank), pg, world, red, scatter, False)
    for red in BITS + ["sum", "min", "max"]:
        out[f"int/{red}"] = C.collective(_value(rank, dtype=torch.int64), pg, world, red, False, False)
        out[f"int/{red}/scatter"] = C.collective(_value(rank, dtype=torch.int32), pg, world, red, True, False)
    flags = torch.tensor([True, rank == 0, rank % 2 == 0, False])
    out["bool"] = {r: C.collective(flags, pg, world, r, False, False) for r in ("sum", "band", "bor", "bxor")}
    # Non-contiguous input, in place: the result lands in the caller's view.
    wide = _value(rank, (3, 4))
    view = wide.t()
    same = C.collective(view, pg, world, "sum", False, True)
    out["inplace_noncontig"] = (same is view, wide.clone())
    t = _value(rank)
    out["inplace_a2a"] = (C.collective(t, pg, world, "stack", True, True) is t, t)
    out["stack_noncontig"] = C.collective(_value(rank, (3, 4)).t(), pg, world, "stack", False, False)
    out["scalar"] = C.collective(torch.tensor(float(rank)), pg, world, "max", False, False)
    out["empty"] = [C.collective(torch.ones(world, 0), pg, world, r, s, False).shape
                    for r, s in [("sum", False), ("sum", True), ("stack", False), ("stack", True)]]
    # User code in a remote function: plain torch.distributed calls on our group.
    import torch.distributed as dist

    u = torch.full((2,), float(rank))
    dist.all_reduce(u, group=pg)
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=world - 1, group=pg)
    parts = [torch.empty(1) for _ in range(world)]
    dist.all_gather(parts, torch.tensor([float(rank)]), group=pg)
    out["user"] = (u, b, torch.cat(parts), dist.get_world_size(pg), pg.rank())
    # 2x2 mesh ("x", "y") = ranks 0..3: reduce over each dim in its own disjoint groups.
    for dim in ("x", "y"):
        ranks = G.group_ranks(["x", "y"], [2, 2], list(range(world)), rank, dim)
        sub = groups.group(ranks)
        out[f"mesh/{dim}"] = (ranks, C.collective(_value(rank), sub, 2, "sum", False, False))
    out["agree"] = C.agree_ok(pg, rank != 2)
    # Exchange: each sends to the next rank and to itself, receives from the previous.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    sends = [(nxt, _value(rank) * 10), (rank, _value(rank, (2,))), (nxt, _value(rank, (5,), torch.int16))]
    recvs = [(prv, (4, 3), torch.float32), (rank, (2,), torch.float32), (prv, (5,), torch.int16)]
    out["exchange"] = C.exchange(groups, sends, recvs)
    return out


def _main_dead_peer(rank: int, world: int, groups: Any) -> dict[str, Any]:
    pg = groups.group(tuple(range(world)))
    C.collective(torch.ones(2), pg, world, "sum", False, False)  # all alive: works
    if rank == world - 1:
        os._exit(0)  # a peer that dies without a word
    out: dict[str, Any] = {}
    for name, call in [
        ("collective", lambda: C.collective(torch.ones(2), pg, world, "sum", False, False)),
        ("again", lambda: groups.group(tuple(range(world)))),
        ("rendezvous", lambda: groups.group((rank, world - 1))),
    ]:
        started = time.monotonic()
        try:
            call()
            out[name] = None
        except G.CollectiveError as exc:
            out[name] = (str(exc), exc.group, exc.op, time.monotonic() - started)
    return out


def _child(scenario: str, rank: int, world: int, port: int, timeout_s: float, path: str) -> None:
    try:
        store = G.connect_store("127.0.0.1", port, timeout_s)
        with G.Groups(store, rank, timeout_s) as groups:
            result = globals()[f"_main_{scenario}"](rank, world, groups)
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, path)


# ---------------------------------------------------------------- test side

def _run(scenario: str, world: int, tmp_path: Path, timeout_s: float, deadline_s: float = 40) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` processes; return each rank's results."""
    _, port, store = G.start_store("127.0.0.1", timeout_s)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen([sys.executable, str(HERE), scenario, str(r), str(world), str(port),
                          str(timeout_s), str(tmp_path / f"{r}.pt")], env=env)
        for r in range(world)
    ]
    try:
        end = time.monotonic() + deadline_s
        for p in procs:
            p.wait(timeout=max(0.1, end - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        del store
    results = [torch.load(tmp_path / f"{r}.pt") if (tmp_path / f"{r}.pt").exists() else None for r in range(world)]
    for r, res in enumerate(results):
        assert res is None or "error" not in res, f"rank {r} failed:\n{res['error']}"
    return results


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run("collectives", 4, tmp_path_factory.mktemp("four"), timeout_s=30)


def _inputs(shape=(4, 3), dtype=torch.float32, world=4) -> torch.Tensor:
    return torch.stack([_value(r, shape, dtype) for r in range(world)])


def _expect(red: str, x: torch.Tensor) -> torch.Tensor:
    if red in ("sum", "avg"):
        s = x.sum(0)
        return s / x.size(0) if red == "avg" else s
    if red == "product":
        return x.prod(0)
    if red in ("min", "max"):
        return getattr(x, f"a{red}")(0)
    acc = x[0].clone()
    for row in x[1:]:
        acc = {"band": acc & row, "bor": acc | row, "bxor": acc ^ row}[red]
    return acc


@pytest.mark.timeout(90)
@pytest.mark.parametrize("red", OPS)
def test_float_reductions_and_reduce_scatter(four: list[dict[str, Any]], red: str) -> None:
    full = _expect(red, _inputs())
    for rank, res in enumerate(four):
        torch.testing.assert_close(res[f"{red}/False"], full)
        torch.testing.assert_close(res[f"{red}/True"], full[rank])  # my row, outer dim gone


@pytest.mark.timeout(90)
@pytest.mark.parametrize("red", BITS + ["sum", "min", "max"])
def test_integer_reductions(four: list[dict[str, Any]], red: str) -> None:
    full64 = _expect(red, _inputs(dtype=torch.int64))
    full32 = _expect(red, _inputs(dtype=torch.int32))
    for rank, res in enumerate(four):
        assert res[f"int/{red}"].dtype == torch.int64
        assert torch.equal(res[f"int/{red}"], full64)
        assert torch.equal(res[f"int/{red}/scatter"], full32[rank])


@pytest.mark.timeout(90)
def test_bool_reductions_follow_torch_logic(four: list[dict[str, Any]]) -> None:
    flags = torch.stack([torch.tensor([True, r == 0, r % 2 == 0, False]) for r in range(4)])
    for res in four:
        assert torch.equal(res["bool"]["sum"], flags.any(0))
        assert torch.equal(res["bool"]["band"], flags.all(0))
        assert torch.equal(res["bool"]["bor"], flags.any(0))
        assert torch.equal(res["bool"]["bxor"], flags.sum(0) % 2 == 1)


@pytest.mark.timeout(90)
def test_stack_gathers_in_group_rank_order_and_stack_scatter_is_all_to_all(four: list[dict[str, Any]]) -> None:
    x = _inputs()
    for rank, res in enumerate(four):
        assert torch.equal(res["stack/False"], x)  # new outer dim of size 4
        assert torch.equal(res["stack/True"], x[:, rank])  # row j = rank j's row for me
        assert torch.equal(res["stack_noncontig"], _inputs((3, 4)).transpose(1, 2))
        is_t, t = res["inplace_a2a"]
        assert is_t and torch.equal(t, x[:, rank])
        assert res["scalar"].shape == () and res["scalar"].item() == 3.0
        assert res["empty"] == [(4, 0), (0,), (4, 4, 0), (4, 0)]


@pytest.mark.timeout(90)
def test_inplace_on_a_non_contiguous_view_writes_through(four: list[dict[str, Any]]) -> None:
    total = _inputs((3, 4)).sum(0)
    for res in four:
        returned_view, base = res["inplace_noncontig"]
        assert returned_view
        assert torch.equal(base, total)


@pytest.mark.timeout(90)
def test_user_code_calls_torch_distributed_on_the_group(four: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(four):
        u, b, gathered, size, group_rank = res["user"]
        assert torch.equal(u, torch.full((2,), 6.0))
        assert torch.equal(b, torch.full((2,), 3.0))
        assert torch.equal(gathered, torch.arange(4.0))
        assert (size, group_rank) == (4, rank)


@pytest.mark.timeout(90)
def test_disjoint_groups_of_a_2x2_mesh_reduce_over_each_dim(four: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(four):
        x, y = divmod(rank, 2)
        xs, got_x = res["mesh/x"]
        ys, got_y = res["mesh/y"]
        assert xs == (y, 2 + y) and ys == (2 * x, 2 * x + 1)
        torch.testing.assert_close(got_x, _value(xs[0]) + _value(xs[1]))
        torch.testing.assert_close(got_y, _value(ys[0]) + _value(ys[1]))


@pytest.mark.timeout(90)
def test_agree_ok_names_the_failed_member_to_everyone(four: list[dict[str, Any]]) -> None:
    assert [res["agree"] for res in four] == [[2]] * 4


@pytest.mark.timeout(90)
def test_exchange_between_four_procs(four: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(four):
        prv = (rank - 1) % 4
        a, own, small = res["exchange"]
        assert torch.equal(a, _value(prv) * 10)
        assert torch.equal(own, _value(rank, (2,)))
        assert torch.equal(small, _value(prv, (5,), torch.int16))


@pytest.mark.timeout(60)
def test_a_dead_peer_gives_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    results = _run("dead_peer", 3, tmp_path, timeout_s=3, deadline_s=40)
    for rank in (0, 1):
        res = results[rank]
        message, group, op, _ = res["collective"]
        assert group == (0, 1, 2) and op.startswith("all_reduce")
        assert "all_reduce(sum) on group (0, 1, 2)" in message and "peer died" in message
        message, group, op, elapsed = res["again"]
        assert "broken" in message and elapsed < 1
        message, group, op, elapsed = res["rendezvous"]
        assert group == (rank, 2) and "group rendezvous" in message and "3.0s deadline" in message
        assert elapsed >= 2.5  # it waited for the deadline, not forever


# ---------------------------------------------------------------- pure parts

def test_group_ranks_picks_the_points_sharing_my_other_coordinates() -> None:
    labels, sizes = ["a", "b", "c"], [2, 3, 2]
    ranks = [100 + i for i in range(12)]  # global ranks need not be 0..n-1
    # point (1, 2, 0) is index 1*6 + 2*2 + 0 = 10
    assert G.group_ranks(labels, sizes, ranks, 110, "b") == (106, 108, 110)
    assert G.group_ranks(labels, sizes, ranks, 110, ["a"]) == (104, 110)
    assert G.group_ranks(labels, sizes, ranks, 110, ("c", "a")) == (104, 105, 110, 111)
    assert G.group_ranks(labels, sizes, ranks, 110, ["a", "b", "c"]) == tuple(ranks)
    assert G.group_ranks(["x"], [1], [7], 7, "x") == (7,)


def test_group_ranks_rejects_misuse_by_name() -> None:
    with pytest.raises(KeyError, match="'z'"):
        G.group_ranks(["x", "y"], [2, 2], [0, 1, 2, 3], 0, "z")
    with pytest.raises(ValueError, match="distinct"):
        G.group_ranks(["x", "y"], [2, 2], [0, 1, 2, 3], 0, ["x", "x"])
    with pytest.raises(ValueError, match="not in the mesh"):
        G.group_ranks(["x", "y"], [2, 2], [0, 1, 2, 3], 9, "x")
    with pytest.raises(ValueError, match="4 points"):
        G.group_ranks(["x", "y"], [2, 2], [0, 1, 2], 0, "x")


def test_collective_rejects_bad_arguments_before_any_communication() -> None:
    class NoComm:  # any backend call would fail the test
        def size(self) -> int:
            return 2

    pg: Any = NoComm()
    with pytest.raises(ValueError, match="integer or bool"):
        C.collective(torch.ones(2, 2), pg, 2, "band", False, False)
    with pytest.raises(ValueError, match="floating point"):
        C.collective(torch.ones(2, dtype=torch.int64), pg, 2, "avg", False, False)
    with pytest.raises(ValueError, match="not supported"):
        C.collective(torch.ones(2), pg, 2, "mean", False, False)
    with pytest.raises(ValueError, match="outermost dimension"):
        C.collective(torch.ones(3, 2), pg, 2, "sum", True, False)
    with pytest.raises(ValueError, match="not valid in place"):
        C.collective(torch.ones(2, 2), pg, 2, "sum", True, True)
    with pytest.raises(ValueError, match="not valid in place"):
        C.collective(torch.ones(2, 2), pg, 2, "stack", False, True)
    with pytest.raises(ValueError, match="group_size"):
        C.collective(torch.ones(2, 2), pg, 3, "sum", False, False)


def test_groups_refuse_a_group_without_me() -> None:
    store = G.start_store("127.0.0.1", 5)[2]
    groups = G.Groups(store, 0, 5)
    try:
        with pytest.raises(ValueError, match="not a member"):
            groups.group((1, 2))
        with pytest.raises(ValueError, match="distinct"):
            groups.group((0, 0))
        with pytest.raises(ValueError, match="sends 1 tensor.* receives 0"):
            C.exchange(groups, [(0, torch.ones(1))], [])
    finally:
        groups.close()
    with pytest.raises(RuntimeError, match="closed"):
        groups.group((0,))


def test_connect_store_names_the_unreachable_address() -> None:
    _, port, store = G.start_store("127.0.0.1", 5)
    del store  # nothing listens there any more
    with pytest.raises(G.TransportError, match=f"127.0.0.1:{port} within 1"):
        G.connect_store("127.0.0.1", port, 1)


if __name__ == "__main__":
    scenario, rank, world, port, timeout_s, path = sys.argv[1:]
    _child(scenario, int(rank), int(world), int(port), float(timeout_s), path)
