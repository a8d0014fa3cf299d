"""Chained message numbers (runtime/_ordering.SeqOut) across direct calls and cast
trees, in virtual time: no processes, sockets or sleeps. A simulated network of
tree nodes runs the real relay (runtime/_cast.handle_cast) and delivers messages
in any order, and every member must release one sender's messages in send order."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from actormesh.runtime import CastPlan
from actormesh.runtime import messages as M
from actormesh.runtime._cast import CastTables, handle_cast
from actormesh.runtime._ordering import ReorderBuffer, SeqOut

SENDER = "ctl"
ACTOR = "a"


class _Config:
    max_cast_fanout = 3


class _Node:
    """Stands in for a ProcRuntime in handle_cast: relays go to the network."""

    config = _Config()

    def __init__(self, net: _Net, address: str) -> None:
        self.net = net
        self.address = address
        self.buffer = ReorderBuffer(gap_timeout_s=1.0)
        self.released: list[Any] = []
        self._reorder = self
        self.cast_tables = CastTables()

    def push(self, stream: Any, seq: int, env: Any, payload: Any, prev: int | None = None) -> None:
        self.released.extend(self.buffer.push(stream, seq, env, now=0.0, prev=prev))

    def send(self, address: str, env: Any, payload: Any) -> None:
        self.net.flight.append((address, env))

    def reply(self, port: Any, index: int, status: int, payload: Any) -> None:
        self.net.replies.append((index, status))


class _Net:
    """In-flight messages, delivered in whatever order the test picks."""

    def __init__(self, n: int) -> None:
        self.addresses = [f"p{i}" for i in range(n)]
        self.nodes = {a: _Node(self, a) for a in self.addresses}
        self.flight: list[tuple[str, Any]] = []
        self.seq_out = SeqOut()
        self.sent: dict[str, list[str]] = {a: [] for a in self.addresses}  # per member, in send order
        self.replies: list[tuple[int, int]] = []
        self.gone: dict[str, list[list[str]]] = {}  # what each earlier incarnation released
        self.before: dict[str, list[list[str]]] = {}  # what each earlier incarnation was sent

    def call(self, i: int, tag: str) -> None:
        addr = self.addresses[i]
        seq, prev = self.seq_out.next(addr, ACTOR)
        self.flight.append((addr, M.Call(M.CALL, ACTOR, tag, None, 0, (), (), SENDER, seq, prev)))
        self.sent[addr].append(tag)

    def cast(self, indices: list[int], tag: str, *, view: bool = True) -> None:
        """Cast to the members ``indices`` as Verbs.cast does (a whole cast if all); ``view``:
        numbered as a slice view (else member by member, as when a root is dead)."""
        plan = CastPlan([self.addresses[i] for i in indices], fanout=3)
        if len(indices) == len(self.addresses):
            t, prev, exc = self.seq_out.cast_all(ACTOR, plan.addresses)
        else:
            t, prev, exc = self.seq_out.cast_some(ACTOR, plan.addresses, plan.members if view else None)
        per_chunk = plan.exceptions_by_chunk(exc) if exc else None
        for c, (lo, sub) in enumerate(plan.chunks):
            env = M.Cast(M.CAST, ACTOR, tag, None, (), (), SENDER, lo, sub, None, t, prev, per_chunk[c] if per_chunk else None)
            self.flight.append((sub[0], env))
        for i in indices:
            self.sent[self.addresses[i]].append(tag)

    def restart(self, i: int, rnd: random.Random) -> None:
        """Member ``i``'s process is gone for good (after all it was sent arrived) and a
        new one comes up at its address: it has seen nothing."""
        self.deliver(rnd)
        addr = self.addresses[i]
        self.seq_out.forget(addr)
        old = self.nodes[addr]
        self.nodes[addr] = _Node(self, addr)
        self.gone[addr] = self.gone.get(addr, []) + [[env.endpoint for env in old.released]]
        self.before[addr] = self.before.get(addr, []) + [self.sent[addr]]
        self.sent[addr] = []

    def deliver(self, rnd: random.Random) -> None:
        """Deliver everything in flight, in a random order (relays add more)."""
        while self.flight:
            address, env = self.flight.pop(rnd.randrange(len(self.flight)))
            node = self.nodes[address]
            if env.kind == M.CAST:
                handle_cast(node, env, [b""])  # type: ignore[arg-type]
            else:
                node.push((SENDER, ACTOR), env.seq, env, (), env.prev)

    def received(self) -> dict[str, list[str]]:
        return {a: [env.endpoint for env in node.released] for a, node in self.nodes.items()}


def test_a_direct_call_then_a_cast_then_a_call_keep_their_order_whatever_arrives_first():
    net = _Net(8)
    net.call(3, "first")
    net.cast(list(range(8)), "cast")
    net.call(3, "last")
    net.flight.reverse()  # the last call and the cast's subtrees overtake the first call
    net.deliver(random.Random(0))
    got = net.received()
    assert got["p3"] == ["first", "cast", "last"]
    assert all(got[a] == ["cast"] for a in net.addresses if a != "p3")


def test_a_root_without_the_table_a_cast_names_fails_its_whole_subtree_and_delivers_nothing():
    net = _Net(8)
    env = M.Cast(M.CAST, ACTOR, "x", ("ctl", 1), (), (), SENDER, 2, None, (99, 3), 0, -1, None)
    handle_cast(net.nodes["p2"], env, [b""])  # type: ignore[arg-type]
    assert net.replies == [(2, M.SUPERVISION), (3, M.SUPERVISION), (4, M.SUPERVISION)]
    assert net.flight == [] and net.nodes["p2"].released == []


def test_a_cast_whose_payload_was_lost_fails_its_subtree_in_turn_and_keeps_its_table():
    from actormesh.runtime._lost import payload_lost

    net = _Net(8)
    node = net.nodes["p2"]
    node.name, node.pid = "p2", 0  # type: ignore[attr-defined]
    env = M.Cast(M.CAST, ACTOR, "x", ("ctl", 1), (), (), SENDER, 2, ("p2", "p3", "p4"), (5, 3), 0, -1, None)
    payload_lost(node, env, MemoryError("no memory"))  # type: ignore[arg-type]
    assert [e.member for e in node.released] == [2]  # our member fails in its turn (its reply: an error)
    assert net.replies == [(3, M.ERROR), (4, M.ERROR)]
    assert node.cast_tables.get(SENDER, 5) == ("p2", "p3", "p4")


def test_a_whole_cast_carries_one_number_and_exceptions_only_for_members_called_since():
    seq_out = SeqOut()
    members = tuple(f"p{i}" for i in range(4096))
    assert seq_out.cast_all(ACTOR, members) == (0, -1, {})
    assert seq_out.next("p7", ACTOR) == (1, 0)
    assert seq_out.cast_all(ACTOR, members) == (2, 0, {"p7": 1})
    assert seq_out.cast_all(ACTOR, members) == (3, 2, {})  # the exception was paid for once


def test_members_behind_a_dead_subtree_root_keep_their_chain():
    seq_out = SeqOut()
    members = ("p0", "p1", "p2")
    seq_out.cast_all(ACTOR, members)  # 0
    assert seq_out.cast_all(ACTOR, members, skipped=["p2"]) == (1, 0, {})  # p2's root is dead: p2 never gets 1
    assert seq_out.next("p2", ACTOR) == (2, 0)  # follows 0, the last it was sent
    assert seq_out.next("p1", ACTOR) == (3, 1)


def test_a_peer_gone_for_good_starts_a_new_chain_and_its_mesh_is_dropped_when_all_are():
    seq_out = SeqOut()
    seq_out.cast_all(ACTOR, ("p0", "p1"))
    seq_out.forget("p0")
    assert seq_out.next("p0", ACTOR) == (1, -1)  # a new process at that address has seen nothing
    seq_out.forget("elsewhere")  # not a member: nothing grows
    assert len(seq_out) == 1
    seq_out.forget("p0")
    seq_out.forget("p1")
    assert len(seq_out) == 0


def test_slice_casts_and_calls_interleave_with_whole_casts():
    net = _Net(10)
    net.cast([1, 2, 3, 4, 5], "slice")
    net.call(2, "c2")
    net.cast(list(range(10)), "all")
    net.cast([0, 2, 4, 6, 8], "even")
    net.call(9, "c9")
    net.cast(list(range(10)), "all2")
    net.deliver(random.Random(1))
    assert net.received() == net.sent


@settings(max_examples=150, deadline=None)
@given(
    st.integers(min_value=1, max_value=20),
    st.lists(st.tuples(st.sampled_from(["call", "all", "slice"]), st.integers(0, 19), st.integers(1, 20)), max_size=25),
    st.randoms(use_true_random=False),
)
def test_any_mix_of_calls_and_casts_in_any_arrival_order_is_released_in_send_order(n, ops, rnd):
    net = _Net(n)
    for k, (op, a, b) in enumerate(ops):
        if op == "call":
            net.call(a % n, f"m{k}")
        elif op == "all":
            net.cast(list(range(n)), f"m{k}")
        else:
            lo = a % n
            net.cast(list(range(lo, min(n, lo + b))), f"m{k}")
        if rnd.random() < 0.3:
            net.deliver(rnd)  # some arrive before later ones are sent
    net.deliver(rnd)
    assert net.received() == net.sent


# A few slices, so that casts go to the same views again, overlapping or not.
_SLICES = [[0, 1, 2], [3, 4, 5, 6], [1, 2, 3], [0, 2, 4, 6, 8], [7, 8, 9], [5], [0, 1, 2, 3, 4, 5, 6, 7, 8]]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["call", "all", "slice", "slice", "slice", "member-wise", "restart"]),
                       st.integers(0, 9), st.integers(0, len(_SLICES) - 1)), max_size=40),
    st.randoms(use_true_random=False),
)
def test_casts_to_the_same_slices_again_keep_every_chain_through_calls_restarts_and_whole_casts(ops, rnd):
    net = _Net(10)
    for k, (op, a, b) in enumerate(ops):
        if op == "call":
            net.call(a, f"m{k}")
        elif op == "all":
            net.cast(list(range(10)), f"m{k}")
        elif op == "restart":
            net.restart(a, rnd)
        else:
            net.cast(_SLICES[b], f"m{k}", view=op == "slice")
        if rnd.random() < 0.3:
            net.deliver(rnd)
    net.deliver(rnd)
    assert net.received() == net.sent
    for addr, runs in net.gone.items():
        assert runs == net.before[addr]


def test_a_slice_cast_again_carries_one_number_and_exceptions_only_for_members_called_since():
    seq_out = SeqOut()
    stage = frozenset(f"p{i}" for i in range(1000, 2000))
    members = sorted(stage)
    seq_out.cast_all(ACTOR, [f"p{i}" for i in range(4096)])  # 0
    assert seq_out.cast_some(ACTOR, members, stage) == (1, 0, {})  # the first: each member checked
    assert seq_out.cast_some(ACTOR, members, stage) == (2, 1, {})  # then one number
    assert seq_out.next("p1500", ACTOR) == (3, 2)
    assert seq_out.next("p7", ACTOR) == (4, 0)  # not in the slice: follows the whole cast
    assert seq_out.cast_some(ACTOR, members, stage) == (5, 2, {"p1500": 3})
    assert seq_out.cast_some(ACTOR, members, stage) == (6, 5, {})
    assert seq_out.cast_all(ACTOR, []) == (7, 0, {**{m: 6 for m in members}, "p7": 4})


def test_a_second_cast_to_a_slice_does_no_work_per_member(monkeypatch):
    import actormesh.runtime._numbering as numbering

    seq_out = SeqOut()
    stage = frozenset(f"p{i}" for i in range(4096))
    members = sorted(stage)
    seq_out.cast_some(ACTOR, members, stage)
    lookups = []
    monkeypatch.setattr(numbering._MeshNumbers, "prev_of", lambda self, a: lookups.append(a) or 0)
    seq_out.cast_some(ACTOR, members, stage)
    assert lookups == []


def test_overlapping_slices_name_only_the_shared_members_as_exceptions():
    seq_out = SeqOut()
    a, b = frozenset(["p0", "p1", "p2"]), frozenset(["p2", "p3"])
    assert seq_out.cast_some(ACTOR, sorted(a), a) == (0, -1, {})
    assert seq_out.cast_some(ACTOR, sorted(b), b) == (1, -1, {"p2": 0})
    assert seq_out.cast_some(ACTOR, sorted(a), a) == (2, 0, {"p2": 1})
    assert seq_out.cast_some(ACTOR, sorted(b), b) == (3, 1, {"p2": 2})
