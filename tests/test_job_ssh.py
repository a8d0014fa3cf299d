"""SSHJob with a fake ``ssh`` on PATH: it drops the options and the host and runs
the remote command here, so the whole path (remote wrapper, secret over stdin,
agents dialing the controller) runs without any network.

Semantics: MONARCH_API.md §1.10 (SSH / login jobs).
"""

from __future__ import annotations

import glob
import os
import stat
import sys
from pathlib import Path

import psutil
import pytest

from actormesh.actor import Actor, endpoint
from actormesh.job import JobError, SSHJob

T = 20

_FAKE_SSH = """#!{python}
import os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_SSH_LOG"], "a") as log:
    log.write(repr(args) + "\\n")
while args and args[0].startswith("-"):
    if args.pop(0) in ("-o", "-p", "-i", "-l", "-F", "-J"):
        args.pop(0)
host = args.pop(0)
if host.startswith("nobody@"):
    sys.stderr.write(f"ssh: connect to host {{host}} port 22: No route to host\\n")
    sys.exit(255)
os.execvp("sh", ["sh", "-c", " ".join(args)])
"""


class Where(Actor):
    @endpoint
    def where(self) -> str:
        from actormesh.runtime import current_runtime

        return current_runtime().address


@pytest.fixture
def fake_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake ``ssh`` first on PATH; returns the file where it logs its argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(_FAKE_SSH.format(python=sys.executable))
    ssh.chmod(0o755)
    log = tmp_path / "ssh.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_LOG", str(log))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the remote wrapper makes its private dir
    return log


def _remote_dirs(tmp_path: Path) -> list[str]:
    """The wrappers' private directories (other actormesh runtimes make theirs there too)."""
    return [os.path.dirname(p) for p in glob.glob(str(tmp_path / "actormesh-*" / "secret"))]


def test_ssh_job_runs_actors_and_keeps_the_secret_out_of_argv(fake_ssh: Path, tmp_path: Path) -> None:
    from actormesh.runtime import current_runtime

    secret_hex = current_runtime().secret.hex()
    job = SSHJob({"trainers": ["127.0.0.2", "me@127.0.0.3"]}, python=sys.executable)
    try:
        state = job.state()
        assert job.active and state.trainers.size() == 2
        # the secret is nowhere in argv, on the ssh command line or on any process's
        assert secret_hex not in fake_ssh.read_text()
        for p in psutil.Process().children(recursive=True):
            try:
                argv = p.cmdline()
            except (psutil.ZombieProcess, psutil.NoSuchProcess):
                continue  # exited meanwhile (e.g. a short-lived launcher): no argv left to leak
            assert secret_hex not in " ".join(argv)
        # it sits in a 0600 file in a 0700 private directory on each "remote" host
        dirs = _remote_dirs(tmp_path)
        assert len(dirs) == 2
        for d in dirs:
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
            assert stat.S_IMODE(os.stat(f"{d}/secret").st_mode) == 0o600
            assert Path(f"{d}/secret").read_text().strip() == secret_hex
        procs = state.trainers.spawn_procs(per_host={"gpus": 2})
        try:
            where = procs.spawn("where", Where).where.call().get(timeout=T).values()
            assert [w.split(":")[1] for w in where] == ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"]
        finally:
            procs.stop().get(timeout=T)
    finally:
        job.kill()
    assert not job.active
    assert _remote_dirs(tmp_path) == []  # the wrappers removed the secrets


def test_ssh_job_unreachable_host_is_named_with_ssh_error(fake_ssh: Path) -> None:
    job = SSHJob(["127.0.0.2", "nobody@127.0.0.9"], python=sys.executable, join_timeout_s=20)
    try:
        with pytest.raises(JobError) as info:
            job.state()
    finally:
        job.kill()
    message = str(info.value)
    assert "nobody@127.0.0.9" in message and "exited with code 255" in message and "No route to host" in message


def test_ssh_job_validates_arguments() -> None:
    with pytest.raises(TypeError, match="list of ssh targets"):
        SSHJob("gpu1")
    with pytest.raises(ValueError, match="bind_host"):
        SSHJob(["gpu1"], bind_host="0.0.0.0")


def test_ssh_remote_command_reads_the_secret_from_stdin() -> None:
    job = SSHJob(["gpu1"], python="/opt/venv/bin/python", env={"NCCL_DEBUG": "INFO"})
    cmd = job.remote_command(None, "tcp:10.0.0.1:5000")
    assert cmd.startswith("sh -c ") and "read -r s" in cmd and "umask 077" in cmd
    assert "NCCL_DEBUG=INFO /opt/venv/bin/python -m actormesh.job._agent --controller tcp:10.0.0.1:5000" in cmd
    assert "--bind" not in cmd  # a host name: the agent binds the address on its route to the controller
    assert "--bind 10.1.2.3" in job.remote_command("10.1.2.3", "tcp:10.0.0.1:5000")


def test_ssh_job_needs_a_tcp_controller_for_remote_hosts() -> None:
    from actormesh.runtime import current_runtime

    if current_runtime().address.startswith("tcp:"):
        pytest.skip("this process's runtime already listens on TCP")
    job = SSHJob(["gpu1"])
    with pytest.raises(JobError, match="needs the controller to listen on TCP"):
        job.apply()
    assert not job.active
