"""Casting along a tree: same results, same per-sender order, failures contained."""

from __future__ import annotations

import os
import signal

import pytest

from actormesh import config
from actormesh.actor import Actor, SupervisionError, current_rank, endpoint
from actormesh.runtime._cast import tree_stats

T = 30


class Node(Actor):
    def __init__(self) -> None:
        self.log: list[int] = []

    @endpoint
    def where(self) -> tuple[int, int, int]:
        return (current_rank().rank, os.getpid(), len(self.log))

    @endpoint
    def push(self, x: int) -> None:
        self.log.append(x)

    @endpoint
    def history(self) -> list[int]:
        return list(self.log)

    @endpoint
    def digest(self, data: bytes) -> tuple[int, bytes]:
        import zlib

        return zlib.crc32(data), bytes(data[-1000:]) * 1100  # a reply above the shared-memory threshold


@pytest.fixture
def small_fanout():
    with config.configured(max_cast_fanout=2):
        yield


def test_call_and_broadcast_through_a_tree(spawn_procs, small_fanout):
    procs = spawn_procs(per_host={"hosts": 2, "gpus": 4})  # 8 members, fan-out 2: depth 3
    nodes = procs.spawn("nodes", Node)
    got = nodes.where.call().get(timeout=T)
    assert [r for r, _, _ in got.values()] == list(range(8))
    assert len({pid for _, pid, _ in got.values()}) == 8
    assert got.item(hosts=1, gpus=2)[0] == 6
    # A slice is cast along its own tree, with slice-relative message ranks.
    part = nodes.slice(gpus=slice(1, 4)).where.call().get(timeout=T)
    assert [r for r, _, _ in part.values()] == list(range(6))


def test_large_payloads_cross_the_tree_both_ways(spawn_procs, small_fanout):
    """Relays forward big arguments (shared memory between procs of a host) and
    gather big replies back up: every byte arrives at every member."""
    import zlib

    procs = spawn_procs(per_host={"gpus": 6})
    nodes = procs.spawn("nodes", Node)
    data = os.urandom(3 << 20)
    tail = data[-1000:] * 1100
    for crc, back in nodes.digest.call(data).get(timeout=T).values():
        assert crc == zlib.crc32(data) and back == tail


def test_per_sender_order_holds_between_tree_and_direct_sends(spawn_procs, small_fanout):
    procs = spawn_procs(per_host={"gpus": 7})
    nodes = procs.spawn("nodes", Node)
    direct = nodes.slice(gpus=5)
    expected = []
    for i in range(60):
        nodes.push.broadcast(i)  # down the tree
        expected.append(i)
        if i % 7 == 0:
            direct.push.call_one(-i - 1)  # straight to rank 5, must land after broadcast i
            expected.append(-i - 1)
    histories = nodes.history.call().get(timeout=T).values()
    assert histories[5] == expected
    for r, h in enumerate(histories):
        if r != 5:
            assert h == list(range(60))


def test_a_dead_subtree_fails_its_calls_and_spares_the_rest(spawn_procs, small_fanout, faults):
    procs = spawn_procs(per_host={"gpus": 6})
    nodes = procs.spawn("nodes", Node)
    pids = [pid for _, pid, _ in nodes.where.call().get(timeout=T).values()]
    os.kill(pids[0], signal.SIGKILL)  # rank 0 is the root of the first subtree
    with pytest.raises(SupervisionError):
        nodes.where.call().get(timeout=T)
    alive = nodes.slice(gpus=slice(3, 6)).where.call().get(timeout=T)
    assert [pid for _, pid, _ in alive.values()] == pids[3:]
    faults.wait(1)


def test_tree_shape_for_4096_virtual_procs():
    stats = tree_stats(4096, 16)
    assert stats["sender_messages"] == 16  # the controller sends O(fan-out), not O(N)
    assert stats["max_messages_per_node"] <= 16
    assert stats["depth"] == 3  # 16 * 16 * 16 = 4096
    assert stats["total_messages"] == 4096  # every member receives exactly once
