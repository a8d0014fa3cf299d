"""Unit tests of the mesh layer through a FakeRuntime (tests/fake_runtime.py): no
processes, sockets, threads or sleeps. Each test sends through the real adverbs,
views and ports, then answers (or loses) what was sent, in an order it picks, and
checks what the caller sees: where a message went, which member it was, what a
reply, an error or a lost peer becomes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest

from actormesh import config
from actormesh.actor import Actor, endpoint
from actormesh.errors import ActorDiedError, ActorError, ActorUnreachableError, Cause, CauseKind, MeshStoppedError
from actormesh.mesh import ActorMesh, ProcMesh, Shape, ValueMesh
from actormesh.runtime import STOP_MARGIN_S

from fake_runtime import FakeRuntime, actor_mesh, install


class Worker(Actor):
    def __init__(self, base: int = 0) -> None:
        self.base = base

    @endpoint
    def step(self, x: int, scale: int = 1) -> int:
        return self.base + x * scale


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeRuntime]:
    rt = install(monkeypatch)
    with config.configured(max_cast_fanout=16, cleanup_timeout=3.0):
        yield rt


def grid(hosts: int = 2, gpus: int = 4) -> ActorMesh[Any]:
    """``hosts`` x ``gpus`` members at ``fake:p0``... in row-major order."""
    return actor_mesh(Worker, ("hosts", "gpus"), (hosts, gpus))


# -- where a message goes -----------------------------------------------------------------------

@pytest.mark.parametrize("view, address, labels, sizes", [
    (lambda m: m.slice(hosts=1, gpus=2), "fake:p6", (), ()),
    (lambda m: m.slice(hosts=slice(1, 2), gpus=slice(3, 4)), "fake:p7", ("hosts", "gpus"), (1, 1)),
    (lambda m: m.slice(gpus=slice(1, 3)).slice(hosts=0, gpus=1), "fake:p2", (), ()),
])
def test_call_one_goes_to_the_proc_of_the_sliced_point_as_member_zero(fake, view, address, labels, sizes):
    fut = view(grid()).step.call_one(7, scale=2)
    (sent,) = fake.sent
    assert (sent.verb, sent.address, sent.endpoint, sent.member) == ("call_actor", address, "step", 0)
    assert (sent.labels, sent.sizes, sent.args, sent.kwargs) == (labels, sizes, (7,), {"scale": 2})
    assert sent.reply is not None and sent.reply[0] == fake.address
    assert not fut.done()
    assert fake.answer(sent, 14)
    assert fut.get(timeout=0) == 14
    assert fake.ports == {} and fake.waiting() == {}  # the port and its peer watch are gone


def test_call_one_on_a_view_of_several_members_refuses_and_sends_nothing(fake):
    with pytest.raises(ValueError, match="exactly 1"):
        grid().slice(hosts=0).step.call_one(1)
    with pytest.raises(TypeError):
        grid().slice(hosts=0, gpus=0).step.call_one("x", "y", "z")  # the signature is checked before sending
    assert fake.sent == []


def test_choose_sends_to_the_member_it_picked_of_the_view(fake, monkeypatch):
    import actormesh.mesh._endpoint as endpoint_module

    asked: list[int] = []

    def pick_last(n: int) -> int:
        asked.append(n)
        return n - 1

    monkeypatch.setattr(endpoint_module, "pick_random", pick_last)
    view = grid().slice(gpus=slice(0, 4, 2))  # gpus 0 and 2 of both hosts: p0, p2, p4, p6
    fut = view.step.choose(1)
    (sent,) = fake.sent
    assert asked == [4] and (sent.address, sent.member, sent.sizes) == ("fake:p6", 3, (2, 2))
    fake.answer(sent, "six")
    assert fut.get(timeout=0) == "six"


def test_choose_at_random_stays_inside_the_view(fake):
    view = grid(4, 4).slice(hosts=slice(1, 3), gpus=3)  # p7, p11
    for _ in range(40):
        view.step.choose(0)
    assert {(s.address, s.member) for s in fake.sent} <= {("fake:p7", 0), ("fake:p11", 1)}
    assert len(fake.sent) == 40


def test_broadcast_sends_to_every_member_and_opens_no_port(fake):
    grid().slice(hosts=1).step.broadcast(5)
    assert [(s.verb, s.address, s.member, s.reply) for s in fake.sent] == [("call_actor", f"fake:p{4 + i}", i, None) for i in range(4)]
    assert all(s.args == (5,) and s.sizes == (4,) for s in fake.sent)
    assert fake.ports == {} and fake.waiting() == {}


# -- what replies become ----------------------------------------------------------------------------

def test_call_gathers_replies_arriving_in_any_order_into_a_value_mesh_in_rank_order(fake):
    fut = grid().slice(gpus=slice(1, 3)).step.call(1)
    sent = fake.of("call_actor")
    assert [(s.address, s.member) for s in sent] == [("fake:p1", 0), ("fake:p2", 1), ("fake:p5", 2), ("fake:p6", 3)]
    for i in (3, 0, 2):
        fake.answer(sent[i], f"from {sent[i].address}")
        assert not fut.done()
    fake.answer(sent[1], "from fake:p2")
    vm = fut.get(timeout=0)
    assert isinstance(vm, ValueMesh) and vm.sizes == {"hosts": 2, "gpus": 2}
    assert vm.values() == ["from fake:p1", "from fake:p2", "from fake:p5", "from fake:p6"]
    assert vm.item(hosts=1, gpus=0) == "from fake:p5"
    assert fake.ports == {} and fake.waiting() == {}


def test_a_late_duplicate_reply_is_dropped(fake):
    fut = grid().slice(hosts=0, gpus=0).step.call_one(1)
    (sent,) = fake.sent
    assert fake.answer(sent, "first")
    assert not fake.answer(sent, "second")  # the port closed with the first reply
    assert fut.get(timeout=0) == "first"


def test_call_waits_for_every_member_then_raises_the_first_error_in_rank_order(fake):
    fut = grid(1, 4).step.call(0)
    sent = fake.of("call_actor")
    fake.answer_error(sent[3], ValueError("three"))
    fake.answer_error(sent[1], KeyError("one"))
    fake.answer(sent[0], 0)
    assert not fut.done()  # an error does not end the gather: member 2 still owes its reply
    fake.answer(sent[2], 2)
    with pytest.raises(KeyError) as info:
        fut.get(timeout=0)
    assert isinstance(info.value, ActorError) and not isinstance(info.value, ValueError)
    assert "one" in str(info.value)


def test_an_endpoint_error_reaches_call_one_as_its_own_type_with_the_remote_traceback(fake):
    fut = grid().slice(hosts=0, gpus=3).step.call_one(1)
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError as exc:
        fake.answer_error(fake.sent[0], exc)
    with pytest.raises(ZeroDivisionError) as info:
        fut.get(timeout=0)
    assert isinstance(info.value, ActorError) and "boom" in str(info.value) and "Traceback" in str(info.value)


def test_a_member_reported_gone_fails_the_call_with_actor_died_error_naming_its_view_rank(fake):
    fut = grid().slice(hosts=1).step.call(1)
    sent = fake.of("call_actor")
    for i in (0, 1, 3):
        fake.answer(sent[i], i)
    fake.answer_gone(sent[2], Cause("the process exited with non-zero code 3", CauseKind.EXITED, code=3))
    with pytest.raises(ActorDiedError) as info:
        fut.get(timeout=0)
    err = info.value
    assert err.rank == 2 and err.cause is not None and err.cause.code == 3
    assert err.endpoint == "w.step" and "'hosts': 1/2, 'gpus': 2/4" in (err.actor or "")  # the member, globally


def test_stream_yields_futures_completed_in_arrival_order(fake):
    futures = list(grid(1, 4).step.stream(0))
    sent = fake.of("call_actor")
    assert len(futures) == 4 and not any(f.done() for f in futures)
    fake.answer(sent[2], "v2")
    assert futures[0].done() and not futures[1].done()
    fake.answer(sent[0], "v0")
    fake.answer_error(sent[3], ValueError("v3"))
    fake.answer(sent[1], "v1")
    assert [futures[i].get(timeout=0) for i in (0, 1, 3)] == ["v2", "v0", "v1"]
    with pytest.raises(ValueError, match="v3"):
        futures[2].get(timeout=0)
    assert fake.ports == {} and fake.waiting() == {}


# -- lost peers -------------------------------------------------------------------------------------

def test_a_lost_peer_fails_only_the_stream_reply_it_owes(fake):
    futures = list(grid(1, 4).step.stream(0))
    sent = fake.of("call_actor")
    fake.answer(sent[0], "v0")
    fake.answer(sent[2], "v2")
    fake.lose_peer("fake:p1")
    with pytest.raises(ActorUnreachableError) as info:
        futures[2].get(timeout=0)
    assert info.value.rank == 1
    assert not futures[3].done()  # member 3's proc is alive: its reply is still owed
    fake.answer(sent[3], "v3")
    assert futures[3].get(timeout=0) == "v3"
    assert fake.waiting() == {} and fake.ports == {}


def test_a_lost_subtree_root_fails_exactly_its_subtree_of_a_tree_call(fake):
    fut = grid(8, 8).step.call(1)  # 64 members under fan-out 16: 8 subtrees of 8
    (tree,) = fake.sent
    lost = tree.roots[3]
    fake.lose_peer(lost)
    assert not fut.done()
    for i, root in enumerate(tree.owed):
        if root != lost:
            fake.answer(tree, i, member=i)
    with pytest.raises(ActorUnreachableError) as info:
        fut.get(timeout=0)
    assert info.value.rank == 24 == tree.owed.index(lost)  # the subtree's first member, not member 0
    assert fake.waiting() == {} and fake.ports == {}


def test_a_call_to_a_peer_already_lost_fails_on_the_next_loop_turn(fake):
    fake.lose_peer("fake:p3", Cause("killed by signal 9", CauseKind.SIGNALED, signal=9))
    fut = grid(1, 4).slice(gpus=3).step.call_one(1)
    assert not fut.done()  # as ProcRuntime.await_peer: the port hears of it from the loop
    assert fake.loop.run_ready() == 1
    with pytest.raises(ActorDiedError) as info:
        fut.get(timeout=0)
    assert info.value.cause is not None and info.value.cause.signal == 9


def test_closing_the_runtime_fails_every_pending_call(fake):
    one = grid().slice(hosts=0, gpus=0).step.call_one(1)
    many = grid().step.call(1)
    fake.close()
    for fut in (one, many):
        with pytest.raises(MeshStoppedError):
            fut.get(timeout=0)


# -- the cast tree -----------------------------------------------------------------------------------

@pytest.mark.parametrize("members, verbs", [(16, ["call_actor"] * 16), (17, ["cast"])])
def test_a_view_larger_than_the_fanout_is_cast_along_a_tree(fake, members, verbs):
    actor_mesh(Worker, ("gpus",), (members,)).step.broadcast(0)
    assert [s.verb for s in fake.sent] == verbs


def test_a_call_to_4096_members_is_one_cast_down_16_subtrees_gathered_in_rank_order(fake):
    mesh = actor_mesh(Worker, ("hosts", "gpus"), (64, 64))
    fut = mesh.step.call(3)
    (tree,) = fake.sent  # one verb call, not one per member
    assert tree.verb == "cast" and tree.whole and len(tree.roots) == 16 and len(set(tree.owed)) == 16
    assert tree.members == tuple(f"fake:p{i}" for i in range(4096)) and tree.args == (3,)
    values = [i * 10 for i in range(4096)]
    fake.answer_cast(tree, values)
    vm = fut.get(timeout=0)
    assert vm.values() == values and vm.item(hosts=63, gpus=1) == 63 * 64 * 10 + 10
    mesh.step.broadcast(4)
    assert fake.sent[-1].verb == "cast" and fake.sent[-1].reply is None and len(fake.sent) == 2
    assert fake.ports == {}


def test_a_cast_to_a_slice_of_a_large_mesh_names_only_the_slice(fake):
    mesh = actor_mesh(Worker, ("hosts", "gpus"), (64, 64))
    mesh.slice(gpus=slice(0, 32)).step.broadcast(1)
    (tree,) = fake.sent
    assert not tree.whole and len(tree.members) == 2048 and tree.sizes == (64, 32)
    assert tree.members[:3] == ("fake:p0", "fake:p1", "fake:p2") and tree.members[32] == "fake:p64"
    assert len(tree.roots) <= 16


# -- spawn and stop, as the owner sees them ------------------------------------------------------------

def spawned(fake: FakeRuntime, hosts: int = 2, gpus: int = 2) -> ActorMesh[Any]:
    """Spawn ``Worker(5)`` on a fake proc mesh and answer every ``__init__``."""
    procs = ProcMesh([f"fake:p{i}" for i in range(hosts * gpus)], Shape.row_major(("hosts", "gpus"), (hosts, gpus)), "procs")
    mesh = cast("ActorMesh[Any]", procs.spawn("w", Worker, 5))  # spawn is typed as the actor class
    for s in fake.of("spawn_actor"):
        fake.answer(s, None)
    fake.sent.clear()
    return mesh


def test_spawn_on_a_sliced_proc_mesh_creates_one_member_per_proc_and_waits_for_every_init(fake):
    procs = ProcMesh([f"fake:p{i}" for i in range(8)], Shape.row_major(("hosts", "gpus"), (2, 4)), "procs")
    mesh = cast("ActorMesh[Any]", procs.slice(hosts=1).spawn("w", Worker, 5))
    sent = fake.of("spawn_actor")
    assert [(s.address, s.member, s.cls, s.args, s.sizes) for s in sent] == [(f"fake:p{4 + i}", i, Worker, (5,), (4,)) for i in range(4)]
    assert fake.owned_meshes[sent[0].actor].addresses == [f"fake:p{4 + i}" for i in range(4)]
    for s in sent[:3]:
        fake.answer(s, None)
    assert not mesh.initialized.done()
    fake.answer_error(sent[3], RuntimeError("no GPU"))
    with pytest.raises(RuntimeError, match="no GPU"):
        mesh.initialized.get(timeout=0)
    mesh.slice(gpus=1).step.call_one(1)
    assert fake.sent[-1].address == "fake:p5" and fake.sent[-1].actor == sent[0].actor


def test_calls_to_a_member_the_owner_knows_failed_fail_at_once_and_send_nothing(fake):
    mesh = spawned(fake)
    record = fake.owned_meshes[mesh._mesh_name]
    record.failed[1] = Cause("the process exited with non-zero code 1", CauseKind.EXITED, code=1)
    with pytest.raises(ActorDiedError) as info:
        mesh.slice(hosts=0, gpus=1).step.call_one(1).get(timeout=0)
    assert info.value.rank == 0  # its rank in the one-member view called
    with pytest.raises(ActorDiedError) as info:
        mesh.step.call(1).get(timeout=0)
    assert info.value.rank == 1
    assert fake.sent == []
    mesh.slice(hosts=1, gpus=1).step.call_one(1)  # the other members are still served
    assert [s.address for s in fake.sent] == ["fake:p3"]


def test_stop_kills_the_proc_of_a_member_that_did_not_stop_by_the_deadline(fake):
    mesh = spawned(fake)
    stopped = mesh.stop("done")
    sent = fake.of("stop_actor")
    assert [(s.address, s.member) for s in sent] == [(f"fake:p{i}", i) for i in range(4)]
    for s in sent[:3]:
        fake.answer(s, None)
    deadline = config.get_config().cleanup_timeout + STOP_MARGIN_S
    fake.loop.advance(deadline - 0.01)
    assert not stopped.done() and fake.of("stop_proc") == []
    fake.loop.advance(0.02)
    assert stopped.get(timeout=0) is None
    assert [s.address for s in fake.of("stop_proc")] == ["fake:p3"] and fake.expected_gone == {"fake:p3"}
    fake.sent.clear()
    with pytest.raises(MeshStoppedError, match="proc killed"):
        mesh.step.call(1).get(timeout=0)
    assert fake.sent == []
