"""The controller's cost of a cast grows with the tree's fan-out, not the mesh size
(issue 13): counted on a simulated 4,096-member mesh, no processes. The mesh
layer casts through a real ProcRuntime whose routes only record what they are
handed; we count sends, the numbering calls, the view's rank lookups, and every
Python and builtin call made during one cast."""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from actormesh import config
from actormesh.actor import Actor, endpoint
from actormesh.mesh import ActorMesh, Extent, Shape
from actormesh.runtime import ProcRuntime
from actormesh.runtime import messages as M
from actormesh.runtime._numbering import SeqOut


_names = itertools.count()  # a fresh mesh name per mesh: the plan cache is process-wide


class Worker(Actor):
    @endpoint
    def step(self, x: int) -> int:
        return x


class _Capture:
    """A route stand-in that keeps what the verbs hand it."""

    dead = None

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def send(self, env: tuple[Any, ...], payload: object = (), key: object = None) -> None:
        self.sent.append(tuple(env))


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ProcRuntime, _Capture, Callable[[int], ActorMesh[Worker]]]]:
    rt = ProcRuntime(name="cast-cost")
    monkeypatch.setattr(ActorMesh, "_runtime", staticmethod(lambda: rt))  # views made by slicing too
    capture = _Capture()

    def mesh(n: int) -> ActorMesh[Worker]:
        addresses = [f"unix:/nonexistent/p{i}.sock" for i in range(n)]
        for a in addresses:
            rt._routes[a] = capture  # type: ignore[assignment]
        shape = Shape.row_major(("hosts", "gpus"), (n // 8, 8))
        return ActorMesh(Worker, "w", f"w-{n}-{next(_names)}", addresses, shape, "<w", Extent(("hosts", "gpus"), (n // 8, 8)))

    try:
        with config.configured(max_cast_fanout=16):
            yield rt, capture, mesh
    finally:
        rt.close()


class _Counting:
    """Counts calls of some functions while active."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        for cls, name in [(Shape, "rank_at"), (SeqOut, "next"), (SeqOut, "cast_all"), (SeqOut, "cast_some")]:
            monkeypatch.setattr(cls, name, self._wrap(name, getattr(cls, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return fn(*args, **kwargs)

        return counted


def _calls_during(fn: Callable[[], Any]) -> int:
    """Python and builtin calls made while ``fn`` runs (this thread)."""
    n = 0

    def prof(frame: Any, event: str, arg: Any) -> None:
        nonlocal n
        if event in ("call", "c_call"):
            n += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def test_a_broadcast_to_4096_members_costs_the_controller_16_sends_and_no_work_per_member(sim, monkeypatch):
    rt, capture, make = sim
    mesh = make(4096)
    mesh.step.broadcast(1)  # the first cast of a view makes its plan (once per view)
    capture.sent.clear()
    counting = _Counting(monkeypatch)
    mesh.step.broadcast(2)
    assert len(capture.sent) == 16 and all(env[0] == M.CAST for env in capture.sent)
    assert counting.counts == {"cast_all": 1}  # one number for the whole mesh; no rank lookups
    casts = [M.typed(env) for env in capture.sent]
    assert {c.seq for c in casts} == {1} and {c.prev for c in casts} == {0}
    # The subtrees' addresses went with the first cast; now each root is named its table.
    assert all(c.addrs is None for c in casts) and sum(c.table[1] for c in casts) == 4096
    assert sum(len(M.encode(env)) for env in capture.sent) < 16 * 200  # bytes: O(fanout), not O(members)


def test_the_controller_makes_as_many_calls_per_cast_on_4096_members_as_on_256(sim):
    rt, capture, make = sim
    small, large = make(256), make(4096)
    for m in (small, large):
        m.step.broadcast(0)
        m.step.call(0)  # plans made, ports warmed
    for verb in ("broadcast", "call"):
        # the least of 3: a first run may meet a one-off (a table growing, a collection)
        cost = {len(m): min(_calls_during(lambda: getattr(m.step, verb)(1)) for _ in range(3)) for m in (small, large)}
        assert cost[4096] == cost[256], (verb, cost)


def test_a_cast_to_the_same_slice_again_costs_as_many_calls_on_4096_members_as_on_256(sim):
    rt, capture, make = sim
    small, large = make(512).slice(hosts=slice(0, 32)), make(8192).slice(hosts=slice(0, 512))
    assert (len(small), len(large)) == (256, 4096)
    for m in (small, large):
        m.step.broadcast(0)  # the first cast to a view checks each member (once per view)
        m.step.call(0)
    for verb in ("broadcast", "call"):
        cost = {len(m): min(_calls_during(lambda: getattr(m.step, verb)(1)) for _ in range(3)) for m in (small, large)}
        assert cost[4096] == cost[256], (verb, cost)


def test_a_direct_call_costs_one_exception_in_the_next_whole_cast_only(sim, monkeypatch):
    rt, capture, make = sim
    mesh = make(4096)
    mesh.step.broadcast(0)
    capture.sent.clear()
    counting = _Counting(monkeypatch)
    mesh.slice(hosts=3, gpus=5).step.call_one(7)  # member 29, straight
    mesh.step.broadcast(1)
    mesh.step.broadcast(2)
    call, *casts = [M.typed(env) for env in capture.sent]
    assert (call.kind, call.seq, call.prev) == (M.CALL, 1, 0)
    first, second = casts[:16], casts[16:]
    assert [c.exceptions for c in first if c.exceptions] == [{29: 1}]  # member 29 follows the call, not the last cast
    assert all(c.prev == 0 and c.seq == 2 for c in first)
    assert all(c.exceptions is None and c.prev == 2 for c in second)
    assert counting.counts == {"next": 1, "cast_all": 2, "rank_at": 1}  # the one rank lookup is call_one's



class _Conn:
    pass


def test_a_subtree_root_gets_its_addresses_once_per_connection(sim):
    rt, capture, make = sim
    mesh = make(64)
    capture.conn = _Conn()  # type: ignore[attr-defined]
    mesh.step.broadcast(0)
    mesh.step.broadcast(1)
    capture.conn = _Conn()  # type: ignore[attr-defined]  # the route reconnected: the root may be new
    mesh.step.broadcast(2)
    capture.conn = None  # type: ignore[attr-defined]  # dialling: nothing known to have arrived
    mesh.step.broadcast(3)
    mesh.step.broadcast(4)
    casts = [M.typed(env) for env in capture.sent]
    sent = [[c.addrs is not None for c in casts[k : k + 8]] for k in range(0, len(casts), 8)]
    assert sent == [[True] * 8, [False] * 8, [True] * 8, [True] * 8, [True] * 8]
    assert len({c.table for c in casts}) == 8  # one table per subtree, the same every time


def test_a_root_keeps_a_table_per_sender_and_fails_a_subtree_whose_table_it_lacks():
    from actormesh.runtime._cast import CastTables, subtree_addresses

    class _Root:
        def __init__(self) -> None:
            self.cast_tables = CastTables()

    root = _Root()
    first = M.Cast(M.CAST, "a", "step", None, (), (), "ctl", 4, ("p4", "p5"), (7, 2), 0, -1, None)
    assert subtree_addresses(root, first) == ("p4", "p5")  # type: ignore[arg-type]
    assert subtree_addresses(root, first._replace(addrs=None)) == ("p4", "p5")  # type: ignore[arg-type]
    assert subtree_addresses(root, first._replace(addrs=None, sender="other")) is None  # type: ignore[arg-type]
    root.cast_tables.forget("ctl")
    assert subtree_addresses(root, first._replace(addrs=None)) is None  # type: ignore[arg-type]
