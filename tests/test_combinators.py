"""Future combinators and owned threads: no processes, no sleeps standing in for sync."""

from __future__ import annotations

import threading

import pytest

from actormesh.runtime import Future, gather, when_done
from actormesh.runtime._threads import ThreadGroup


def _pending(n: int) -> list[Future]:
    return [Future._create() for _ in range(n)]


def test_gather_waits_for_all_and_keeps_order():
    a, b, c = _pending(3)
    g = gather([a, b, c])
    c._set_result("c")
    a._set_result("a")
    assert not g.done()
    b._set_thunk(lambda: "b")
    assert g.get(timeout=1) == ["a", "b", "c"]


def test_gather_fails_with_the_first_error_in_order_once_all_are_done():
    a, b, c = _pending(3)
    g = gather([a, b, c])
    c._set_exception(KeyError("c"))
    b._set_exception(ValueError("b"))
    assert not g.done()  # a still runs: nothing is abandoned
    a._set_result(1)
    with pytest.raises(ValueError, match="b"):
        g.get(timeout=1)


def test_gather_of_nothing_is_done():
    assert gather([]).get(timeout=1) == []


def test_gather_times_out_on_the_given_clock_and_the_futures_go_on():
    timers = []
    a, b = _pending(2)
    g = gather([a, b], timeout_s=5.0, call_later=lambda d, fn: timers.append((d, fn)), what="two replies")
    a._set_result(1)
    assert [d for d, _ in timers] == [5.0]
    timers[0][1]()  # the deadline passes
    with pytest.raises(TimeoutError, match="two replies: 1 of 2 not done within 5s"):
        g.get(timeout=1)
    b._set_result(2)  # completes later; the gathered future keeps its first outcome
    assert b.get(timeout=1) == 2
    with pytest.raises(TimeoutError):
        g.get(timeout=1)


def test_a_deadline_after_completion_changes_nothing():
    timers = []
    (a,) = _pending(1)
    g = gather([a], timeout_s=1.0, call_later=lambda d, fn: timers.append(fn))
    a._set_result(7)
    timers[0]()
    assert g.get(timeout=1) == [7]


def test_gather_rejects_a_timeout_without_a_clock():
    with pytest.raises(ValueError, match="call_later"):
        gather(_pending(1), timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        gather(_pending(1), timeout_s=float("nan"), call_later=lambda d, fn: None)


def test_gather_completed_from_many_threads_completes_once():
    futures = _pending(64)
    g = gather(futures)
    threads = [threading.Thread(target=f._set_result, args=(i,)) for i, f in enumerate(futures)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert g.get(timeout=5) == list(range(64))


def test_then_and_when_done_chain():
    (a,) = _pending(1)
    doubled = gather([a]).then(lambda values: values[0] * 2)
    ran = []
    after = when_done(a, lambda: ran.append(True))
    a._set_exception(RuntimeError("x"))  # when_done runs whatever the outcome
    with pytest.raises(RuntimeError):
        doubled.get(timeout=1)
    assert after.get(timeout=1) is None and ran == [True]


def test_when_done_carries_the_continuations_error():
    def boom() -> None:
        raise OSError("flush failed")

    with pytest.raises(OSError, match="flush failed"):
        when_done(Future.completed(1), boom).get(timeout=1)


def test_a_thread_group_joins_its_threads_and_names_the_late_ones():
    group = ThreadGroup("test")
    release = threading.Event()
    started = threading.Event()

    def blocker() -> None:
        started.set()
        release.wait(30)

    group.start(blocker, name="blocker")
    assert started.wait(10)
    assert group.running() == ["blocker"]
    assert group.join(timeout_s=0.05) == ["blocker"]
    release.set()
    assert group.join(timeout_s=10) == []
    assert group.running() == []
