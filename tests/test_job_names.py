"""Monarch's ``monarch.job`` helpers: exec_command, PortForwarder, set/load_current_job,
hosts_from_config."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for

from actormesh.actor import HostMesh, this_host, this_proc
from actormesh.errors import ActorError
from actormesh.job import (
    JobError,
    LocalJob,
    PortForwarder,
    exec_command,
    hosts_from_config,
    load_current_job,
    set_current_job,
)

# -- exec_command ------------------------------------------------------------------------------


def test_exec_command_returns_the_largest_exit_status(tmp_path: Path) -> None:
    host = HostMesh()
    ok = exec_command(host, ["sh", "-c", "exit 0"]).get(timeout=60)
    assert ok == 0
    script = tmp_path / "fail.py"
    script.write_text("import os, sys; sys.exit(int(os.environ['CODE']))")
    assert exec_command(host, [str(script)], env={"CODE": "3"}, per_host={"g": 2}).get(timeout=60) == 3


def test_exec_command_writes_output_files_in_workdir(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = exec_command(HostMesh(), ["sh", "-c", "pwd; echo err >&2"], workdir=str(tmp_path), output_dir=str(out)).get(timeout=60)
    assert code == 0
    assert (out / "stdout.txt").read_text().strip() == str(tmp_path)
    assert (out / "stderr.txt").read_text().strip() == "err"


def test_exec_command_timeout_kills_the_command() -> None:
    with pytest.raises(ActorError, match="did not finish within"):
        exec_command(HostMesh(), ["sleep", "60"], timeout_s=0.5).get(timeout=60)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"host_mesh": "hosts", "cmd": ["ls"]}, TypeError, "needs a HostMesh"),
        ({"cmd": "ls -l"}, TypeError, "non-empty list of str"),
        ({"cmd": []}, TypeError, "non-empty list of str"),
        ({"cmd": ["ls"], "env": {"A": 1}}, TypeError, "env must be"),
        ({"cmd": ["ls"], "rank": 0, "point": {}}, ValueError, "not both"),
        ({"cmd": ["ls"], "rank": -1}, ValueError, "rank must be"),
        ({"cmd": ["ls"], "timeout_s": 0}, ValueError, "timeout_s"),
    ],
)
def test_exec_command_checks_its_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    kwargs.setdefault("host_mesh", HostMesh())
    with pytest.raises(error, match=match):
        exec_command(**kwargs)


def test_exec_command_on_one_rank_of_a_job(tmp_path: Path) -> None:
    from actormesh.job import ProcessJob

    job = ProcessJob({"hosts": 2})
    try:
        hosts = job.state().hosts
        marker = tmp_path / "ran"
        code = exec_command(hosts, ["sh", "-c", f"echo $ACTORMESH_TRANSPORT_IN_USE >> {marker}"], rank=1).get(timeout=90)
        assert code == 0 and len(marker.read_text().splitlines()) == 1
        with pytest.raises(IndexError, match="out of range"):
            exec_command(hosts, ["true"], rank=2)
    finally:
        job.kill()


# -- PortForwarder -----------------------------------------------------------------------------


def _echo_server() -> tuple[socket.socket, int]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(30)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _round_trip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        chunks = []
        while data := c.recv(65536):
            chunks.append(data)
    return b"".join(chunks)


@pytest.mark.timeout(120)
def test_port_forward_round_trip_and_stop(spawn_procs: Any) -> None:
    procs = spawn_procs(per_host={"procs": 2})
    server, dst = _echo_server()
    forwarder = this_proc().spawn("port_forwarder", PortForwarder)
    try:
        src = _free_port()
        listening = forwarder.forward.call_one(procs.slice(procs=0), dst, procs.slice(procs=1), f"127.0.0.1:{src}").get(timeout=60)
        assert listening == [f"127.0.0.1:{src}"]
        payload = os.urandom(300_000)
        assert _round_trip(src, payload) == payload
        assert _round_trip(src, b"again") == b"again"  # one connection after another
        forwarder.stop().get(timeout=60)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", src), timeout=5).close()
    finally:
        server.close()


@pytest.mark.timeout(120)
def test_port_forward_per_point_addresses_and_bad_input(spawn_procs: Any) -> None:
    procs = spawn_procs(per_host={"procs": 2})
    server, dst = _echo_server()
    forwarder = this_proc().spawn("port_forwarder", PortForwarder)
    try:
        ports = [_free_port(), _free_port()]
        forwarder.forward.call_one(procs, dst, procs, lambda p: f"127.0.0.1:{ports[p['procs']]}").get(timeout=60)
        assert [_round_trip(p, str(p).encode()) for p in ports] == [str(p).encode() for p in ports]
        with pytest.raises(ActorError, match="same shape"):
            forwarder.forward.call_one(procs, dst, procs.slice(procs=0), "127.0.0.1:1").get(timeout=60)
        with pytest.raises(ActorError, match="TCP port in 1..65535"):
            forwarder.forward.call_one(procs, 0, procs, "127.0.0.1:1").get(timeout=60)
        with pytest.raises(ActorError, match="'host:port'"):
            forwarder.forward.call_one(procs, dst, procs, "nowhere").get(timeout=60)
        # a source address another program holds: the forward fails and what it started is stopped
        # (forwards share an address with each other, as Monarch's do: SO_REUSEPORT)
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        try:
            with pytest.raises(ActorError, match="Address already in use"):
                forwarder.forward.call_one(procs, dst, procs, f"127.0.0.1:{blocker.getsockname()[1]}").get(timeout=60)
        finally:
            blocker.close()
    finally:
        forwarder.stop().get(timeout=60)
        server.close()


# -- current job / hosts_from_config ----------------------------------------------------------


@pytest.fixture()
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "myjobs.py").write_text(textwrap.dedent("""
        from actormesh.job import LocalJob
        trainers = LocalJob(hosts=("trainers", "evals"))
        not_a_job = 3
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("myjobs", None)
    return tmp_path


def test_set_and_load_current_job(project: Path) -> None:
    with pytest.raises(FileNotFoundError, match="call set_current_job"):
        load_current_job()
    set_current_job("myjobs.trainers")
    job = load_current_job()
    assert isinstance(job, LocalJob) and job.hosts == ("trainers", "evals")
    assert (project / ".actormesh" / "current_job").read_text().strip() == "myjobs.trainers"
    assert isinstance(hosts_from_config("evals"), HostMesh)
    with pytest.raises(JobError, match="has no mesh 'nope'"):
        hosts_from_config("nope")
    import actormesh.actor

    assert actormesh.actor.hosts_from_config is hosts_from_config  # Monarch exports it from monarch.actor too


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("myjobs", ValueError, "module.attribute"),
        (3, ValueError, "module.attribute"),
        ("nosuchmodule.job", JobError, "cannot import module"),
        ("myjobs.missing", JobError, "has no attribute 'missing'"),
        ("myjobs.not_a_job", JobError, "must be an actormesh.job Job"),
    ],
)
def test_set_current_job_checks_the_spec(project: Path, spec: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        set_current_job(spec)
    assert not (project / ".actormesh" / "current_job").exists()


@pytest.mark.timeout(120)
def test_hosts_from_config_without_a_job_starts_two_local_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    hosts = hosts_from_config("workers")
    try:
        assert dict(hosts.extent) == {"hosts": 2}
        assert hosts.initialized.get(timeout=60)
        assert hosts_from_config("workers").initialized.get(timeout=60)  # the same two hosts again
    finally:
        hosts.shutdown().get(timeout=60)  # ends both host agents
    with pytest.raises(ValueError, match="mesh name"):
        hosts_from_config("not a name")
    assert this_host() is not None


# -- shell / `actormesh shell` -----------------------------------------------------------------

_SHELL = """
import sys
from actormesh.actor import HostMesh
from actormesh.job import shell
print("status", shell(HostMesh(), env={"GREETING": "hi-there"}, workdir=sys.argv[1]), flush=True)
"""


@pytest.mark.timeout(120)
def test_shell_runs_a_remote_interactive_shell_and_returns_its_status(tmp_path: Path) -> None:
    import subprocess

    script = tmp_path / "sh.py"
    script.write_text(_SHELL)
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], input="echo $GREETING; pwd\nexit 3\n",
                         capture_output=True, text=True, timeout=90, env={**os.environ, "SHELL": "/bin/sh"})
    assert out.returncode == 0, out.stderr
    lines = [re.sub(r"^[#$] ", "", line.strip()) for line in out.stdout.replace("\r", "").splitlines()]  # "# "/"$ ": sh's prompt
    assert "hi-there" in lines and str(tmp_path) in lines
    assert lines[-1] == "status 3"


def test_shell_checks_its_arguments() -> None:
    from actormesh.job import ProcessJob, shell

    with pytest.raises(TypeError, match="singleton HostMesh"):
        shell("host")  # type: ignore[arg-type]
    two = HostMesh(agents=["tcp:127.0.0.1:1", "tcp:127.0.0.1:2"])
    with pytest.raises(ValueError, match="singleton HostMesh"):
        shell(two)
    assert ProcessJob  # the CLI below uses jobs


@pytest.mark.timeout(120)
def test_actormesh_shell_console_entry_uses_the_current_job(project: Path) -> None:
    import subprocess

    set_current_job("myjobs.trainers")
    code = "import sys; from actormesh.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "SHELL": "/bin/sh", "PYTHONPATH": os.pathsep.join([str(project), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, "shell", "--mesh", "evals"], input="exit 5\n", capture_output=True, text=True,
                         timeout=90, cwd=project, env=env)
    assert out.returncode == 5, out.stderr
    bad = subprocess.run([sys.executable, "-c", code, "shell", "--mesh", "nope"], capture_output=True, text=True, timeout=90,
                         cwd=project, env=env)
    assert bad.returncode == 2 and "has no mesh 'nope'" in bad.stderr
    import tomllib

    scripts = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["actormesh"] == "actormesh.cli:main"


_SHELL_EOF = """
import sys, time
from actormesh.actor import HostMesh
from actormesh.job import shell
start = time.monotonic()
status = shell(HostMesh(), env={"SHELL": "/bin/sh"})
print("status", status, "took", round(time.monotonic() - start, 1), flush=True)
"""


@pytest.mark.timeout(120)
def test_shell_input_ending_hangs_up_a_foreground_command(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    proc = subprocess.Popen([sys.executable, "-c", _SHELL_EOF, str(pid_file)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None
        proc.stdin.write(f"sh -c {shlex.quote(f'echo $$ > {shlex.quote(str(pid_file))}; exec sleep 60')}\n")
        proc.stdin.flush()
        wait_for(pid_file.exists, timeout=60)
        proc.stdin.close()  # end of input while `sleep 60` runs in the foreground
        proc.wait(timeout=60)
        out = proc.stdout.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    status, took = re.search(r"status (-?\d+) took ([\d.]+)", out).groups()  # type: ignore[union-attr]
    assert int(status) != 0 and float(took) < 40  # hung up, not left to finish its 60 s


@pytest.mark.timeout(120)
def test_a_forward_that_fails_on_one_proc_frees_the_ports_the_others_bound(spawn_procs: Any) -> None:
    procs = spawn_procs(per_host={"procs": 2})
    server, dst = _echo_server()
    blocker = socket.socket()  # another program holds rank 1's source address
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    ports = [_free_port(), blocker.getsockname()[1]]
    forwarder = this_proc().spawn("port_forwarder", PortForwarder)
    try:
        try:
            with pytest.raises(ActorError, match="Address already in use"):
                forwarder.forward.call_one(procs, dst, procs, lambda p: f"127.0.0.1:{ports[p['procs']]}").get(timeout=60)
        finally:
            blocker.close()
        # The moment forward() has raised, rank 0's listener is closed: the port binds again.
        for port in ports:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))
    finally:
        forwarder.stop().get(timeout=60)
        server.close()
