"""When a replica's tokens leave: after every step, or several steps together (``stream_interval_s``).

The policy runs on the engine thread of rank 0 (``LLMServer._queue`` and
``LLMServer._flush``); these tests drive it directly, in virtual time, with
a port that records what it was sent.
"""

from __future__ import annotations

from typing import Any

import pytest

from actormesh.serve import spawn_llm_server
from actormesh.serve._llm_server import LLMServer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class RecordingPort:
    def __init__(self, ref: str) -> None:
        self.ref, self.sent = ref, []

    def send(self, items: Any) -> None:
        self.sent.append(list(items))


def server(interval: float) -> tuple[LLMServer, Clock]:
    s = LLMServer(lambda: None, stream_interval_s=interval)
    clock = Clock()
    s._clock = clock  # type: ignore[method-assign]
    return s, clock


def test_first_tokens_and_ends_leave_at_once_others_wait_within_the_interval() -> None:
    step = 0.125  # steps and interval exact in binary: no rounding at the boundary
    s, clock = server(4 * step)
    port = RecordingPort("p")
    s._queue(port, ("a", "token", 1))
    s._flush(step)
    assert port.sent == [[("a", "token", 1)]]  # a first token is never held back
    for tok in (2, 3, 4):
        clock.now += step
        s._queue(port, ("a", "token", tok))
        s._flush(step)
    # the oldest held token is 2 steps old: with the next step it leaves within the interval
    assert port.sent == [[("a", "token", 1)]]
    clock.now += step
    s._queue(port, ("a", "token", 5))
    s._flush(step)  # 3 steps old + the next one would reach the interval: they go now
    assert port.sent[-1] == [("a", "token", t) for t in (2, 3, 4, 5)]
    clock.now += step
    s._queue(port, ("a", "end", "length"))
    s._flush(step)
    assert port.sent[-1] == [("a", "end", "length")]  # an end is never held back


def test_nothing_is_held_when_the_engine_waits_or_a_prefill_comes() -> None:
    s, clock = server(0.005)
    port = RecordingPort("p")
    s._queue(port, ("a", "token", 1))
    s._flush(0.001)
    s._queue(port, ("a", "token", 2))
    s._flush(None)  # the engine is about to wait, or the next step admits requests
    assert port.sent == [[("a", "token", 1)], [("a", "token", 2)]]
    s._flush(None)
    assert len(port.sent) == 2  # nothing queued: no empty message


def test_a_slow_step_is_not_waited_for_and_zero_sends_after_every_step() -> None:
    s, clock = server(0.005)
    port = RecordingPort("p")
    s._queue(port, ("a", "token", 1))
    s._flush(0.0)
    s._queue(port, ("a", "token", 2))
    s._flush(0.010)  # the next step takes longer than the interval
    assert port.sent == [[("a", "token", 1)], [("a", "token", 2)]]
    s0, _ = server(0.0)
    port0 = RecordingPort("q")
    for tok in range(4):
        s0._queue(port0, ("b", "token", tok))
        s0._flush(0.0)
    assert port0.sent == [[("b", "token", t)] for t in range(4)]


def test_each_port_gets_its_own_requests() -> None:
    s, clock = server(0.005)
    p1, p2 = RecordingPort("1"), RecordingPort("2")
    s._queue(p1, ("a", "token", 1))
    s._queue(p2, ("b", "token", 7))
    s._flush(0.001)
    assert p1.sent == [[("a", "token", 1)]] and p2.sent == [[("b", "token", 7)]]


@pytest.mark.parametrize("bad", [-0.001, float("nan")])
def test_a_negative_interval_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="stream_interval_s"):
        LLMServer(lambda: None, stream_interval_s=bad)
    with pytest.raises(ValueError, match="stream_interval_s"):
        spawn_llm_server(None, lambda: None, stream_interval_s=bad)  # type: ignore[arg-type]
