"""SlurmJob on a real local Slurm cluster (shared/slurm/start-local-slurm.sh): one
sbatch job whose srun step starts a host agent per node; the agents dial a
controller that listens where the nodes can reach it.

The cluster needs root and the Slurm packages (installed by the script on first
use); where it cannot start, these tests skip with the script's reason.
The controllers run in subprocesses: they must listen on TCP, while this pytest
process's runtime uses unix sockets.

Semantics: MONARCH_API.md §1.10 (SlurmJob).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from actormesh.job import SlurmJob

# The first start may install the Slurm packages (apt-get): the session fixture's
# setup counts against the first test's timeout.
pytestmark = pytest.mark.timeout(330)

SCRIPTS = Path(__file__).resolve().parents[2] / "shared" / "slurm"  # shared/ beside the repository


@pytest.fixture(scope="session")
def slurm_env() -> Iterator[dict[str, str]]:
    """Start (or reuse) the local cluster; its LOCAL_SLURM_* / SLURM_CONF variables."""
    script = SCRIPTS / "start-local-slurm.sh"
    if not script.exists():
        pytest.skip(f"no local Slurm: {script} not found")
    r = subprocess.run([str(script)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        pytest.skip("no local Slurm: " + (lines[-1] if lines else f"exit {r.returncode}"))
    env = dict(shlex.split(line)[1].split("=", 1) for line in r.stdout.splitlines() if line.startswith("export "))
    yield env
    subprocess.run([str(SCRIPTS / "stop-local-slurm.sh")], capture_output=True, timeout=120)


def _run_controller(code: str, tmp_path: Path, slurm_env: dict[str, str], timeout: float = 75) -> dict:
    """Run ``code`` as a TCP controller next to the cluster; return its last stdout line as JSON."""
    prelude = (
        "import json, os, sys\n"
        "from actormesh import config\n"
        "config.configure(default_transport='tcp', bind_host=os.environ['LOCAL_SLURM_CONTROLLER_ADDR'])\n"
        "from actormesh.job import SlurmJob, JobError\n"
    )
    script = tmp_path / "controller.py"
    script.write_text(prelude + code)
    env = {**os.environ, **slurm_env, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    assert r.returncode == 0, f"controller failed:\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


_TWO_NODES = """
import socket
from actormesh.actor import Actor, endpoint

class Where(Actor):
    @endpoint
    def where(self):
        return socket.gethostname(), os.environ.get("SLURMD_NODENAME"), os.getpid()

job = SlurmJob({"trainers": 1, "generators": 1}, state_dir=sys.argv[1], job_start_timeout=30, join_timeout_s=30, time_limit="5")
try:
    state = job.state()
    out = {"job_id": job.job_id, "nodes": job.nodes, "meshes": {}}
    for name in state:
        procs = state[name].spawn_procs(per_host={"procs": 2})
        try:
            out["meshes"][name] = procs.spawn("where", Where).where.call().get(timeout=30).values()
        finally:
            procs.stop().get(timeout=30)
    out["active_before_kill"] = job.active
finally:
    job.kill()
out["active_after_kill"] = job.active
print(json.dumps(out))
"""


def test_slurm_job_runs_actors_on_two_nodes(slurm_env: dict[str, str], tmp_path: Path) -> None:
    out = _run_controller(_TWO_NODES, tmp_path, slurm_env)
    nodes = out["nodes"]
    assert len(nodes) == 2 and len(set(nodes)) == 2
    trainers, generators = out["meshes"]["trainers"], out["meshes"]["generators"]
    # meshes are filled in node order; both procs of a host run on its node
    assert {n for _, n, _ in trainers} == {nodes[0]} and {n for _, n, _ in generators} == {nodes[1]}
    if slurm_env.get("LOCAL_SLURM_DISTINCT_HOSTNAMES") == "1":
        assert {h for h, _, _ in trainers} == {nodes[0]} and {h for h, _, _ in generators} == {nodes[1]}
    assert len({pid for _, _, pid in trainers + generators}) == 4
    assert out["active_before_kill"] and not out["active_after_kill"]
    # the secret file went with kill(); the batch log stayed
    job_dir = next((tmp_path).glob("actormesh-*"))
    assert not list(job_dir.glob("secret-*")) and list(job_dir.glob(f"slurm-{out['job_id']}.out"))


_PENDING = """
job = SlurmJob({"hosts": 2}, state_dir=sys.argv[1], job_start_timeout=1.5, slurm_args=["--begin=now+3600"])
try:
    job.state()
    print(json.dumps({"error": None}))
except JobError as exc:
    print(json.dumps({"error": str(exc), "active": job.active, "job_id": job.job_id}))
"""


def test_slurm_job_that_does_not_start_in_time_is_cancelled(slurm_env: dict[str, str], tmp_path: Path) -> None:
    out = _run_controller(_PENDING, tmp_path, slurm_env)
    assert out["error"] and "did not start within job_start_timeout=1.5s" in out["error"] and "PENDING" in out["error"]
    assert "BeginTime" in out["error"] and not out["active"]
    state = subprocess.run(["scontrol", "show", "job", "-o", out["job_id"]], capture_output=True, text=True, env={**os.environ, **slurm_env}, timeout=30)
    assert "JobState=CANCELLED" in state.stdout or state.returncode != 0


_REJECTED = """
job = SlurmJob({"hosts": 1}, state_dir=sys.argv[1], partition="no-such-partition")
try:
    job.apply()
    print(json.dumps({"error": None}))
except JobError as exc:
    print(json.dumps({"error": str(exc), "active": job.active}))
"""


def test_slurm_job_rejected_by_sbatch_says_why(slurm_env: dict[str, str], tmp_path: Path) -> None:
    out = _run_controller(_REJECTED, tmp_path, slurm_env)
    assert "sbatch" in out["error"] and "invalid partition" in out["error"].lower() and not out["active"]


def test_batch_script_and_sbatch_args() -> None:
    job = SlurmJob({"a": 2, "b": 1}, python_exe="/venv/bin/python", time_limit="01:00:00", partition="gpu", gpus_per_node=8, exclusive=True)
    args = job.sbatch_args()
    assert "--nodes=3" in args and "--ntasks-per-node=1" in args and "--time=01:00:00" in args
    assert "--partition=gpu" in args and "--gpus-per-node=8" in args and "--exclusive" in args
    script = job.batch_script("tcp:10.0.0.1:4000", "/shared/job/secret-x")
    assert "srun --ntasks-per-node=1" in script
    assert "/venv/bin/python -m actormesh.job._agent --port 0 --controller tcp:10.0.0.1:4000 --secret-file /shared/job/secret-x" in script
