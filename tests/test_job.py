"""Jobs on one machine: the job model (JobState, dumps/loads, validation),
LocalJob, ProcessJob (host agents as real local processes on distinct loopback
addresses) and Monarch's run_worker_loop_forever / attach_to_workers.

Semantics: MONARCH_API.md §1.10 (jobs), §1.6 (remote hosts rows).
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from actormesh.actor import Actor, endpoint, this_host
from actormesh.job import (
    Job,
    JobError,
    JobState,
    LocalJob,
    ProcessJob,
    attach_to_workers,
    job_load,
    job_loads,
    run_worker_loop_forever,
)
from actormesh.job._attach import normalize_address
from actormesh.job._progress import Progress

T = 20  # bound of every .get()


class Where(Actor):
    @endpoint
    def where(self) -> tuple[str, int]:
        from actormesh.runtime import current_runtime

        return current_runtime().address, os.getpid()


@pytest.fixture
def jobs() -> Any:
    """Jobs made through this are killed after the test, pass or fail."""
    made: list[Job] = []

    def make(job: Job) -> Any:
        made.append(job)
        return job

    yield make
    for job in made:
        job.kill()


def _alive(pids: list[int], timeout: float) -> list[str]:
    """Wait up to ``timeout`` for these processes to end; describe those still running."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    out = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


def _gone(pids: list[int], timeout: float) -> bool:
    return not _alive(pids, timeout)


# -- the job model ---------------------------------------------------------------------------


def test_job_state_attributes_and_errors() -> None:
    a, b = this_host(), this_host()
    state = JobState({"trainers": a, "generators": b})
    assert state.trainers is a and state["generators"] is b
    assert state.names() == ["trainers", "generators"] and "trainers" in state and list(state) == ["trainers", "generators"]
    with pytest.raises(AttributeError, match=r"no mesh named 'workers'.*\['generators', 'trainers'\]"):
        _ = state.workers


@pytest.mark.parametrize(
    "meshes, error",
    [({}, TypeError), ({"a": 0}, ValueError), ({"a": True}, ValueError), ({"not a name": 1}, ValueError), ({"_hidden": 1}, ValueError), ([("a", 1)], TypeError)],
)
def test_process_job_validates_meshes(meshes: Any, error: type) -> None:
    with pytest.raises(error):
        ProcessJob(meshes)


def test_local_job_meshes_are_this_host() -> None:
    job = LocalJob(hosts=("trainers", "generators"))
    assert not job.active
    state = job.state()
    assert job.active and state.trainers._agents is None and state.generators.size() == 1
    job.kill()
    assert not job.active


def test_batch_mode_is_not_supported() -> None:
    with pytest.raises(NotImplementedError, match="batch mode"):
        LocalJob().apply(client_script="train.py")


def test_dumps_roundtrip_keeps_description_and_returns_the_live_job(tmp_path: Path) -> None:
    job = LocalJob(hosts=("a",))
    assert job_loads(job.dumps()) is job  # same process: the live job itself
    path = tmp_path / "job.pkl"
    job.dump(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    other = pickle.loads(path.read_bytes())  # as another process would see it
    assert other is not job and other.hosts == ("a",) and other.can_run(job) and not other.can_run(LocalJob(hosts=("b",)))
    assert job_load(path) is job


def test_dumped_process_job_drops_live_handles(jobs: Any) -> None:
    job = jobs(ProcessJob({"hosts": 1}))
    job.state()
    clone = pickle.loads(job.dumps())
    assert clone._agents is None and clone._state is None and clone._pids == job._pids and clone.meshes == {"hosts": 1}


def test_progress_is_quiet_off_a_terminal() -> None:
    with Progress("waiting", enabled=False) as p:
        p.update("1/2")
    assert p._status is None


# -- ProcessJob ------------------------------------------------------------------------------


def test_process_job_runs_actors_on_distinct_loopback_hosts(jobs: Any) -> None:
    job = jobs(ProcessJob({"trainers": 2, "generators": 1}))
    state = job.state()
    assert job.active and state.names() == ["trainers", "generators"]
    assert state.trainers.size() == 2 and state.generators.size() == 1
    assert state.trainers.initialized.get(timeout=T)
    assert job.state() is state  # cached while running
    procs = state.trainers.spawn_procs(per_host={"gpus": 2})
    try:
        where = procs.spawn("where", Where).where.call().get(timeout=T)
        hosts = [addr.split(":")[1] for addr, _ in where.values()]
        assert hosts == ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"]
        assert len({pid for _, pid in where.values()}) == 4
    finally:
        procs.stop().get(timeout=T)
    gen = state.generators.spawn_procs(per_host={"procs": 1})
    try:
        ((addr, _),) = gen.spawn("where", Where).where.call().get(timeout=T).values()
        assert addr.startswith("tcp:127.0.0.4:")
    finally:
        gen.stop().get(timeout=T)
    pids = list(job._pids)
    job.kill()
    assert not job.active and _gone(pids, 10)
    job.kill()  # idempotent


def test_process_job_with_a_dead_agent_is_reapplied(jobs: Any) -> None:
    job = jobs(ProcessJob({"hosts": 2}))
    job.state()
    old = list(job._pids)
    os.kill(old[1], signal.SIGKILL)
    assert _gone([old[1]], 10) and not job.active
    state = job.state()  # re-applies: the survivor is stopped, two fresh agents join
    assert job.active and state.hosts.initialized.get(timeout=T)
    assert not set(job._pids) & set(old) and _gone(old, 10)


def test_job_loaded_elsewhere_can_be_killed_but_not_used(jobs: Any) -> None:
    job = jobs(ProcessJob({"hosts": 2}))
    job.state()
    elsewhere = pickle.loads(job.dumps())  # as job_load() in another process on this host sees it
    elsewhere._applied_by = (socket.gethostname(), 1)
    assert elsewhere.active
    with pytest.raises(JobError, match="belongs to the controller that applied it"):
        elsewhere.state()
    elsewhere.kill()  # signals the agents it recorded
    assert _alive(job._pids, 10) == [] and not job.active


def test_process_job_agent_that_exits_fails_fast_naming_the_host(jobs: Any, tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'agent: cannot start, no GPU driver' >&2\nexit 3\n")
    fake.chmod(0o755)
    job = jobs(ProcessJob({"hosts": 2}, python_exe=str(fake), join_timeout_s=20))
    with pytest.raises(JobError) as info:
        job.state()
    message = str(info.value)
    assert "127.0.0." in message and "exited with code 3" in message and "no GPU driver" in message and "not joined" in message
    assert not job.active


def test_process_job_join_timeout_names_missing_hosts(jobs: Any, tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")  # alive, never joins
    fake.chmod(0o755)
    job = jobs(ProcessJob({"hosts": 2}, python_exe=str(fake), join_timeout_s=0.5))
    with pytest.raises(JobError, match=r"not joined: 127.0.0.2, 127.0.0.3 \(2 of 2 host\(s\) did not join within 0.5s\)"):
        job.state()
    assert not job.active  # the sleeping agents were stopped


_CONTROLLER = """
import json, os, sys
from actormesh.job import ProcessJob
job = ProcessJob({"hosts": 2})
state = job.state()
procs = state.hosts.spawn_procs(per_host={"procs": 1})
procs.initialized.get(timeout=20)
print(json.dumps(job._pids), flush=True)
sys.stdin.readline()          # the test looks at our processes, then says "exit" or kills us
"""


@pytest.mark.parametrize("end", ["exit", "sigkill"])
def test_process_job_agents_end_with_their_controller(tmp_path: Path, end: str) -> None:
    """At interpreter exit (atexit) and when the controller is SIGKILLed, agents and their procs go."""
    script = tmp_path / "controller.py"
    script.write_text(_CONTROLLER)
    ctl = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = ctl.stdout.readline()  # type: ignore[union-attr]
        assert line, "controller printed nothing"
        pids = __import__("json").loads(line)
        descendants = [p.pid for p in psutil.Process(ctl.pid).children(recursive=True)]
        assert set(pids) <= set(descendants) and len(descendants) >= 4  # 2 agents + their 2 procs
        if end == "sigkill":
            ctl.send_signal(signal.SIGKILL)
        else:
            ctl.stdin.write("exit\n")  # type: ignore[union-attr]
            ctl.stdin.flush()  # type: ignore[union-attr]
        assert ctl.wait(timeout=20) in (0, -signal.SIGKILL)
        assert _gone(descendants, 15), "agents or their procs outlived the controller"
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait(timeout=10)


# -- run_worker_loop_forever / attach_to_workers --------------------------------------------


def test_normalize_address() -> None:
    assert normalize_address("tcp://10.0.0.5:26600") == "tcp:10.0.0.5:26600"
    assert normalize_address("tcp:host-1:1") == "tcp:host-1:1"
    assert normalize_address("tcp://[::1]:5") == "tcp:[::1]:5"
    assert normalize_address("unix:/tmp/a.sock") == "unix:/tmp/a.sock"
    with pytest.raises(ValueError, match="wildcard"):
        normalize_address("tcp://*:26600")
    with pytest.raises(ValueError, match="expected 'tcp://HOST:PORT'"):
        normalize_address("http://x:1")


def test_only_trust_all_connections_is_supported() -> None:
    with pytest.raises(NotImplementedError, match="trust_all_connections"):
        attach_to_workers(workers=["tcp://127.0.0.1:1"], ca="my-ca.pem")
    with pytest.raises(NotImplementedError, match="trust_all_connections"):
        run_worker_loop_forever(address="tcp://127.0.0.1:1", ca="my-ca.pem")


def test_worker_loop_needs_the_secret_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ACTORMESH_SECRET_FILE", raising=False)
    with pytest.raises(JobError, match="ACTORMESH_SECRET_FILE"):
        run_worker_loop_forever(address="tcp://127.0.0.1:1")
    loose = tmp_path / "secret"
    loose.write_text("ab" * 32)
    loose.chmod(0o644)
    monkeypatch.setenv("ACTORMESH_SECRET_FILE", str(loose))
    with pytest.raises(JobError, match="chmod 600"):
        run_worker_loop_forever(address="tcp://127.0.0.1:1")


def test_attach_refuses_a_runtime_with_another_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from actormesh.runtime import current_runtime

    current_runtime()  # this process's runtime runs with its own random secret
    secret = tmp_path / "secret"
    secret.write_text("cd" * 32)
    secret.chmod(0o600)
    monkeypatch.setenv("ACTORMESH_SECRET_FILE", str(secret))
    with pytest.raises(JobError, match="before the first actormesh call"):
        attach_to_workers(workers=["tcp://127.0.0.1:1"])


_ATTACH = """
import json, os, sys
from actormesh.actor import Actor, endpoint
from actormesh.job import attach_to_workers

class Where(Actor):
    @endpoint
    def where(self):
        from actormesh.runtime import current_runtime
        return current_runtime().address

hosts = attach_to_workers(workers=sys.argv[1:])
assert hosts.initialized.get(timeout=20)
procs = hosts.spawn_procs(per_host={"procs": 1})
print(json.dumps(procs.spawn("w", Where).where.call().get(timeout=20).values()))
procs.stop().get(timeout=20)
"""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def test_attach_to_workers_started_with_run_worker_loop_forever(tmp_path: Path) -> None:
    secret = tmp_path / "job.secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    env = {**os.environ, "ACTORMESH_SECRET_FILE": str(secret)}
    addresses = [f"tcp://127.0.0.{i}:{_free_port(f'127.0.0.{i}')}" for i in (5, 6)]
    serve = "import sys; from actormesh.job import run_worker_loop_forever; run_worker_loop_forever(address=sys.argv[1])"
    workers = [subprocess.Popen([sys.executable, "-c", serve, a], env=env) for a in addresses]
    try:
        script = tmp_path / "attach.py"
        script.write_text(_ATTACH)
        out = subprocess.run([sys.executable, str(script), *addresses], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        where = __import__("json").loads(out.stdout.strip().splitlines()[-1])
        assert [w.split(":")[1] for w in where] == ["127.0.0.5", "127.0.0.6"]
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait(timeout=5)
    assert [w.returncode for w in workers] == [0, 0]
