"""Per-sender order with sequence numbers per destination actor (issue 26): a cast that
starts inside a member of its own mesh passes through its own process first, and the
members it forwards keep the numbers the origin gave them (no gap, no wait)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from actormesh import config
from actormesh.actor import Actor, current_rank, endpoint

T = 30


class Member(Actor):
    def __init__(self) -> None:
        self.log: list[int] = []

    @endpoint
    def push(self, x: int) -> None:
        self.log.append(x)

    @endpoint
    def history(self) -> list[int]:
        return list(self.log)

    @endpoint
    def cast_from_here(self, mesh: Any, n: int) -> tuple[list[list[int]], float]:
        """Broadcast down a tree rooted in this very process, then call every other member directly."""
        assert current_rank().rank == 0
        t0 = time.monotonic()
        for i in range(n):
            mesh.push.broadcast(i)
        others = [mesh.slice(gpus=g) for g in range(1, 7)]
        for target in others:
            target.push.call_one(-1).get(timeout=T)
        return [t.history.call_one().get(timeout=T) for t in others], time.monotonic() - t0


@pytest.fixture
def small_fanout(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ACTORMESH_MAX_CAST_FANOUT", "2")  # in the procs too: the cast starts in one
    with config.configured(max_cast_fanout=2):
        yield


def test_a_cast_from_inside_its_mesh_keeps_order_without_waiting_for_a_gap(spawn_procs, small_fanout):
    procs = spawn_procs(per_host={"gpus": 7})
    members = procs.spawn("members", Member)
    histories, took_s = members.slice(gpus=0).cast_from_here.call_one(members, 20).get(timeout=T)
    assert histories == [[*range(20), -1]] * 6
    assert took_s < 4.0, took_s  # a numbering gap would hold a member's calls for the 5 s gap timeout


def test_numbers_are_per_destination_actor_and_forgetting_a_process_drops_all_of_its_actors() -> None:
    from actormesh.runtime._ordering import ReorderBuffer, SeqOut

    seq = SeqOut()  # (number, previous number to that actor): one chain per destination actor
    assert [seq.next("p", "a"), seq.next("p", "a"), seq.next("p", "b"), seq.next("q", "a")] == [(0, -1), (1, 0), (0, -1), (2, -1)]
    seq.forget("p")
    assert (seq.next("p", "a"), seq.next("p", "b"), seq.next("q", "a")) == ((3, -1), (0, -1), (4, 2))  # p's chains start anew; b had no other member: dropped

    buf = ReorderBuffer(gap_timeout_s=5.0)
    assert buf.push(("s", "a"), 1, "a1", now=0.0) == ()  # a's 0 is still on its way (a large message)
    assert buf.push(("s", "b"), 0, "b0", now=0.0) == ("b0",)  # another actor's stream is not held by it
    assert buf.push(("s", "a"), 0, "a0", now=0.1) == ["a0", "a1"]
    buf.push(("s", "a"), 5, "a5", now=0.2)
    buf.forget("s")
    assert len(buf) == 0 and buf.next_expiry() is None
