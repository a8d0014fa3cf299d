"""Supervision order and deliberate teardown, with real processes.

The owner hears of a failure no later than the callers whose futures fail for
the same cause, so a program that installs ``unhandled_fault_hook`` around a
call, sees the call's error and restores the previous hook gets the failure in
the hook it installed. A deliberate teardown (``job.kill()``) is not a failure.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest

import actormesh.actor as am
from actormesh.actor import Actor, SupervisionError, endpoint
from actormesh.job import ProcessJob
from actormesh.runtime import current_runtime

from conftest import FaultRecorder, wait_for

T = 30  # bound of every .get()


class Sleeper(Actor):
    def __init__(self) -> None:
        self.release = threading.Event()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def block(self) -> None:
        self.release.wait(120)

    @endpoint
    def where(self) -> str:
        return current_runtime().address


def _settle_supervision() -> None:
    """Wait until every fault-hook thread started so far has returned (a barrier
    through the loop thread first, so that the hooks it is starting are started)."""

    async def noop() -> None:
        return None

    current_runtime().loop_thread.run(noop(), timeout=10)
    for t in threading.enumerate():
        if t.name == "actormesh-fault-hook":
            t.join(10)
            assert not t.is_alive(), "a fault hook did not return"


@pytest.mark.timeout(120)
def test_a_hook_installed_around_a_call_gets_the_failure_that_failed_the_call(spawn_procs, monkeypatch, faults):
    # Several rounds: each kills one member with a call in flight.
    rounds = 3
    procs = spawn_procs(per_host={"gpus": rounds})
    mesh = procs.spawn("sleepers", Sleeper)
    pids = mesh.pid.call().get(timeout=T).values()
    restored = FaultRecorder()  # stands in for the default hook, which would end the program
    for i in range(rounds):
        around = FaultRecorder()
        monkeypatch.setattr(am, "unhandled_fault_hook", around)
        pending = mesh.slice(gpus=i).block.call_one()
        os.kill(pids[i], signal.SIGKILL)
        with pytest.raises(SupervisionError):
            pending.get(timeout=T)
        monkeypatch.setattr(am, "unhandled_fault_hook", restored)  # the program restores the hook
        (failure,) = around.wait(1, timeout=10)
        assert failure.crashed_ranks == [i]
        _settle_supervision()
        assert restored.failures == [], f"round {i}: the restored hook got the failure that failed the call"
    assert faults.failures == []


@pytest.mark.timeout(120)
def test_job_kill_is_not_reported_as_a_failure(faults):
    job = ProcessJob({"hosts": 1})
    try:
        state = job.state()
        procs = state.hosts.spawn_procs(per_host={"gpus": 2})
        mesh = procs.spawn("s", Sleeper)
        addresses = mesh.where.call().get(timeout=T).values()
        in_flight = mesh.slice(gpus=0).block.call_one()
        job.kill()
        with pytest.raises(SupervisionError):
            in_flight.get(timeout=T)
        rt = current_runtime()
        wait_for(lambda: all(a in rt._dead for a in addresses), timeout=20)
        _settle_supervision()
        assert faults.failures == []
        # The meshes on those hosts are stopped, and say so at once.
        with pytest.raises(SupervisionError, match="job was killed"):
            mesh.where.call().get(timeout=T)
    finally:
        job.kill()
