"""Recovering from failures: restart policies and rebuilding in __supervise__."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from actormesh.actor import Actor, MeshFailure, SupervisionError, endpoint, this_host

from conftest import wait_for


class DataLoader(Actor):
    """Yields batch numbers; a fresh incarnation starts where it is told to."""

    def __init__(self) -> None:
        self.served = 0

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def batch(self, step: int) -> list[int]:
        self.served += 1
        return [step] * 4


def test_killed_dataloader_is_replaced_and_the_run_completes(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    loader = procs.spawn("loader", DataLoader).restart_policy(max_restarts=2, within_s=60)
    first_pid = loader.pid.call_one().get(timeout=30)
    steps, retries, step = [], 0, 0
    while step < 30:
        if step == 10 and retries == 0:
            os.kill(loader.pid.call_one().get(timeout=10), signal.SIGKILL)
        try:
            batch = loader.batch.call_one(step).get(timeout=15)
        except SupervisionError:
            retries += 1  # the call in flight when it died: at most once, so retry
            assert retries < 50
            continue
        steps.append(batch[0])
        step += 1
    assert steps == list(range(30))
    assert loader.pid.call_one().get(timeout=10) != first_pid
    assert faults.failures == []  # handled by the restart, not escalated


def test_restart_intensity_exceeded_escalates(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    loader = procs.spawn("loader", DataLoader).restart_policy(max_restarts=1, within_s=60)
    first = loader.pid.call_one().get(timeout=30)
    os.kill(first, signal.SIGKILL)  # restart 1 of 1: allowed
    second = wait_for(lambda: _pid_or_none(loader) not in (None, first) and _pid_or_none(loader), 20)
    os.kill(second, signal.SIGKILL)  # one more inside the window: escalated to the owner
    failure = faults.wait(1, timeout=20)[0]
    assert "Killed(sig=9)" in failure.report()
    with pytest.raises(SupervisionError):
        loader.pid.call_one().get(timeout=10)


def _pid_or_none(mesh):
    try:
        return mesh.pid.call_one().get(timeout=10)
    except SupervisionError:
        return None


class Trainer(Actor):
    """Owns its data loader and rebuilds it from scratch when it dies."""

    def __init__(self) -> None:
        self.rebuilds = 0
        self._spawn_loader()

    def _spawn_loader(self) -> None:
        self.procs = this_host().spawn_procs(per_host={"gpus": 1})
        self.loader = self.procs.spawn("loader", DataLoader)

    def __supervise__(self, failure: MeshFailure) -> bool:
        if failure.mesh_name != self.loader._mesh_name:
            return False
        self.rebuilds += 1
        self._spawn_loader()  # the documented pattern: spawn a replacement, keep going
        return True

    @endpoint
    def loader_pid(self) -> int:
        return self.loader.pid.call_one().get(timeout=20)

    @endpoint
    def train(self, steps: int) -> list[int]:
        done = []
        while len(done) < steps:
            try:
                done.append(self.loader.batch.call_one(len(done)).get(timeout=20)[0])
            except SupervisionError:
                continue
        return done

    @endpoint
    def rebuild_count(self) -> int:
        return self.rebuilds


def test_supervise_rebuilds_a_failed_mesh(spawn_procs, faults):
    procs = spawn_procs(per_host={"trainer": 1})
    trainer = procs.spawn("trainer", Trainer)
    pid = trainer.loader_pid.call_one().get(timeout=30)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: trainer.rebuild_count.call_one().get(timeout=10) == 1, 20)
    assert trainer.train.call_one(5).get(timeout=30) == [0, 1, 2, 3, 4]
    assert trainer.loader_pid.call_one().get(timeout=20) != pid
    assert faults.failures == []


_CONTROLLER = textwrap.dedent(
    """
    import os, sys, signal
    from actormesh.actor import Actor, endpoint, this_host

    class P(Actor):
        @endpoint
        def pid(self):
            return os.getpid()

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    pids = procs.spawn("p", P).pid.call().get(timeout=30).values()
    print(" ".join(map(str, pids)), flush=True)
    mode = sys.argv[1]
    if mode == "raise":
        raise RuntimeError("controller crashed")
    if mode == "wait":
        sys.stdin.read()
    """
)


@pytest.mark.parametrize("mode", ["exit", "raise", "sigterm", "sigkill"])
def test_controller_exit_leaves_no_orphans(tmp_path, mode):
    script = tmp_path / "controller.py"
    script.write_text(_CONTROLLER)
    arg = "wait" if mode in ("sigterm", "sigkill") else mode
    proc = subprocess.Popen([sys.executable, str(script), arg], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, proc.stderr.read()
        if mode == "sigterm":
            proc.send_signal(signal.SIGTERM)
        elif mode == "sigkill":
            proc.kill()
        proc.wait(timeout=30)
        if mode == "exit":
            assert proc.returncode == 0
        wait_for(lambda: not any(_alive(p) for p in pids), 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
