"""Liveness rules in virtual time (runtime/_liveness.py): busy is never dead,
stopped is dead within 5 s, hung within a bound, a late checker judges nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest
from conftest import wait_for

from actormesh.runtime._liveness import (
    LivenessJudge,
    Peer,
    Policy,
    ProcSample,
    Verdict,
    describe_exit,
    proc_available,
    read_proc,
)

PID = 4242
POLICY = Policy(interval_s=0.5, timeout_s=3.0, hung_s=60.0)
PERIOD = POLICY.interval_s / 2  # the shell ticks every interval / 2


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Child:
    """A simulated child: answers pings while ``responsive``, burns ``cpu_share``
    of a core, has a leader state and an optional runnable thread."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.last_rx = clock.t
        self.responsive = True
        self.state = "S"
        self.runnable = False
        self.cpu_share = 0.0
        self.cpu_s = 0.0
        self.exists = True
        self.rss_bytes = 50 << 20

    def advance(self, dt: float) -> None:
        self.cpu_s += self.cpu_share * dt

    def read(self, pid: int, threads: bool) -> ProcSample | None:
        assert pid == PID
        if not self.exists:
            return None
        # The OS counts CPU time in clock ticks (1/100 s).
        return ProcSample(self.state, int(self.cpu_s * 100) / 100, self.runnable if threads else None, self.rss_bytes)


def simulate(
    judge: LivenessJudge,
    clock: Clock,
    child: Child,
    seconds: float,
    *,
    event: Callable[[float], None] | None = None,
    policy: Policy = POLICY,
) -> list[tuple[float, object]]:
    """Tick every PERIOD for ``seconds``; return (time, death) for each verdict."""
    deaths = []
    start = clock.t
    while clock.t - start < seconds:
        clock.t += PERIOD
        child.advance(PERIOD)
        if event is not None:
            event(clock.t - start)
        r = judge.tick([Peer("c", PID, child.last_rx, policy)])
        if child.responsive and "c" in r.ping:
            child.last_rx = clock.t  # the pong arrives (well) before the next round
        deaths += [(clock.t - start, d) for d in r.deaths]
        if r.deaths:
            break
    return deaths


def judge_for(child: Child, clock: Clock, *, proc: bool = True) -> LivenessJudge:
    return LivenessJudge(clock, child.read if proc else None)


def test_a_busy_child_is_never_declared_dead_however_long_it_is_silent():
    clock = Clock()
    child = Child(clock)
    judge = judge_for(child, clock)
    child.responsive, child.state, child.runnable, child.cpu_share = False, "S", True, 1.0  # one GIL-holding C call
    assert simulate(judge, clock, child, 3600) == []
    # On a crowded host it gets a twentieth of a core and is rarely seen runnable: still busy.
    child.cpu_share, child.runnable = 0.05, False
    assert simulate(judge, clock, child, 3600) == []


def test_a_stopped_child_is_declared_dead_within_5_s():
    clock = Clock()
    child = Child(clock)
    judge = judge_for(child, clock)
    assert simulate(judge, clock, child, 10) == []  # answering pings: alive

    def sigstop(t: float) -> None:
        if t >= 0.6 and child.responsive:
            child.responsive, child.state = False, "T"

    deaths = simulate(judge, clock, child, 30, event=sigstop)
    assert len(deaths) == 1
    at, death = deaths[0]
    assert death.verdict is Verdict.STOPPED and "SIGSTOP" in death.reason
    assert at - 0.6 <= POLICY.timeout_s + POLICY.interval_s / 2 <= 5.0


def test_a_late_checker_gives_no_verdict_and_restarts_the_silence_clocks():
    clock = Clock()
    child = Child(clock)
    judge = judge_for(child, clock)
    simulate(judge, clock, child, 2)
    clock.t += 8.0  # the checker itself was frozen (SIGSTOP, a debugger, GIL held elsewhere)
    r = judge.tick([Peer("c", PID, child.last_rx, POLICY)])
    assert r.late and r.deaths == [] and r.ping == ["c"]
    # Even a child found stopped is only judged after a full timeout from the resume.
    child.state, child.responsive = "T", False
    deaths = simulate(judge, clock, child, 30)
    assert deaths and deaths[0][1].verdict is Verdict.STOPPED
    assert deaths[0][0] > POLICY.timeout_s


def test_a_silent_child_using_no_cpu_while_not_runnable_is_hung_within_the_bound():
    clock = Clock()
    child = Child(clock)
    judge = judge_for(child, clock)
    # Deadlocked while holding the GIL: another thread's GIL requests cost ~0.2 % of a core.
    child.responsive, child.state, child.cpu_share = False, "S", 0.002
    deaths = simulate(judge, clock, child, 300)
    assert len(deaths) == 1
    at, death = deaths[0]
    assert death.verdict is Verdict.HUNG
    assert POLICY.hung_s <= at <= POLICY.timeout_s + POLICY.hung_s + POLICY.interval_s
    assert "hung_timeout 60s" in death.reason and "50 MiB" in death.reason


def test_a_blocking_call_shorter_than_hung_timeout_is_tolerated():
    clock = Clock()
    child = Child(clock)
    judge = judge_for(child, clock)

    def gil_holding_sleep(t: float) -> None:
        child.responsive = not 1.0 <= t < 41.0  # 40 s asleep in C, holding the GIL

    assert simulate(judge, clock, child, 120, event=gil_holding_sleep) == []


def test_a_child_that_is_runnable_but_gets_no_cpu_is_not_hung_yet():
    clock = Clock()
    child = Child(clock)
    judge = judge_for(child, clock)
    child.responsive, child.runnable = False, True  # waiting for a CPU on an overloaded host
    assert simulate(judge, clock, child, 200) == []
    child.runnable = False  # it is no longer waiting for a CPU: it is hung
    deaths = simulate(judge, clock, child, 5)
    assert deaths and deaths[0][1].verdict is Verdict.HUNG


def test_a_child_that_exited_is_left_to_the_exit_watcher():
    clock = Clock()
    child = Child(clock)
    judge = judge_for(child, clock)
    child.responsive, child.state = False, "Z"
    assert simulate(judge, clock, child, 100) == []
    child.exists = False
    assert simulate(judge, clock, child, 100) == []


def test_without_proc_silence_past_the_timeout_is_unresponsive_but_a_late_checker_still_waits():
    clock = Clock()
    child = Child(clock)
    judge = judge_for(child, clock, proc=False)
    simulate(judge, clock, child, 2)
    child.responsive = False
    clock.t += 10.0  # late: no verdict although silent for 10 s
    r = judge.tick([Peer("c", PID, child.last_rx, POLICY)])
    assert r.late and r.deaths == []
    deaths = simulate(judge, clock, child, 30)
    assert deaths and deaths[0][1].verdict is Verdict.UNRESPONSIVE
    assert POLICY.timeout_s < deaths[0][0] <= POLICY.timeout_s + POLICY.interval_s
    assert "no /proc" in deaths[0][1].reason


def test_children_no_longer_watched_are_forgotten_and_memory_is_sampled():
    clock = Clock()
    child = Child(clock)
    judge = judge_for(child, clock)
    simulate(judge, clock, child, 2)
    assert judge.rss_bytes("c") == 50 << 20
    judge.tick([])
    assert judge.rss_bytes("c") is None


def test_exit_reports_say_what_happened():
    oom = describe_exit(-signal.SIGKILL, rss_bytes=3 << 30)
    assert "Killed(sig=9)" in oom and "out-of-memory" in oom and "3072 MiB" in oom
    ours = describe_exit(-signal.SIGKILL, killed_by_spawner=True)
    assert "Killed(sig=9)" in ours and "out-of-memory" not in ours
    assert describe_exit(3).endswith("exited with non-zero code 3")
    assert "Segfault(sig=11)" in describe_exit(-signal.SIGSEGV)


@pytest.mark.skipif(not proc_available(), reason="needs Linux /proc")
def test_the_proc_reader_sees_sleeping_stopped_and_gone_processes():
    # The child burns a measured amount of CPU before it sleeps: on an idle machine a bare
    # interpreter start can use less than one clock tick, which /proc reports as 0.
    burn = "import time; t = time.process_time(); exec('while time.process_time() - t < 0.05: pass'); print('up', flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    try:
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
        wait_for(lambda: read_proc(p.pid, False).state == "S", 20)  # type: ignore[union-attr]  # asleep in sleep()
        s = read_proc(p.pid, True)
        assert s is not None and s.runnable is False and s.rss_bytes and s.rss_bytes > 1 << 20 and s.cpu_s >= tick, s
        os.kill(p.pid, signal.SIGSTOP)
        wait_for(lambda: read_proc(p.pid, False).state == "T", 10)  # type: ignore[union-attr]
    finally:
        p.kill()
        p.wait(timeout=10)
        p.stdout.close()  # type: ignore[union-attr]
    assert read_proc(p.pid, False) is None
