"""The ``actormesh`` job commands: apply / info / exec / sync / kill over a real
keeper process and real ProcessJob host agents, each command a fresh process
(as a user runs them), plus ``--help`` on every command and the host selectors.

Semantics: docs/cli.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from actormesh.cli import SUBCOMMANDS, cli
from actormesh.cli._hosts import parse_selector

pytestmark = pytest.mark.timeout(180)

JOB = 'from actormesh.job import ProcessJob\njob = ProcessJob({"trainers": 2, "eval": 1})\n'


def am(project: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the console script's entry point in ``project`` as a fresh process."""
    code = "import sys; from actormesh.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=project, capture_output=True, text=True, timeout=timeout, env=env)


def _keeper_pid(project: Path) -> int | None:
    try:
        return json.loads((project / ".actormesh" / "applied" / "record.json").read_text())["keeper_pid"]
    except (OSError, ValueError):
        return None


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """A project directory with job.py; whatever keeper a test leaves is killed (its agents go with it)."""
    (tmp_path / "job.py").write_text(JOB)
    yield tmp_path
    pid = _keeper_pid(tmp_path)
    if pid is not None and psutil.pid_exists(pid):
        os.kill(pid, signal.SIGTERM)
        try:
            psutil.Process(pid).wait(timeout=60)
        except psutil.NoSuchProcess:
            pass


def test_every_command_has_help() -> None:
    runner = CliRunner()
    top = runner.invoke(cli, ["--help"])
    assert top.exit_code == 0
    for name in ("apply", "info", "kill", "exec", "sync"):
        assert name in top.output
        out = runner.invoke(cli, [name, "--help"])
        assert out.exit_code == 0, out.output
        assert f"Usage: cli {name}" in out.output or f"Usage: actormesh {name}" in out.output
    assert set(SUBCOMMANDS) >= {"apply", "info", "kill", "exec", "sync", "shell"}


def test_host_selectors() -> None:
    meshes = {"trainers": 4, "eval": 1}
    assert parse_selector("all", meshes) == [("trainers", 0), ("trainers", 1), ("trainers", 2), ("trainers", 3), ("eval", 0)]
    assert parse_selector("eval", meshes) == [("eval", 0)]
    assert parse_selector("trainers[1:3]", meshes) == [("trainers", 1), ("trainers", 2)]
    assert parse_selector("trainers[0,3],eval,trainers[0]", meshes) == [("trainers", 0), ("trainers", 3), ("eval", 0)]
    assert parse_selector("trainers[-1]", meshes) == [("trainers", 3)]
    with pytest.raises(ValueError, match="no mesh 'gpus'; its meshes are trainers, eval"):
        parse_selector("gpus", meshes)
    with pytest.raises(ValueError, match="out of range"):
        parse_selector("trainers[4]", meshes)
    with pytest.raises(ValueError, match="bad host selector"):
        parse_selector("trainers[", meshes)
    with pytest.raises(ValueError, match="selects no host"):
        parse_selector("trainers[2:2]", meshes)


_SCRIPT = """
import os
from actormesh.actor import Actor, endpoint
from actormesh.job import load_current_job

class Pid(Actor):
    @endpoint
    def ppid(self):  # the host agent that spawned it: its parent, or its zygote's
        parent = os.getppid()
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            if b"actormesh.zygote" not in f.read():
                return parent
        with open(f"/proc/{parent}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

state = load_current_job().state()
procs = state.trainers.spawn_procs(per_host={"gpus": 1})
print(sorted(procs.spawn("p", Pid).ppid.call().get(timeout=60).values()))
procs.stop().get(timeout=60)
"""


def test_apply_info_exec_sync_kill(project: Path) -> None:
    applied = am(project, "apply", "job.py")
    assert applied.returncode == 0, applied.stderr
    assert "trainers" in applied.stdout and "eval" in applied.stdout
    record = json.loads(am(project, "info", "--json").stdout)
    agents = [h["pid"] for hosts in record["meshes"].values() for h in hosts]
    assert [len(record["meshes"][m]) for m in ("trainers", "eval")] == [2, 1]
    assert all(psutil.pid_exists(p) for p in agents)
    assert (project / ".actormesh" / "current_job").read_text().strip() == "job.job"

    again = am(project, "apply", "job.py")  # a no-op while it runs
    assert again.returncode == 0 and "already applied" in again.stderr and _keeper_pid(project) == record["keeper_pid"]

    out = am(project, "exec", "-e", "X=1", "trainers,eval[0]", "--", "sh", "-c", "echo out-$X; echo oops >&2; exit 3")
    assert out.returncode == 3, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[eval/0] out-1", "[trainers/0] out-1", "[trainers/1] out-1"]
    assert "[trainers/1] oops" in out.stderr and "[eval/0] exited with status 3" in out.stderr

    (project / "code").mkdir()
    (project / "code" / "hello_sync.py").write_text("WHO = 'synced'\n")
    synced = am(project, "sync", "code", "--mesh", "trainers")
    assert synced.returncode == 0, synced.stderr
    assert "sent 2 files" in synced.stdout
    out = am(project, "exec", "trainers", "--", "python", "-c", "import hello_sync; print(hello_sync.WHO)")
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[trainers/0] synced", "[trainers/1] synced"]

    (project / "script.py").write_text(_SCRIPT)  # a script attaches to the applied hosts through load_current_job()
    run = subprocess.run([sys.executable, "script.py"], cwd=project, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1]) == sorted(record["meshes"]["trainers"][i]["pid"] for i in range(2))

    killed = am(project, "kill")
    assert killed.returncode == 0 and "killed ProcessJob" in killed.stdout
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in agents if psutil.pid_exists(p)], timeout=30)
    assert not alive
    info = am(project, "info")
    assert info.returncode == 1 and "run `actormesh apply job.py` here first" in info.stderr


def test_apply_errors_name_the_fix(project: Path) -> None:
    (project / "two.py").write_text(JOB.replace("job =", "trainers_job =") + "other = 3\n")
    out = am(project, "apply", "two.py")
    assert out.returncode == 1 and "no attribute 'job'" in out.stderr and "--attr trainers_job" in out.stderr
    (project / "bad.py").write_text("job = 42\n")
    out = am(project, "apply", "bad.py")
    assert out.returncode == 1 and "must be an actormesh.job Job" in out.stderr
    (project / "boom.py").write_text("raise RuntimeError('broken job file')\n")
    assert "broken job file" in am(project, "apply", "boom.py").stderr
    assert "does not exist" in am(project, "apply", "missing.py").stderr
    out = am(project, "kill")
    assert out.returncode == 1 and "actormesh apply" in out.stderr
    out = am(project, "exec", "all", "--", "true")
    assert out.returncode == 1 and "actormesh apply" in out.stderr


def test_a_second_job_is_refused_and_a_dead_keeper_is_reported(project: Path) -> None:
    (project / "fn_job.py").write_text("from actormesh.job import ProcessJob\n\ndef make():\n    return ProcessJob({'hosts': 1})\n")
    assert am(project, "apply", "fn_job.py", "--attr", "make").returncode == 0
    other = am(project, "apply", "job.py")
    assert other.returncode == 1 and "run `actormesh kill` first" in other.stderr
    out = am(project, "exec", "hosts[3]", "--", "true")
    assert out.returncode == 2 and "out of range" in out.stderr
    pid = _keeper_pid(project)
    os.kill(pid, signal.SIGKILL)  # the agents exit with their controller
    try:
        psutil.Process(pid).wait(timeout=30)
    except psutil.NoSuchProcess:
        pass
    assert "no job is applied" in am(project, "info").stderr
    killed = am(project, "kill")  # the keeper left its cached state: kill uses it
    assert killed.returncode == 0 and "cached state" in killed.stdout


def test_a_job_that_breaks_while_held_is_released_and_reported(project: Path) -> None:
    (project / "one.py").write_text("from actormesh.job import ProcessJob\njob = ProcessJob({'hosts': 1})\n")
    assert am(project, "apply", "one.py").returncode == 0
    record = json.loads((project / ".actormesh" / "applied" / "record.json").read_text())
    os.kill(record["meshes"]["hosts"][0]["pid"], signal.SIGKILL)  # a host dies under the keeper
    try:
        psutil.Process(record["keeper_pid"]).wait(timeout=60)  # the keeper notices, releases the job and ends
    except psutil.NoSuchProcess:
        pass
    info = am(project, "info")
    assert info.returncode == 1 and "broke while held" in info.stderr and "run `actormesh apply job.py` again" in info.stderr
    assert not (project / ".actormesh" / "applied" / "record.json").exists()
