"""The reorder buffer's rules in virtual time: no processes, sockets or sleeps."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from actormesh.runtime._ordering import Reorder, ReorderBuffer


def test_in_order_items_are_released_at_once():
    buf = ReorderBuffer(1.0)
    assert [x for i in range(5) for x in buf.push("s", i, i, now=0.0)] == [0, 1, 2, 3, 4]
    assert buf.next_expiry() is None


def test_early_items_wait_for_the_gap_to_fill():
    buf = ReorderBuffer(1.0)
    assert buf.push("s", 2, "c", now=0.0) == ()
    assert buf.push("s", 1, "b", now=0.1) == ()
    assert buf.next_expiry() == 1.0
    assert buf.push("s", 0, "a", now=0.2) == ["a", "b", "c"]
    assert buf.next_expiry() is None
    assert buf.expire(now=5.0) == []


def test_senders_are_independent():
    buf = ReorderBuffer(1.0)
    assert buf.push("x", 1, "x1", now=0.0) == ()
    assert buf.push("y", 0, "y0", now=0.0) == ("y0",)
    assert buf.push("x", 0, "x0", now=0.0) == ["x0", "x1"]


def test_a_gap_is_skipped_only_after_its_timeout():
    buf = ReorderBuffer(1.0)
    buf.push("s", 0, "a", now=0.0)
    buf.push("s", 2, "c", now=0.0)
    assert buf.expire(now=0.99) == []
    assert buf.expire(now=1.0) == ["c"]
    assert buf.push("s", 3, "d", now=1.0) == ("d",)


def test_a_second_gap_behind_a_skipped_one_gets_its_own_full_timeout():
    buf = ReorderBuffer(1.0)
    buf.push("s", 1, "b", now=0.0)
    buf.push("s", 3, "d", now=0.5)  # 0 and 2 missing
    assert buf.expire(now=1.0) == ["b"]  # gap 0 skipped; 2 is still missing
    assert buf.next_expiry() == 2.0  # counted from the skip, not from when d came
    assert buf.expire(now=1.9) == []
    assert buf.expire(now=2.0) == ["d"]


def test_a_late_message_of_a_skipped_gap_is_delivered_once():
    buf = ReorderBuffer(1.0)
    buf.push("s", 3, "d", now=0.0)
    assert buf.expire(now=1.0) == ["d"]
    assert buf.push("s", 1, "b", now=2.0) == ("b",)
    assert buf.push("s", 1, "b-dup", now=2.0) == ()
    assert buf.push("s", 0, "a", now=2.0) == ("a",)
    assert buf.push("s", 2, "c", now=2.0) == ("c",)
    assert buf.push("s", 3, "d-dup", now=2.0) == ()


def test_take_next_accepts_only_the_next_number_with_nothing_held():
    buf = ReorderBuffer(1.0)
    assert buf.take_next("s", 0) and buf.take_next("s", 1)
    assert not buf.take_next("s", 3)  # early: the caller pushes it instead
    assert buf.push("s", 3, "d", now=0.0) == ()
    assert not buf.take_next("s", 2)  # next, but 3 is held behind it: push releases both in order
    assert buf.push("s", 2, "c", now=0.0) == ["c", "d"]
    assert buf.take_next("s", 4)


def test_forget_drops_a_sender():
    buf = ReorderBuffer(1.0)
    buf.push("s", 1, "b", now=0.0)
    assert len(buf) == 1
    buf.forget("s")
    assert len(buf) == 0 and buf.next_expiry() is None
    assert buf.push("s", 0, "a", now=0.0) == ("a",)  # a fresh stream


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=30), st.randoms(use_true_random=False))
def test_any_arrival_order_without_loss_releases_everything_in_order(n, rnd):
    order = list(range(n))
    rnd.shuffle(order)
    buf = ReorderBuffer(1.0)
    out = []
    for seq in order:
        out.extend(buf.push("s", seq, seq, now=0.0))  # no time passes: nothing is skipped
    assert out == list(range(n))


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=30), st.randoms(use_true_random=False), st.sets(st.integers(0, 29)))
def test_with_losses_and_time_every_arrived_item_is_released_exactly_once(n, rnd, lost):
    arriving = [i for i in range(n) if i not in lost]
    rnd.shuffle(arriving)
    buf = ReorderBuffer(1.0)
    out, now = [], 0.0
    for seq in arriving:
        now += rnd.choice([0.0, 0.3, 1.5])
        out.extend(buf.expire(now))
        out.extend(buf.push("s", seq, seq, now=now))
    while buf.next_expiry() is not None:  # each later gap waits its own full timeout
        now = buf.next_expiry()
        out.extend(buf.expire(now))
    assert sorted(out) == sorted(arriving)


class _VirtualLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[tuple[float, object]] = []

    def schedule(self, delay: float, fn) -> None:
        self.timers.append((self.now + delay, fn))

    def advance(self, dt: float) -> None:
        self.now += dt
        due = sorted((t for t in self.timers if t[0] <= self.now), key=lambda t: t[0])
        self.timers = [t for t in self.timers if t[0] > self.now]
        for _, fn in due:
            fn()


def test_the_shell_keeps_one_timer_and_releases_through_its_callback():
    loop = _VirtualLoop()
    out = []
    r = Reorder(lambda env, payload: out.append((env, payload)), loop.schedule, 1.0, clock=lambda: loop.now)
    r.push("s", 1, "b", "pb")
    r.push("t", 1, "y", "py")
    assert len(loop.timers) == 1  # one timer for the oldest gap, not one per sender
    loop.advance(1.0)
    assert sorted(out) == [("b", "pb"), ("y", "py")]
    assert loop.timers == []
    r.push("s", 2, "c", "pc")
    assert out[-1] == ("c", "pc")


def test_the_shell_rearms_when_a_timer_fires_early():
    loop = _VirtualLoop()
    out = []
    r = Reorder(lambda env, payload: out.append(env), loop.schedule, 1.0, clock=lambda: loop.now)
    r.push("s", 1, "b", None)
    loop.timers = [(0.5, loop.timers[0][1])]  # the loop fires it early (clock resolution)
    loop.advance(0.5)
    assert out == [] and len(loop.timers) == 1
    loop.advance(0.5)
    assert out == ["b"]
