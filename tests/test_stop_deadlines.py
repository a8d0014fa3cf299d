"""Every stop has a deadline (docs/supervision.md, "Deadlines"), with real processes.

An actor told to stop has ``cleanup_timeout`` to end; its owner waits
``STOP_MARGIN_S`` more and then kills the proc. A failing actor reports to its
owner before its ``__cleanup__`` runs, and ``initialized`` raises when an
``__init__`` raised. The bounds below are generous multiples of the configured
deadlines (the machine is shared), but far below what the old code took:
forever for a stuck endpoint or cleanup, and the full hang for the failure report.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from actormesh import config
from actormesh.actor import Actor, ActorError, SupervisionError, endpoint
from actormesh.runtime import STOP_MARGIN_S

from conftest import wait_for

T = 30  # bound of every .get() that should succeed
CLEANUP_S = 0.5  # cleanup_timeout for these tests
#: What a stop may take here: the deadline, plus the owner's margin, plus slack for a loaded machine.
STOP_BOUND_S = CLEANUP_S + STOP_MARGIN_S + 2.5
FOREVER_S = 120  # what a stuck actor waits for: far past every bound


@pytest.fixture
def quick_cleanup() -> Any:
    """cleanup_timeout=CLEANUP_S for the procs spawned inside the test (and the owner)."""
    with config.configured(cleanup_timeout=CLEANUP_S):
        yield


class Stuck(Actor):
    """Sync actor whose endpoint blocks (for good, unless released)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def block(self) -> None:
        self.release.wait(FOREVER_S)


class AsyncStuck(Actor):
    """Async actor whose endpoint never yields back: awaits forever, or spins."""

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def wait_forever(self) -> None:
        await asyncio.Event().wait()

    @endpoint
    async def spin(self) -> None:
        end = time.monotonic() + FOREVER_S
        while time.monotonic() < end:  # a busy coroutine: never awaits
            pass


class HangingCleanup(Actor):
    """A sync actor whose ``__cleanup__`` never returns (it notes that it began)."""

    def __init__(self, directory: str) -> None:
        self.marker = Path(directory) / f"cleanup-began-{os.getpid()}"

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def boom(self) -> None:
        raise ValueError("broadcast failure with a hanging cleanup")

    def __cleanup__(self, exc: BaseException | None) -> None:
        self.marker.write_text(repr(exc))
        threading.Event().wait(FOREVER_S)


class FailsOnRankOne(Actor):
    def __init__(self) -> None:
        from actormesh.actor import context

        if dict(context().actor_instance.rank) == {"gpus": 1}:
            raise KeyError("no config for rank 1")

    @endpoint
    def ping(self) -> str:
        return "pong"


def _timed_stop(mesh: Any) -> float:
    t0 = time.monotonic()
    mesh.stop().get(timeout=FOREVER_S / 2)
    return time.monotonic() - t0


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(90)
def test_actor_mesh_stop_returns_in_bound_when_a_sync_endpoint_blocks_forever(spawn_procs, quick_cleanup, faults):
    procs = spawn_procs(per_host={"gpus": 2})
    stuck = procs.spawn("stuck", Stuck)
    pids = stuck.pid.call().get(timeout=T).values()
    blocked = stuck.slice(gpus=0).block.call_one()  # the actor's thread never comes back
    took = _timed_stop(stuck)
    assert took < STOP_BOUND_S, f"stop took {took:.1f}s"
    # The stuck member's proc was killed (an actor thread cannot be interrupted); the call
    # in flight fails, the healthy member's proc lives on, and nothing reached supervision.
    wait_for(lambda: _dead(pids[0]), timeout=10)
    with pytest.raises(SupervisionError):
        blocked.get(timeout=T)
    assert not _dead(pids[1])
    with pytest.raises(SupervisionError, match="stopped") as ei:
        stuck.pid.call().get(timeout=T)
    assert "did not stop within" in str(ei.value) and "proc killed" in str(ei.value)  # the stop's outcome
    assert faults.failures == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["wait_forever", "spin"])
def test_actor_mesh_stop_returns_in_bound_when_an_async_endpoint_never_yields(spawn_procs, quick_cleanup, faults, how):
    procs = spawn_procs(per_host={"gpus": 1})
    stuck = procs.spawn("astuck", AsyncStuck)
    (pid,) = stuck.pid.call().get(timeout=T).values()
    getattr(stuck, how).broadcast()
    took = _timed_stop(stuck)
    assert took < STOP_BOUND_S, f"stop took {took:.1f}s"
    wait_for(lambda: _dead(pid), timeout=10)
    assert faults.failures == []


@pytest.mark.timeout(90)
def test_actor_mesh_stop_returns_in_bound_when_a_sync_cleanup_hangs(spawn_procs, quick_cleanup, tmp_path, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    mesh = procs.spawn("hang", HangingCleanup, str(tmp_path))
    (pid,) = mesh.pid.call().get(timeout=T).values()
    took = _timed_stop(mesh)
    assert took < STOP_BOUND_S, f"stop took {took:.1f}s"
    assert (tmp_path / f"cleanup-began-{pid}").read_text() == "None"
    # The cleanup was abandoned at its deadline: the proc itself is fine.
    assert not _dead(pid)
    assert faults.failures == []


@pytest.mark.timeout(90)
def test_proc_mesh_stop_returns_in_bound_when_a_sync_endpoint_blocks_forever(spawn_procs, quick_cleanup, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    stuck = procs.spawn("stuck", Stuck)
    stuck.block.broadcast()
    t0 = time.monotonic()
    procs.stop().get(timeout=FOREVER_S / 2)
    took = time.monotonic() - t0
    # The proc gives its actors one shared deadline, well before stop_timeout (10 s).
    assert took < STOP_BOUND_S + 2, f"proc mesh stop took {took:.1f}s"
    assert faults.failures == []


@pytest.mark.timeout(90)
def test_a_failing_actor_with_a_hanging_cleanup_reports_to_its_owner_first(spawn_procs, quick_cleanup, tmp_path, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    mesh = procs.spawn("hang", HangingCleanup, str(tmp_path))
    (pid,) = mesh.pid.call().get(timeout=T).values()
    mesh.boom.broadcast()
    (failure,) = faults.wait(1, timeout=10)
    assert "broadcast failure with a hanging cleanup" in failure.report()
    # Its cleanup still ran (after the report), and hangs: nobody waits on it.
    marker = tmp_path / f"cleanup-began-{pid}"
    # The file exists before its text is written: wait for the text, not the file.
    wait_for(lambda: marker.exists() and "broadcast failure with a hanging cleanup" in marker.read_text(), timeout=10)


@pytest.mark.timeout(90)
def test_initialized_raises_when_init_raised_on_one_member(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 2})
    mesh = procs.spawn("half", FailsOnRankOne)
    with pytest.raises(ActorError) as ei:
        mesh.initialized.get(timeout=T)
    assert isinstance(ei.value, KeyError), type(ei.value).__mro__
    assert "no config for rank 1" in str(ei.value)
    assert "'gpus': 1" in str(ei.value)  # names the member
    # The owner heard first, and the healthy member serves.
    (failure,) = faults.wait(1, timeout=10)
    assert failure.crashed_ranks == [1]
    assert mesh.slice(gpus=0).ping.call_one().get(timeout=T) == "pong"


@pytest.mark.timeout(90)
def test_initialized_still_succeeds_when_every_init_does(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 2})
    mesh = procs.spawn("fine", Stuck)
    mesh.initialized.get(timeout=T)
    assert faults.failures == []
