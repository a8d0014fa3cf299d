"""Context API, ranks and mesh slicing with real processes (MONARCH_API.md §1.3, §1.4).

Actor rank (``context().actor_instance.rank``) is the spawn point; message rank
(``context().message_rank`` = ``current_rank()``) is the point within the slice
the message was sent to.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from actormesh.actor import (
    Actor,
    ActorMesh,
    Extent,
    Point,
    ProcMesh,
    ValueMesh,
    context,
    current_actor_name,
    current_rank,
    current_size,
    endpoint,
    this_proc,
)

T = 15


@pytest.fixture(autouse=True)
def _no_unhandled_faults(faults):  # type: ignore[no-untyped-def]
    """Nothing in these tests should reach ``unhandled_fault_hook``."""
    yield
    assert faults.failures == [], f"unexpected unhandled supervision events: {faults.failures}"


class Where(Actor):
    def __init__(self, tag: str = "") -> None:
        self.tag = tag

    @endpoint
    def ranks(self) -> dict[str, object]:
        ctx = context()
        return {
            "actor_rank": ctx.actor_instance.rank.rank,
            "actor_coords": dict(ctx.actor_instance.rank),
            "message_rank": ctx.message_rank.rank,
            "message_coords": dict(ctx.message_rank),
            "current_rank": current_rank().rank,
            "current_coords": dict(current_rank()),
            "current_size": current_size(),
            "pid": os.getpid(),
        }

    @endpoint
    def rank(self) -> int:
        return context().actor_instance.rank.rank

    @endpoint
    def point(self) -> Point:
        return current_rank()

    @endpoint
    def name(self) -> str:
        return current_actor_name()

    @endpoint
    def spawn_sibling(self, tag: str, stop_it: bool = False) -> tuple[int, str, int]:
        proc = context().actor_instance.proc
        assert isinstance(proc, ProcMesh)
        child = proc.spawn("sibling", Where, tag)
        info = child.ranks.call_one().get(timeout=T)
        result = info["pid"], child.tag_of.call_one().get(timeout=T), len(proc)
        if stop_it:
            child.stop().get(timeout=T)
        return result

    @endpoint
    def tag_of(self) -> str:
        return self.tag

    @endpoint
    def call_other(self, other: ActorMesh) -> list[int]:
        # a mesh received as an argument is a reference that can be called
        return other.rank.call().get(timeout=T).values()


class AsyncWhere(Actor):
    @endpoint
    async def ranks(self) -> tuple[int, int, dict[str, int]]:
        await asyncio.sleep(0)
        return context().actor_instance.rank.rank, current_rank().rank, current_size()

    @endpoint
    async def await_other(self, other: ActorMesh) -> list[int]:
        vm = await other.rank.call()
        return vm.values()


# --------------------------------------------------------------------------- context


def test_client_context():
    ctx = context()
    assert dict(ctx.message_rank) == {}
    assert current_size() == {}
    assert dict(current_rank()) == {}
    name = current_actor_name()
    assert isinstance(name, str) and name
    assert current_actor_name() == name


def test_ranks_on_full_mesh(spawn_procs):
    procs = spawn_procs(per_host={"hosts": 2, "gpus": 3})
    w = procs.spawn("w", Where)
    infos = w.ranks.call().get(timeout=T).values()
    for i, info in enumerate(infos):
        assert info["actor_rank"] == i
        assert info["message_rank"] == i
        assert info["current_rank"] == i
        assert info["actor_coords"] == {"hosts": i // 3, "gpus": i % 3}
        assert info["message_coords"] == info["actor_coords"]
        assert info["current_size"] == {"hosts": 2, "gpus": 3}


def test_message_rank_is_relative_to_the_slice(spawn_procs):
    procs = spawn_procs(per_host={"hosts": 2, "gpus": 3})
    w = procs.spawn("w", Where)
    sub = w.slice(hosts=1, gpus=slice(1, 3))
    infos = sub.ranks.call().get(timeout=T).values()
    assert [i["message_rank"] for i in infos] == [0, 1]
    assert [i["actor_rank"] for i in infos] == [4, 5]
    assert [i["message_coords"] for i in infos] == [{"gpus": 0}, {"gpus": 1}]
    assert [i["actor_coords"] for i in infos] == [{"hosts": 1, "gpus": 1}, {"hosts": 1, "gpus": 2}]
    assert [i["current_size"] for i in infos] == [{"gpus": 2}, {"gpus": 2}]
    # a slice that keeps both dims
    col = w.slice(gpus=slice(2, 3))
    infos = col.ranks.call().get(timeout=T).values()
    assert [i["message_coords"] for i in infos] == [{"hosts": 0, "gpus": 0}, {"hosts": 1, "gpus": 0}]
    assert [i["actor_rank"] for i in infos] == [2, 5]
    assert [i["current_size"] for i in infos] == [{"hosts": 2, "gpus": 1}] * 2
    # a singleton call_one: message rank is the 0-dim point
    one = w.slice(hosts=0, gpus=1).ranks.call_one().get(timeout=T)
    assert (one["actor_rank"], one["message_rank"], one["message_coords"], one["current_size"]) == (1, 0, {}, {})


def test_current_rank_is_a_point(spawn_procs):
    procs = spawn_procs(per_host={"hosts": 2, "gpus": 2})
    w = procs.spawn("w", Where)
    points = w.point.call().get(timeout=T).values()
    for i, p in enumerate(points):
        assert isinstance(p, Point)
        assert p.rank == i
        assert dict(p) == {"hosts": i // 2, "gpus": i % 2}
        assert p["gpus"] == i % 2
        assert dict(p.extent) == {"hosts": 2, "gpus": 2}


def test_async_actor_context(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    w = procs.spawn("w", AsyncWhere)
    got = w.slice(gpus=slice(1, 3)).ranks.call().get(timeout=T).values()
    assert got == [(1, 0, {"gpus": 2}), (2, 1, {"gpus": 2})]


def test_current_actor_name_is_distinct_per_member(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    w = procs.spawn("w", Where)
    v = procs.spawn("v", Where)
    names = w.name.call().get(timeout=T).values() + v.name.call().get(timeout=T).values()
    assert all(isinstance(n, str) and n for n in names)
    assert len(set(names)) == 6
    assert current_actor_name() not in names
    assert w.name.call().get(timeout=T).values() == names[:3]  # stable


def test_actor_instance_proc_can_spawn_next_to_the_actor(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", Where)
    results = w.spawn_sibling.call("child", stop_it=True).get(timeout=T).values()
    parent_pids = [i["pid"] for i in w.ranks.call().get(timeout=T).values()]
    assert [pid for pid, _, _ in results] == parent_pids
    assert [tag for _, tag, _ in results] == ["child", "child"]
    assert [n for _, _, n in results] == [1, 1]


def test_proc_mesh_with_actor_spawned_sibling_stops_promptly(spawn_procs):
    """Stopping procs where an actor spawned on its own proc must not wait for the stop timeout."""
    for _ in range(3):
        procs = spawn_procs(per_host={"gpus": 2})
        w = procs.spawn("w", Where)
        assert [tag for _, tag, _ in w.spawn_sibling.call("kid").get(timeout=T).values()] == ["kid", "kid"]
        procs.stop().get(timeout=5)  # stop_timeout is 10 s: a hang shows up as TimeoutError


def test_mesh_passed_to_another_actor_can_be_called(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    w = procs.spawn("w", Where)
    caller_procs = spawn_procs(per_host={"gpus": 1})
    caller = caller_procs.spawn("caller", Where)
    assert caller.call_other.call_one(w).get(timeout=T) == [0, 1, 2]
    assert caller.call_other.call_one(w.slice(gpus=slice(1, 3))).get(timeout=T) == [1, 2]
    acaller = caller_procs.spawn("acaller", AsyncWhere)
    assert acaller.await_other.call_one(w.slice(gpus=0)).get(timeout=T) == [0]


# --------------------------------------------------------------------------- slicing meshes


def test_actor_mesh_slicing(spawn_procs):
    procs = spawn_procs(per_host={"hosts": 2, "gpus": 3})
    w = procs.spawn("w", Where)
    assert w.size() == 6 and len(w) == 6
    assert w.size("gpus") == 3
    assert dict(w.extent) == {"hosts": 2, "gpus": 3}
    assert isinstance(w.extent, Extent)
    assert w.sizes == {"hosts": 2, "gpus": 3}

    first_two = w.slice(gpus=slice(0, 2))
    assert dict(first_two.extent) == {"hosts": 2, "gpus": 2}
    assert first_two.rank.call().get(timeout=T).values() == [0, 1, 3, 4]

    g3 = w.slice(gpus=2)  # int drops the dim
    assert dict(g3.extent) == {"hosts": 2}
    assert g3.rank.call().get(timeout=T).values() == [2, 5]
    assert g3.slice(hosts=1).rank.call_one().get(timeout=T) == 5

    stepped = w.slice(gpus=slice(0, 3, 2))
    assert stepped.rank.call().get(timeout=T).values() == [0, 2, 3, 5]

    neg = w.slice(hosts=-1, gpus=-1)
    assert neg.rank.call_one().get(timeout=T) == 5

    # bad slices are refused
    with pytest.raises(IndexError):
        w.slice(gpus=3)
    with pytest.raises(IndexError):
        w.slice(hosts=-3)
    with pytest.raises(TypeError):
        w.slice(nodes=0)
    with pytest.raises(TypeError):
        w.slice(gpus="0")
    with pytest.raises(ValueError):
        w.split(gpus=("a", "b"), a=2)  # 3 is not divisible by 2
    with pytest.raises(ValueError):
        w.rename(gpus="hosts")  # duplicate label
    with pytest.raises(ValueError, match="sparse"):
        w.slice(gpus=slice(0, 3, 2)).flatten("all")
    # the mesh still works after the rejected attempts
    assert w.slice(gpus=slice(1, 2)).rank.call().get(timeout=T).values() == [1, 4]


def test_actor_mesh_rename_split_flatten(spawn_procs):
    procs = spawn_procs(per_host={"hosts": 2, "gpus": 3})
    w = procs.spawn("w", Where)

    renamed = w.rename(gpus="devices")
    assert dict(renamed.extent) == {"hosts": 2, "devices": 3}
    infos = renamed.slice(devices=1).ranks.call().get(timeout=T).values()
    assert [i["actor_rank"] for i in infos] == [1, 4]
    assert [i["message_coords"] for i in infos] == [{"hosts": 0}, {"hosts": 1}]

    flat = w.flatten("all")
    assert dict(flat.extent) == {"all": 6}
    assert flat.slice(all=slice(3, 6)).rank.call().get(timeout=T).values() == [3, 4, 5]
    infos = flat.ranks.call().get(timeout=T).values()
    assert [i["current_size"] for i in infos] == [{"all": 6}] * 6

    split = flat.split(all=("x", "y"), x=3)
    assert dict(split.extent) == {"x": 3, "y": 2}
    vm = split.ranks.call().get(timeout=T)
    assert vm.item(x=2, y=1)["actor_rank"] == 5
    assert vm.item(x=1, y=0)["message_coords"] == {"x": 1, "y": 0}


def test_proc_mesh_slicing_and_spawning_on_a_slice(spawn_procs):
    procs = spawn_procs(per_host={"hosts": 2, "gpus": 2})
    assert procs.size() == 4 and len(procs) == 4
    assert dict(procs.extent) == {"hosts": 2, "gpus": 2}
    with pytest.raises(IndexError):
        procs.slice(hosts=2)
    with pytest.raises(TypeError):
        procs.slice(bogus=0)
    sub = procs.slice(gpus=1)
    assert dict(sub.extent) == {"hosts": 2}
    w = sub.spawn("w", Where)
    infos = w.ranks.call().get(timeout=T).values()
    assert [i["actor_rank"] for i in infos] == [0, 1]  # spawned on a 2-proc mesh
    assert [i["current_size"] for i in infos] == [{"hosts": 2}] * 2
    full = procs.spawn("full", Where)
    full_pids = [i["pid"] for i in full.ranks.call().get(timeout=T).values()]
    assert [i["pid"] for i in infos] == [full_pids[1], full_pids[3]]
    assert dict(procs.rename(hosts="h").extent) == {"h": 2, "gpus": 2}
    assert dict(procs.flatten("p").extent) == {"p": 4}


def test_this_proc_is_a_singleton_mesh():
    p = this_proc()
    assert p.size() == 1
    assert dict(p.extent) == {}


# --------------------------------------------------------------------------- ValueMesh results


def test_value_mesh_result_api(spawn_procs):
    procs = spawn_procs(per_host={"hosts": 2, "gpus": 3})
    w = procs.spawn("w", Where)
    vm = w.rank.call().get(timeout=T)
    assert isinstance(vm, ValueMesh)
    assert len(vm) == 6
    assert vm.values() == [0, 1, 2, 3, 4, 5]
    items = list(vm.items())
    assert [p.rank for p, _ in items] == list(range(6))
    assert [dict(p) for p, _ in items] == [{"hosts": h, "gpus": g} for h in range(2) for g in range(3)]
    assert [v for _, v in items] == vm.values()
    assert list(vm) == items
    assert vm.item(hosts=1, gpus=2) == 5
    with pytest.raises(KeyError):
        vm.item(hosts=1)
    with pytest.raises(KeyError):
        vm.item(hosts=1, gpus=0, extra=0)

    row = vm.slice(hosts=1)
    assert dict(row.extent) == {"gpus": 3}
    assert row.values() == [3, 4, 5]
    assert [(p.rank, dict(p)) for p, _ in row.items()] == [(0, {"gpus": 0}), (1, {"gpus": 1}), (2, {"gpus": 2})]
    col = vm.slice(gpus=slice(1, 3))
    assert col.values() == [1, 2, 4, 5]
    assert col.item(hosts=1, gpus=0) == 4
    assert vm.slice(hosts=0, gpus=2).item() == 2
    assert vm.flatten("r").values() == list(range(6))
    assert vm.rename(hosts="h").item(h=1, gpus=0) == 3

    # the result of a call on a slice
    vm = w.slice(gpus=slice(1, 3)).rank.call().get(timeout=T)
    assert dict(vm.extent) == {"hosts": 2, "gpus": 2}
    assert vm.values() == [1, 2, 4, 5]
    assert vm.item(hosts=1, gpus=0) == 4
    assert [p.rank for p, _ in vm.items()] == [0, 1, 2, 3]


def test_value_mesh_travels_to_an_actor_and_back(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    w = procs.spawn("w", Where)
    vm = w.rank.call().get(timeout=T)
    echo = spawn_procs(per_host={"gpus": 1}).spawn("echo", _Echo)
    back = echo.echo.call_one(vm.slice(gpus=slice(1, 3))).get(timeout=T)
    assert isinstance(back, ValueMesh)
    assert back.values() == [1, 2]
    assert dict(back.extent) == {"gpus": 2}


class _Echo(Actor):
    @endpoint
    def echo(self, x: object) -> object:
        return x


def test_point_api():
    e = Extent(["hosts", "gpus"], [2, 3])
    p = Point(4, e)
    assert p.rank == 4
    assert dict(p) == {"hosts": 1, "gpus": 1}
    assert p["hosts"] == 1 and p["gpus"] == 1
    assert p.extent == e
    assert p.size("gpus") == 3
    assert len(Point(0, Extent([], []))) == 0
    with pytest.raises(IndexError):
        Point(6, e)
    assert str(e) == "{hosts: 2, gpus: 3}"
    assert str(p) == "{'hosts': 1/2, 'gpus': 1/3}"
    assert list(e) == ["hosts", "gpus"] and e.nelements == 6
