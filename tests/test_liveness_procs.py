"""Liveness with real processes: a busy proc is never killed, a stopped one is
declared dead (as stopped), a frozen controller kills nobody, an exit says what
happened. The rules themselves are tested in virtual time in test_liveness.py."""

from __future__ import annotations

import ctypes
import math
import os
import re
import signal
import time

import pytest
from conftest import wait_for

from actormesh.actor import Actor, SupervisionError, endpoint
from actormesh.config import configured

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="the liveness judge needs Linux /proc")

# Short settings keep these tests fast: silence past 1 s makes the spawner look.
FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}


def hold_gil_computing(at_least_s: float) -> float:
    """Spend at least ``at_least_s`` inside one C call that holds the GIL and
    burns CPU (a catastrophically backtracking regex); return its longest call."""
    pattern = re.compile(r"(a|aa)+$")  # tries every split of n into 1s and 2s: Fibonacci(n) paths
    growth = (1 + 5**0.5) / 2  # each extra character multiplies the time by this
    n, took = 20, 0.0
    while took < 0.05:  # calibrate on this machine, now
        n += 1
        t = time.perf_counter()
        pattern.match("a" * n + "b")
        took = time.perf_counter() - t
    n += max(0, math.ceil(math.log(1.2 * at_least_s / took, growth)))
    longest = 0.0
    while longest < at_least_s:
        t = time.perf_counter()
        pattern.match("a" * n + "b")
        longest = max(longest, time.perf_counter() - t)
        n += 1
    return longest


class Holder(Actor):
    """Keeps state across a long GIL-holding call."""

    def __init__(self) -> None:
        self.items: list[int] = []

    @endpoint
    def add(self, x: int) -> int:
        self.items.append(x)
        return os.getpid()

    @endpoint
    def items_now(self) -> list[int]:
        return list(self.items)

    @endpoint
    def compute(self, at_least_s: float) -> float:
        return hold_gil_computing(at_least_s)

    @endpoint
    def sleep_holding_gil(self, seconds: int) -> int:
        # ctypes.PyDLL keeps the GIL during the call (CDLL would release it).
        return ctypes.PyDLL(None).sleep(seconds)

    @endpoint
    def grow(self, mib: int) -> int:
        self.ballast = bytearray(mib << 20)
        for i in range(0, len(self.ballast), 4096):
            self.ballast[i] = 1  # touch every page: resident, not just reserved
        return os.getpid()

    @endpoint
    def wait(self, seconds: float) -> None:
        time.sleep(seconds)


def test_a_proc_inside_one_long_gil_holding_computation_survives_with_its_state(spawn_procs, faults):
    with configured(**FAST):
        procs = spawn_procs(per_host={"gpus": 1})
    h = procs.spawn("h", Holder)
    pid = h.add.call_one(1).get(timeout=30)
    held = h.compute.call_one(2.5).get(timeout=120)
    assert held >= 2.5 * FAST["heartbeat_timeout"]  # silent for more than two timeouts
    assert h.add.call_one(2).get(timeout=30) == pid
    assert h.items_now.call_one().get(timeout=30) == [1, 2]
    assert faults.failures == []


def test_a_proc_inside_a_gil_holding_blocking_call_shorter_than_hung_timeout_survives(spawn_procs, faults):
    with configured(**FAST):
        procs = spawn_procs(per_host={"gpus": 1})
    h = procs.spawn("h", Holder)
    pid = h.add.call_one(1).get(timeout=30)
    assert h.sleep_holding_gil.call_one(3).get(timeout=60) == 0  # no CPU, not runnable, silent 3 timeouts
    assert h.add.call_one(2).get(timeout=30) == pid
    assert h.items_now.call_one().get(timeout=30) == [1, 2]
    assert faults.failures == []


def test_a_proc_blocked_past_hung_timeout_is_declared_hung(spawn_procs, faults):
    with configured(**FAST, hung_timeout=1.5):
        procs = spawn_procs(per_host={"gpus": 1})
    h = procs.spawn("h", Holder)
    h.add.call_one(1).get(timeout=30)
    with pytest.raises(SupervisionError, match=r"hung: silent for .* using no CPU .*hung_timeout 1.5s"):
        h.sleep_holding_gil.call_one(120).get(timeout=60)
    assert "hung" in faults.wait(1)[0].report()


def test_a_stopped_proc_is_declared_dead_as_stopped(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})  # the default settings: declared within 5 s
    h = procs.spawn("h", Holder)
    pid = h.add.call_one(1).get(timeout=30)
    fut = h.wait.call_one(30.0)  # in flight when the proc is stopped
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(SupervisionError, match=r"was stopped \(state T: SIGSTOP"):
        fut.get(timeout=30)
    print(f"SIGSTOPped proc declared dead after {time.monotonic() - t0:.2f}s")
    assert "SIGSTOP" in faults.wait(1)[0].report()
    with pytest.raises(SupervisionError, match="SIGSTOP"):
        h.add.call_one(2).get(timeout=30)  # later calls fail at once with the same cause


def test_a_controller_whose_loop_could_not_run_kills_no_worker(spawn_procs, faults):
    with configured(**FAST):
        procs = spawn_procs(per_host={"gpus": 2})
    h = procs.spawn("h", Holder)
    pids = h.add.call(1).get(timeout=30).values()
    in_flight = h.slice(gpus=0).wait.call_one(0.5)
    # The controller's main thread holds the GIL for 3 timeouts: its I/O loop
    # (and so its liveness checker) cannot run; nothing arrives meanwhile.
    ctypes.PyDLL(None).sleep(3)
    assert in_flight.get(timeout=30) is None
    assert h.add.call(2).get(timeout=30).values() == pids
    assert faults.failures == []


FROZEN_CONTROLLER = """
import os, sys
from actormesh.actor import Actor, endpoint, this_host
import actormesh.actor as am
from actormesh.config import configure

class Pid(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

failures = []
am.unhandled_fault_hook = failures.append
configure(heartbeat_interval=0.2, heartbeat_timeout=1.0)
procs = this_host().spawn_procs(per_host={"gpus": 2})
w = procs.spawn("w", Pid)
print("pids", sorted(w.pid.call().get(timeout=60).values()), flush=True)
sys.stdin.readline()  # frozen and resumed meanwhile
print("pids", sorted(w.pid.call().get(timeout=30).values()), "failures", len(failures), flush=True)
procs.stop().get(timeout=30)
"""


def test_a_controller_frozen_and_resumed_kills_no_worker(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "controller.py"
    script.write_text(FROZEN_CONTROLLER)
    p = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = p.stdout.readline()
        assert before.startswith("pids"), before
        os.kill(p.pid, signal.SIGSTOP)  # Ctrl-Z, a debugger, a paused VM
        time.sleep(3.0)  # the freeze itself (three heartbeat timeouts), not a wait for anything
        os.kill(p.pid, signal.SIGCONT)
        p.stdin.write("go\n")
        p.stdin.flush()
        after = p.stdout.readline()
        assert after == f"{before.strip()} failures 0\n"  # the same workers, nothing failed
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)  # never leave it stopped, whatever failed
        p.kill()
        p.wait(timeout=30)
        p.stdin.close()
        p.stdout.close()


def test_a_proc_killed_by_someone_else_is_reported_with_its_signal_and_memory(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    h = procs.spawn("h", Holder)
    pid = h.grow.call_one(200).get(timeout=60)
    (child,) = procs._state.children
    wait_for(lambda: (getattr(child, "rss_bytes", None) or 0) >= 200 << 20, 15)  # the spawner has seen it grow
    fut = h.wait.call_one(30.0)
    os.kill(pid, signal.SIGKILL)  # what the kernel's out-of-memory killer does
    with pytest.raises(SupervisionError) as ei:
        fut.get(timeout=30)
    text = str(ei.value)
    assert "Killed(sig=9)" in text and "out-of-memory killer" in text, text
    assert re.search(r"resident memory was 2\d\d MiB", text), text
    faults.wait(1)


@pytest.fixture
def agent(tmp_path):
    """One host agent on this machine (as on another host), with short liveness settings."""
    import subprocess
    import sys

    from actormesh.runtime import current_runtime

    secret = tmp_path / "secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, current_runtime().secret.hex().encode())
    os.close(fd)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    env.update({f"ACTORMESH_{k.upper()}": str(v) for k, v in FAST.items()})  # the agent judges by its own settings
    p = subprocess.Popen(
        [sys.executable, "-m", "actormesh.host", "--address", f"unix:{tmp_path}/agent.sock", "--secret-file", str(secret), "--print-address"],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    try:
        yield p.stdout.readline().strip()
    finally:
        p.terminate()
        p.wait(timeout=20)


def test_a_host_agent_keeps_its_busy_proc_and_reports_its_stopped_one(agent, faults):
    from actormesh.mesh import HostMesh

    procs = HostMesh(agents=[agent]).spawn_procs(per_host={"gpus": 2})
    try:
        h = procs.spawn("h", Holder)
        pids = h.add.call(1).get(timeout=30).values()
        busy, victim = h.slice(gpus=0), h.slice(gpus=1)
        assert busy.compute.call_one(2.5).get(timeout=120) >= 2.5 * FAST["heartbeat_timeout"]
        assert busy.items_now.call_one().get(timeout=30) == [1]
        fut = victim.wait.call_one(30.0)
        os.kill(pids[1], signal.SIGSTOP)
        with pytest.raises(SupervisionError, match=r"was stopped \(state T: SIGSTOP"):
            fut.get(timeout=30)  # the agent's verdict reaches the controller as the cause
        assert busy.add.call_one(2).get(timeout=30) == pids[0]
        faults.wait(1)
    finally:
        procs.stop().get(timeout=30)
