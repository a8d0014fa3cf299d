"""Lifecycle with real processes: stopping actor and proc meshes, ``__cleanup__``,
``async with``, and worker processes that end with their controller (parent-death
signal, atexit shutdown).

Semantics: MONARCH_API.md §1.1 (lifecycle hooks), §1.6 (stop), §1.7.1 (stop rows).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from actormesh.actor import (
    Actor,
    Channel,
    Future,
    SupervisionError,
    endpoint,
    this_host,
)

from conftest import wait_for

T = 20  # bound of every .get()
#: "Fails at once": with no wait on T or a round trip to procs that are gone. Well under T,
#: with room for a machine busy with other work (these take milliseconds when it is idle).
AT_ONCE_S = 5.0


class Cleaned(Actor):
    """Writes what ``__cleanup__`` received into a file named after its rank."""

    def __init__(self, directory: str) -> None:
        from actormesh.actor import context

        rank = context().actor_instance.rank
        self.path = Path(directory) / f"cleanup-{rank.rank}-{os.getpid()}.txt"
        self.n = 0

    @endpoint
    def incr(self) -> int:
        self.n += 1
        return self.n

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def boom(self, msg: str) -> None:
        raise ValueError(msg)

    def __cleanup__(self, exc: BaseException | None) -> None:
        self.path.write_text("None" if exc is None else f"exc:{type(exc).__name__}:{exc}")


class AsyncCleaned(Actor):
    def __init__(self, directory: str) -> None:
        self.path = Path(directory) / f"acleanup-{os.getpid()}.txt"

    @endpoint
    async def ping(self) -> str:
        return "pong"

    async def __cleanup__(self, exc: BaseException | None) -> None:
        await asyncio.sleep(0)
        self.path.write_text("None" if exc is None else f"exc:{exc}")


class Plain(Actor):
    def __init__(self) -> None:
        self.n = 0

    @endpoint
    def incr(self) -> int:
        self.n += 1
        return self.n

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def boom(self, msg: str) -> None:
        raise ValueError(msg)


class AsyncPlain(Actor):
    @endpoint
    async def ping(self) -> str:
        return "pong"

    @endpoint
    async def boom(self, msg: str) -> None:
        raise ValueError(msg)


class Owner(Actor):
    """Owns a mesh of ``Cleaned`` actors on procs it spawned itself."""

    def __init__(self, directory: str) -> None:
        self.dir = Path(directory)
        self.kids: Any = None

    @endpoint
    def spawn_kids(self, n: int) -> list[int]:
        procs = this_host().spawn_procs(per_host={"gpus": n})
        self.kids = procs.spawn("kids", Cleaned, str(self.dir))
        return self.kids.pid.call().get(timeout=T).values()

    def __cleanup__(self, exc: BaseException | None) -> None:
        # Owned meshes are stopped (and cleaned up) before the owner's own cleanup.
        kids_done = sorted(p.name for p in self.dir.glob("cleanup-*"))
        (self.dir / "owner.txt").write_text(f"{exc is None}|{len(kids_done)}")


def _controller_round_trip() -> None:
    """A message through the controller's own loop: anything the loop queued
    before (e.g. a fault-hook delivery) has been handled once this returns."""
    port, receiver = Channel.open()
    port.send("sync")
    assert receiver.recv().get(timeout=T) == "sync"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --------------------------------------------------------------------------- stop


def test_proc_mesh_stop_returns_future_and_later_calls_fail_at_once(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 2})
    a = procs.spawn("a", Plain)
    pids = a.pid.call().get(timeout=T).values()
    fut = procs.stop()
    assert isinstance(fut, Future)
    assert fut.get(timeout=T) is None
    for pid in pids:
        wait_for(lambda pid=pid: _gone(pid), timeout=5)

    t0 = time.monotonic()
    with pytest.raises(SupervisionError, match="stopped"):
        a.incr.call().get(timeout=T)
    with pytest.raises(SupervisionError, match="stopped"):
        a.slice(gpus=1).incr.call_one().get(timeout=T)
    with pytest.raises(SupervisionError, match="stopped"):
        next(iter(a.incr.stream())).get(timeout=T)
    with pytest.raises(SupervisionError, match="stopped"):
        a.incr.choose().get(timeout=T)
    with pytest.raises(SupervisionError, match="stopped"):
        a.incr.broadcast()
    assert time.monotonic() - t0 < AT_ONCE_S

    _controller_round_trip()
    assert faults.failures == [], "stopping is not a failure"


def test_spawning_on_a_stopped_proc_mesh_fails_clearly(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    procs.spawn("a", Plain).incr.call_one().get(timeout=T)
    procs.stop().get(timeout=T)
    t0 = time.monotonic()
    with pytest.raises((SupervisionError, RuntimeError), match="stopped"):
        procs.spawn("b", Plain).incr.call_one().get(timeout=T)
    with pytest.raises((SupervisionError, RuntimeError), match="stopped"):
        procs.slice(gpus=0).spawn("c", Plain)
    assert time.monotonic() - t0 < AT_ONCE_S
    _controller_round_trip()
    assert faults.failures == []


def test_proc_mesh_stop_twice_is_harmless(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    procs.spawn("a", Plain).incr.call_one().get(timeout=T)
    procs.stop().get(timeout=T)
    assert procs.stop().get(timeout=T) is None
    assert faults.failures == []


def test_actor_mesh_stop_returns_future_calls_fail_procs_live_on(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 2})
    a = procs.spawn("a", Plain)
    assert a.incr.call().get(timeout=T).values() == [1, 1]
    fut = a.stop()
    assert isinstance(fut, Future)
    fut.get(timeout=5)  # two local actors stop in well under a second
    t0 = time.monotonic()
    with pytest.raises(SupervisionError, match="stopped"):
        a.incr.call().get(timeout=T)
    with pytest.raises(SupervisionError, match="stopped"):
        a.slice(gpus=0).incr.call_one().get(timeout=T)
    assert time.monotonic() - t0 < AT_ONCE_S
    # The procs are untouched: a new actor mesh works there.
    b = procs.spawn("b", Plain)
    assert b.incr.call().get(timeout=T).values() == [1, 1]
    _controller_round_trip()
    assert faults.failures == []


def test_call_racing_a_stop_fails_with_supervision_error_not_a_hang(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    a = procs.spawn("a", Plain)
    a.incr.call_one().get(timeout=T)
    futs = [a.incr.call_one() for _ in range(20)]
    stop = a.stop()
    late = a.incr.call_one()
    stop.get(timeout=T)
    results = []
    for f in futs:
        try:
            results.append(f.get(timeout=T))
        except SupervisionError:
            results.append("stopped")
    # In order: every call sent before the stop ran (FIFO), none after.
    assert results == list(range(2, 22))
    with pytest.raises(SupervisionError, match="stopped"):
        late.get(timeout=T)
    assert faults.failures == []


def test_cleanup_runs_with_none_on_actor_mesh_stop(spawn_procs, tmp_path, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    a = procs.spawn("a", Cleaned, str(tmp_path))
    a.incr.call().get(timeout=T)
    assert list(tmp_path.iterdir()) == []
    a.stop().get(timeout=T)
    files = sorted(tmp_path.iterdir())
    assert len(files) == 1, files
    assert files[0].read_text() == "None"
    assert faults.failures == []


def test_cleanup_runs_with_none_on_proc_mesh_stop(spawn_procs, tmp_path, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    a = procs.spawn("a", Cleaned, str(tmp_path))
    a.incr.call_one().get(timeout=T)
    procs.stop().get(timeout=T)
    files = list(tmp_path.iterdir())
    assert len(files) == 1
    assert files[0].read_text() == "None"


def test_async_cleanup_runs_with_none_on_stop(spawn_procs, tmp_path, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    a = procs.spawn("a", AsyncCleaned, str(tmp_path))
    assert a.ping.call_one().get(timeout=T) == "pong"
    a.stop().get(timeout=T)
    files = list(tmp_path.iterdir())
    assert len(files) == 1
    assert files[0].read_text() == "None"
    assert faults.failures == []


class RankInCleanup(Actor):
    """Writes ``current_rank()`` as seen inside ``__cleanup__`` to a file of its own."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    @endpoint
    def ping(self) -> int:
        return os.getpid()

    def __cleanup__(self, exc: BaseException | None) -> None:
        from actormesh.actor import current_rank

        point = current_rank()
        (self.directory / f"sync-{os.getpid()}-{point.rank}").write_text(repr(dict(point.extent)))


class AsyncRankInCleanup(RankInCleanup):
    @endpoint
    async def ping(self) -> int:
        return os.getpid()

    async def __cleanup__(self, exc: BaseException | None) -> None:
        from actormesh.actor import current_rank

        point = current_rank()
        (self.directory / f"async-{os.getpid()}-{point.rank}").write_text(repr(dict(point.extent)))


@pytest.mark.parametrize("cls", [RankInCleanup, AsyncRankInCleanup], ids=["sync", "async"])
def test_current_rank_inside_cleanup_is_the_actors_own(spawn_procs, tmp_path, faults, cls):
    procs = spawn_procs(per_host={"gpus": 2})
    a = procs.spawn("ranked", cls, str(tmp_path))
    a.ping.call().get(timeout=T)
    a.stop().get(timeout=T)
    ranks = sorted(int(f.name.rsplit("-", 1)[1]) for f in tmp_path.iterdir())
    assert ranks == [0, 1]
    assert {f.read_text() for f in tmp_path.iterdir()} == {"{'gpus': 2}"}
    assert faults.failures == []


def test_cleanup_gets_the_error_when_the_actor_fails(spawn_procs, tmp_path, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    a = procs.spawn("a", Cleaned, str(tmp_path))
    a.incr.call_one().get(timeout=T)
    a.boom.broadcast("failure for cleanup")
    faults.wait(1)
    files = wait_for(lambda: list(tmp_path.iterdir()), timeout=5)
    text = wait_for(lambda: files[0].read_text(), timeout=5)
    assert text.startswith("exc:"), text
    assert "failure for cleanup" in text


@pytest.mark.parametrize("kids", [1, 2])
def test_stopping_an_owner_stops_its_meshes_first_and_promptly(spawn_procs, tmp_path, faults, kids):
    procs = spawn_procs(per_host={"gpus": 1})
    owner = procs.spawn("owner", Owner, str(tmp_path))
    kid_pids = owner.spawn_kids.call_one(kids).get(timeout=T)
    assert len(kid_pids) == kids
    t0 = time.monotonic()
    owner.stop().get(timeout=T)
    took = time.monotonic() - t0
    assert (tmp_path / "owner.txt").read_text() == f"True|{kids}"
    assert sorted(f.read_text() for f in tmp_path.glob("cleanup-*")) == ["None"] * kids
    for pid in kid_pids:
        wait_for(lambda pid=pid: _gone(pid), timeout=5)
    assert took < 3.0, f"stopping the owner took {took:.1f}s"
    _controller_round_trip()
    assert faults.failures == []


def test_stop_on_a_mesh_reference_is_refused(spawn_procs):
    import pickle

    procs = spawn_procs(per_host={"gpus": 1})
    a = procs.spawn("a", Plain)
    a.incr.call_one().get(timeout=T)
    ref = pickle.loads(pickle.dumps(a))
    assert ref.incr.call_one().get(timeout=T) == 2
    with pytest.raises(NotImplementedError):
        ref.stop()
    proc_ref = pickle.loads(pickle.dumps(procs))
    with pytest.raises(NotImplementedError):
        proc_ref.stop()


@pytest.mark.parametrize("cls", [Plain, AsyncPlain], ids=["sync", "async"])
def test_stopping_procs_that_host_a_failed_actor_is_prompt(spawn_procs, faults, cls):
    """A failed actor must not hold its proc hostage until ``stop_timeout`` (10 s)."""
    procs = spawn_procs(per_host={"gpus": 1})
    a = procs.spawn("a", cls)
    a.boom.broadcast("fail me")
    faults.wait(1)
    t0 = time.monotonic()
    procs.stop().get(timeout=T)
    took = time.monotonic() - t0
    assert took < 3.0, f"stopping a proc with a failed actor took {took:.1f}s"


def test_async_with_proc_mesh_stops_it(spawn_procs, faults):
    async def main() -> tuple[Any, list[int]]:
        async with spawn_procs(per_host={"gpus": 2}) as procs:
            a = procs.spawn("a", Plain)
            vm = await a.pid.call()
            assert await a.slice(gpus=0).incr.call_one() == 1
            return a, vm.values()

    a, pids = asyncio.run(main())
    for pid in pids:
        wait_for(lambda pid=pid: _gone(pid), timeout=5)
    with pytest.raises(SupervisionError, match="stopped"):
        a.incr.call().get(timeout=T)
    assert faults.failures == []


def test_async_with_proc_mesh_stops_it_on_exception(spawn_procs, faults):
    pids: list[int] = []

    async def main() -> None:
        async with spawn_procs(per_host={"gpus": 1}) as procs:
            a = procs.spawn("a", Plain)
            pids.append(await a.pid.call_one())
            raise KeyError("leave the block")

    with pytest.raises(KeyError):
        asyncio.run(main())
    assert len(pids) == 1
    wait_for(lambda: _gone(pids[0]), timeout=5)
    assert faults.failures == []


# --------------------------------------------------------------------------- children die with the controller


CONTROLLER = textwrap.dedent(
    """
    import os, sys
    from actormesh.actor import Actor, endpoint, this_host

    class P(Actor):
        @endpoint
        def pid(self):
            return os.getpid()

        @endpoint
        def grandkids(self):
            # Procs owned by this actor, children of the worker process.
            self.kids = this_host().spawn_procs(per_host={"g": 1}).spawn("k", P)
            return self.kids.pid.call().get(timeout=30).values()

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    a = procs.spawn("p", P)
    pids = a.pid.call().get(timeout=30).values()
    if sys.argv[2] == "nested":
        pids += [p for v in a.grandkids.call().get(timeout=30).values() for p in v]
    print(" ".join(str(p) for p in pids), flush=True)
    if sys.argv[1] == "block":
        sys.stdin.read()  # until the test kills us
    """
)


def _start_controller(tmp_path: Path, mode: str, nested: str) -> subprocess.Popen[str]:
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    return subprocess.Popen(
        [sys.executable, str(script), mode, nested],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(tmp_path),
    )


def _read_pids(proc: subprocess.Popen[str], count: int) -> list[int]:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded by the test timeout; the script prints or exits
    pids = [int(x) for x in line.split()]
    if len(pids) != count:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"controller did not print {count} worker pids: {line!r}\n{err}")
    return pids


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.mark.parametrize("nested", ["flat", "nested"])
def test_workers_die_when_the_controller_is_sigkilled(tmp_path, nested):
    proc = _start_controller(tmp_path, "block", nested)
    pids: list[int] = []
    try:
        pids = _read_pids(proc, 2 if nested == "flat" else 4)
        for pid in pids[:2]:  # the controller's procs, forked by its zygote
            assert psutil.Process(psutil.Process(pid).ppid()).ppid() == proc.pid
        for pid in pids[2:]:  # procs spawned by those, forked by their own zygotes
            assert psutil.Process(psutil.Process(pid).ppid()).ppid() in pids[:2]
        proc.kill()
        proc.wait(timeout=10)
        for pid in pids:
            wait_for(lambda pid=pid: _gone(pid), timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
        _kill_leftovers(pids)


@pytest.mark.parametrize("nested", ["flat", "nested"])
def test_controller_that_just_ends_exits_cleanly_and_leaves_no_workers(tmp_path, nested):
    proc = _start_controller(tmp_path, "end", nested)
    pids: list[int] = []
    try:
        pids = _read_pids(proc, 2 if nested == "flat" else 4)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=15)
        took = time.monotonic() - t0
        assert proc.returncode == 0, err
        assert took < 5.0, f"controller took {took:.1f}s to exit"
        assert "Traceback" not in err, err
        for pid in pids:
            wait_for(lambda pid=pid: _gone(pid), timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
        _kill_leftovers(pids)
