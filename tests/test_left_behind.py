"""Nothing is left behind: no file, directory, process, descriptor or table entry.

Real processes: 50 spawn/stop cycles of a one-proc mesh in this controller,
then separate controller runs (scripts in subprocesses) that exit cleanly,
run a ProcessJob, or are SIGKILLed (the next run sweeps what those leave).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

import psutil
import pytest

import actormesh.runtime._peers as peers_module
import actormesh.runtime._proc as proc_module
from actormesh.actor import Actor, endpoint, this_host
from actormesh.runtime import current_runtime
from conftest import wait_for

T = 60
SRC = os.path.dirname(os.path.dirname(os.path.abspath(proc_module.__file__)))


class Small(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _cycles(count: int) -> list[int]:
    """``count`` one-proc meshes spawned, called and stopped, side by side (fewer cores idle)."""
    meshes = [this_host().spawn_procs(per_host={"gpus": 1}) for _ in range(count)]
    calls = [pm.spawn("small", Small).pid.call_one() for pm in meshes]
    pids = [c.get(timeout=T) for c in calls]
    for stopped in [pm.stop() for pm in meshes]:
        stopped.get(timeout=T)
    return pids


def _snapshot(rt: Any) -> dict[str, Any]:
    sizes = rt.table_sizes()
    sizes.pop("tombstones")  # bounded, not baseline: checked on its own
    return {
        "tables": sizes,
        "fds": set(os.listdir("/proc/self/fd")),
        "threads": {t.ident for t in threading.enumerate()},
        "files": sorted(os.listdir(rt.job_dir)),
        "children": len([p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]),
    }


def _left_behind(before: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """What ``now`` holds beyond ``before`` (something of an earlier test may end meanwhile)."""
    extra = {key: now[key] - before[key] for key in ("fds", "threads") if now[key] - before[key]}
    extra.update({key: (before[key], now[key]) for key in ("tables", "files") if now[key] != before[key]})
    if now["children"] > before["children"]:
        extra["children"] = (before["children"], now["children"])
    return extra


@pytest.mark.timeout(180)  # ~20 s on a lightly loaded 2-core machine (0.4 s a cycle); 70 s with 5 helpers sharing it
def test_fifty_spawn_stop_cycles_leave_nothing_behind(monkeypatch):
    monkeypatch.setattr(peers_module, "MAX_TOMBSTONES", 8)  # the tombstone bound lives with peer loss
    rt = current_runtime()
    _cycles(1)  # warm up what starts once (heartbeat, thread pools)
    me = psutil.Process()
    # What stays: the zygote (it starts once, like the heartbeat), zombies.
    wait_for(lambda: all(p.status() == psutil.STATUS_ZOMBIE or (p.ppid() == me.pid and "actormesh.zygote" in p.cmdline())
                         for p in me.children(recursive=True)), timeout=T)
    before = _snapshot(rt)
    pids = [pid for _ in range(10) for pid in _cycles(5)]
    assert len(set(pids)) == 50
    try:
        wait_for(lambda: not _left_behind(before, _snapshot(rt)), timeout=T)
    except AssertionError:
        assert _left_behind(before, _snapshot(rt)) == {}  # shows what is left
    assert rt.table_sizes()["tombstones"] <= 8
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_a_sigkilled_procs_socket_file_and_table_entries_go(faults):
    rt = current_runtime()
    _cycles(1)
    before = _snapshot(rt)
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    small = pm.spawn("small", Small)
    pid = small.pid.call_one().get(timeout=T)
    path = small._addresses[0][len("unix:"):]
    assert os.path.exists(path)
    os.kill(pid, signal.SIGKILL)
    faults.wait(1, timeout=T)  # the owner heard of it
    wait_for(lambda: not _left_behind(before, _snapshot(rt)), timeout=T)
    assert not os.path.exists(path)  # it could not remove its socket; its spawner did
    pm.stop().get(timeout=T)


def test_a_message_to_a_pruned_dead_proc_fails_fast():
    rt = current_runtime()
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    small = pm.spawn("small", Small)
    small.pid.call_one().get(timeout=T)
    address = small._addresses[0]
    pm.stop().get(timeout=T)
    wait_for(lambda: rt.peer_dead(address), timeout=T)
    assert address not in rt._routes  # pruned, remembered as a tombstone only
    port_fut = _call_raw(rt, address)
    with pytest.raises(Exception) as info:
        port_fut.get(timeout=5)  # fails at once: no dial, no wait
    assert "stopped" in str(info.value)


def _call_raw(rt: Any, address: str) -> Any:
    from actormesh.runtime._ports import OnePort

    port = OnePort(rt, "small.pid", address)
    rt.call_actor(address, "small", "pid", (rt.address, port.port_id), 0, (), (), [b""])
    return port.future


# -- separate controller runs --------------------------------------------------------------------

_RUN = r"""
import json, os, sys
from actormesh.actor import Actor, endpoint, this_host
from actormesh.runtime import current_runtime

class Small(Actor):
    @endpoint
    def pid(self):
        return os.getpid()

mode = sys.argv[1]
rt = current_runtime()
out = {"job_dir": rt.job_dir, "controller": os.getpid(), "pids": []}
if mode == "processjob":
    from actormesh.job import ProcessJob
    job = ProcessJob({"hosts": 1})
    pm = job.state().hosts.spawn_procs(per_host={"gpus": 1})
    out["pids"].append(pm.spawn("small", Small).pid.call_one().get(timeout=60))
    out["pids"].extend(job._pids)
    out["job_files"] = os.listdir(os.path.join(rt.job_dir, f"job-{job._uid}"))
    pm.stop().get(timeout=60)
    job.kill()
else:
    pm = this_host().spawn_procs(per_host={"gpus": 1})
    out["pids"].append(pm.spawn("small", Small).pid.call_one().get(timeout=60))
if mode == "killed":
    from actormesh.job._controller import write_secret_file
    out["secret"] = write_secret_file(os.path.join(rt.job_dir, "job-killed"), rt.secret)
print(json.dumps(out), flush=True)
if mode == "killed":
    sys.stdin.read()  # wait to be SIGKILLed
"""


def _start(mode: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-c", _RUN, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _owned_dirs(pids: set[int]) -> list[str]:
    """Job directories in the temp dir whose owner file names one of ``pids``."""
    found = []
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if name.startswith("actormesh-"):
            try:
                with open(os.path.join(root, name, "owner")) as f:
                    if int(f.read().split()[0]) in pids:
                        found.append(name)
            except (OSError, ValueError, IndexError):
                pass
    return found


def _run(mode: str) -> dict[str, Any]:
    p = _start(mode)
    try:
        line = p.stdout.readline()  # type: ignore[union-attr]
        p.stdin.close()  # type: ignore[union-attr]
        assert p.wait(timeout=T) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return json.loads(line)


@pytest.mark.parametrize("mode", ["plain", "plain", "plain", "plain", "processjob"])
def test_a_controller_run_leaves_nothing_behind(mode):
    out = _run(mode)
    if mode == "processjob":
        assert any(f.startswith("agent-") for f in out["job_files"])  # the log existed while it ran
    pids = set(out["pids"]) | {out["controller"]}
    wait_for(lambda: not any(_alive(p) for p in out["pids"]), timeout=T)
    assert not os.path.exists(out["job_dir"]), os.listdir(out["job_dir"])
    assert _owned_dirs(pids) == []  # nor an agent's or a proc's own directory


def test_a_killed_controllers_directory_and_secret_are_swept_by_the_next_run():
    p = _start("killed")
    try:
        out = json.loads(p.stdout.readline())  # type: ignore[union-attr]
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=T)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    p.stdin.close()  # type: ignore[union-attr]
    p.stdout.close()  # type: ignore[union-attr]
    wait_for(lambda: not any(_alive(pid) for pid in out["pids"]), timeout=T)  # its proc died with it
    assert os.path.exists(out["secret"])  # what a SIGKILL leaves...
    _run("plain")
    assert not os.path.exists(out["job_dir"])  # ...the next run removes


def test_the_sweep_removes_only_directories_it_can_prove_are_ours_and_dead(tmp_path):
    from actormesh.runtime import _jobdir

    ns, boot = _jobdir._identity()  # type: ignore[misc]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = os.getppid()
    started = _jobdir._start_time(alive)

    def make(name: str, owner: str | None, mode: int = 0o700) -> str:
        path = tmp_path / f"actormesh-{name}"
        path.mkdir()
        if owner is not None:
            (path / "owner").write_text(owner)
        path.chmod(mode)
        return str(path)

    stale = [
        make("dead", f"{dead.pid} 12345 {ns} {boot}\n"),
        make("pid-reused", f"{alive} 1{started} {ns} {boot}\n"),  # that pid is another process now
    ]
    keep = [
        make("alive", f"{alive} {started} {ns} {boot}\n"),
        make("other-namespace", f"{dead.pid} 12345 pid:[1] {boot}\n"),
        make("other-boot", f"{dead.pid} 12345 {ns} another-boot\n"),
        make("no-owner", None),
        make("odd-owner", "not a pid\n"),
        make("open-mode", f"{dead.pid} 12345 {ns} {boot}\n", 0o755),
    ]
    assert sorted(_jobdir.sweep_stale_job_dirs(str(tmp_path))) == sorted(stale)
    assert not any(os.path.exists(p) for p in stale)
    assert all(os.path.isdir(p) for p in keep)
