"""HostMesh launch customisation (bootstrap_command, proc_bind, with_python_executable),
HostMesh.stop/shutdown, and the worker loops that a shutdown ends."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from actormesh.actor import (
    Actor,
    BootstrapCommand,
    HostMesh,
    Point,
    default_bootstrap_cmd,
    endpoint,
    this_host,
)


class Env(Actor):
    @endpoint
    def probe(self, name: str) -> tuple[str | None, list[int], str]:
        return os.environ.get(name), sorted(os.sched_getaffinity(0)), sys.executable


# -- BootstrapCommand ------------------------------------------------------------------------


def test_default_bootstrap_cmd_runs_the_worker_module_with_this_python() -> None:
    cmd = default_bootstrap_cmd()
    assert cmd.program == sys.executable
    assert cmd.args == ["-m", "actormesh.worker"]
    assert cmd.arg0 is None and cmd.env == {}


def test_with_env_copies_and_overrides() -> None:
    base = BootstrapCommand("/bin/python", None, ["-m", "x"], {"A": "1", "B": "2"})
    derived = base.with_env({"B": "3", "A": None})
    assert base.env == {"A": "1", "B": "2"}  # not mutated
    assert derived.env == {"A": None, "B": "3"}
    assert derived.program == base.program and derived.args == base.args
    assert pickle.loads(pickle.dumps(derived)) == derived


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("", None, [], {}), TypeError, "program"),
        (("py", 3, [], {}), TypeError, "arg0"),
        (("py", None, "-m x", {}), TypeError, "args"),
        (("py", None, [], {"A": 1}), TypeError, "A must be a str"),
        (("py", None, [], {"A=B": "1"}), ValueError, "variable name"),
        (("py", None, [], ["A"]), TypeError, "env"),
    ],
)
def test_bootstrap_command_rejects_bad_fields(args: tuple, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        BootstrapCommand(*args)


def test_callable_bootstrap_command_sets_cuda_visible_devices_per_rank() -> None:
    seen: list[Point] = []

    def per_rank(point: Point) -> BootstrapCommand:
        seen.append(point)
        return default_bootstrap_cmd().with_env({"CUDA_VISIBLE_DEVICES": str(point["gpus"]), "DROPPED": None})

    os.environ["DROPPED"] = "inherited"
    try:
        procs = this_host().spawn_procs(per_host={"gpus": 2}, bootstrap_command=per_rank)
    finally:
        del os.environ["DROPPED"]
    try:
        values = procs.spawn("env", Env).probe.call("CUDA_VISIBLE_DEVICES").get(timeout=60).values()
        assert [v[0] for v in values] == ["0", "1"]
        assert [dict(p) for p in seen] == [{"gpus": 0}, {"gpus": 1}]
        assert procs.spawn("env2", Env).probe.call("DROPPED").get(timeout=60).values()[0][0] is None
    finally:
        procs.stop().get(timeout=30)


def test_bootstrap_command_errors_are_raised_at_the_call_site() -> None:
    host = this_host()
    with pytest.raises(TypeError, match="must return a BootstrapCommand"):
        host.spawn_procs(per_host={"g": 1}, bootstrap_command=lambda p: "python")
    with pytest.raises(ValueError, match=r"raised ZeroDivisionError"):
        host.spawn_procs(per_host={"g": 1}, bootstrap_command=lambda p: 1 / 0)
    with pytest.raises(TypeError, match="bootstrap_command must be"):
        host.spawn_procs(per_host={"g": 1}, bootstrap_command="python -m actormesh.worker")
    with pytest.raises(ValueError, match="not on PATH"):
        host.spawn_procs(per_host={"g": 1}, bootstrap_command=BootstrapCommand("no-such-program-xyz", None, [], {}))


def test_a_wrapper_program_that_execs_the_worker_is_used(tmp_path: Path) -> None:
    wrapper = tmp_path / "wrap.sh"
    wrapper.write_text(f'#!/bin/sh\nexport WRAPPED=yes\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    procs = this_host().spawn_procs(per_host={"g": 1}, bootstrap_command=BootstrapCommand(str(wrapper), None, ["-m", "actormesh.worker"], {}))
    try:
        assert procs.spawn("env", Env).probe.call_one("WRAPPED").get(timeout=60)[0] == "yes"
    finally:
        procs.stop().get(timeout=30)


# -- proc_bind ---------------------------------------------------------------------------------


def test_proc_bind_cpus_pins_each_proc() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    procs = this_host().spawn_procs(per_host={"g": 2}, proc_bind=[{"cpus": str(cpus[0])}, {"cpus": f"{cpus[1]}"}])
    try:
        values = procs.spawn("env", Env).probe.call("X").get(timeout=60).values()
        assert [v[1] for v in values] == [[cpus[0]], [cpus[1]]]
    finally:
        procs.stop().get(timeout=30)


def test_proc_bind_to_a_cpu_this_host_lacks_fails_the_proc_with_the_reason() -> None:
    procs = this_host().spawn_procs(per_host={"g": 1}, proc_bind=[{"cpus": "4000"}])
    try:
        with pytest.raises(RuntimeError, match="proc_bind cpus='4000' could not be applied"):
            procs.initialized.get(timeout=60)
    finally:
        procs.stop().get(timeout=30)


@pytest.mark.parametrize(
    ("bind", "error", "match"),
    [
        ([{"cpus": "0"}], ValueError, r"proc_bind length \(1\) must equal procs_per_host \(2\)"),
        ({"cpus": "0"}, TypeError, "one dict per proc"),
        ([{"cpus": "0"}, "0"], TypeError, r"proc_bind\[1\] must be a dict"),
        ([{"cpu": "0"}, {}], ValueError, "unknown key 'cpu'"),
        ([{"cpus": 0}, {}], TypeError, "must be a non-empty str"),
        ([{"cpus": "a-b"}, {}], ValueError, "expected a CPU list"),
        ([{"cpus": "0", "membind": "0"}, {}], ValueError, "cannot be combined"),
    ],
)
def test_bad_proc_bind_is_refused_before_anything_starts(bind: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        this_host().spawn_procs(per_host={"g": 2}, proc_bind=bind)  # type: ignore[arg-type]


def test_numactl_keys_use_numactl_or_say_it_is_missing() -> None:
    if shutil.which("numactl") is None:
        with pytest.raises(ValueError, match="need numactl, which is not installed"):
            this_host().spawn_procs(per_host={"g": 1}, proc_bind=[{"cpunodebind": "0"}])
        return
    procs = this_host().spawn_procs(per_host={"g": 1}, proc_bind=[{"cpunodebind": "0", "membind": "0"}])
    try:
        assert procs.spawn("env", Env).probe.call_one("X").get(timeout=60)[1]
    finally:
        procs.stop().get(timeout=30)


# -- with_python_executable ---------------------------------------------------------------------


def test_with_python_executable_launches_procs_with_that_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    link = tmp_path / "python-link"
    link.symlink_to(sys.executable)
    # A link outside the venv starts the base interpreter: give it this one's
    # import path, as a user's other interpreter would have actormesh installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
    host = this_host().with_python_executable(str(link))
    procs = host.spawn_procs(per_host={"g": 1})
    try:
        assert procs.spawn("env", Env).probe.call_one("X").get(timeout=60)[2] == str(link)
    finally:
        procs.stop().get(timeout=30)
    with pytest.raises(ValueError, match="not an executable file"):
        this_host().with_python_executable(str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="path of a Python interpreter"):
        this_host().with_python_executable(3)  # type: ignore[arg-type]


# -- stop / shutdown on the local host ----------------------------------------------------------


def test_local_host_stop_stops_its_procs_and_keeps_the_host_usable() -> None:
    host = HostMesh()
    procs = host.spawn_procs(per_host={"g": 1})
    actor = procs.spawn("env", Env)
    actor.probe.call_one("X").get(timeout=60)
    host.stop().get(timeout=60)
    assert procs._state is not None and procs._state.stopped is not None
    again = host.spawn_procs(per_host={"g": 1})
    try:
        assert again.spawn("env", Env).probe.call_one("X").get(timeout=60)
    finally:
        host.shutdown().get(timeout=60)
    with pytest.raises(RuntimeError, match="already been shut down"):
        host.spawn_procs(per_host={"g": 1})


def test_stop_and_shutdown_refuse_references() -> None:
    host = HostMesh()
    ref = pickle.loads(pickle.dumps(host))
    with pytest.raises(NotImplementedError, match="not on a slice or a reference"):
        ref.stop()
    with pytest.raises(NotImplementedError, match="not on a slice or a reference"):
        ref.shutdown()


# -- worker loops ended by HostMesh.shutdown() ---------------------------------------------------


_SHUTDOWN = """
import sys
from actormesh.actor import Actor, endpoint
from actormesh.job import attach_to_workers

class Pid(Actor):
    @endpoint
    def pid(self):
        import os
        return os.getpid()

hosts = attach_to_workers(workers=sys.argv[1:])
assert hosts.initialized.get(timeout=30)
procs = hosts.spawn_procs(per_host={"procs": 1})
print(procs.spawn("p", Pid).pid.call().get(timeout=30).values(), flush=True)
hosts.stop().get(timeout=30)
again = hosts.spawn_procs(per_host={"procs": 1})   # stop keeps the workers
print(again.spawn("p", Pid).pid.call().get(timeout=30).values(), flush=True)
hosts.shutdown().get(timeout=30)
try:
    hosts.spawn_procs(per_host={"procs": 1})
except RuntimeError as exc:
    print("refused:", exc, flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(150)
def test_shutdown_ends_worker_loops_and_stop_keeps_them(tmp_path: Path) -> None:
    secret = tmp_path / "job.secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    env = {**os.environ, "ACTORMESH_SECRET_FILE": str(secret)}
    addresses = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(3)]
    serve = {
        "forever": "import sys; from actormesh.job import run_worker_loop_forever as f; f(address=sys.argv[1])",
        "until": "import sys; from actormesh.job import run_worker_loop_until_shutdown as f; f(address=sys.argv[1]); print('returned', flush=True)",
        "start": ("import sys; from actormesh.actor import start_worker_loop_forever as f; fut = f(address=sys.argv[1]); "
                  "print('serving', flush=True); print('done', fut.get(timeout=120), flush=True)"),
    }
    workers = [subprocess.Popen([sys.executable, "-c", code, a], env=env, stdout=subprocess.PIPE, text=True)
               for code, a in zip(serve.values(), addresses)]
    try:
        assert workers[2].stdout is not None and workers[2].stdout.readline().strip() == "serving"  # returned at once
        script = tmp_path / "shutdown.py"
        script.write_text(_SHUTDOWN)
        out = subprocess.run([sys.executable, str(script), *addresses], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.strip().splitlines()
        assert len(json.loads(lines[0])) == 3 and len(json.loads(lines[1])) == 3
        assert lines[2].startswith("refused:") and "shut down" in lines[2]
        codes = [w.wait(timeout=30) for w in workers]  # shutdown ended all three loops
        assert codes == [0, 0, 0]
        assert workers[1].stdout is not None and workers[1].stdout.read().strip() == "returned"
        assert workers[2].stdout.read().strip() == "done None"
    finally:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGKILL)
                w.wait(timeout=10)


@pytest.mark.timeout(150)
def test_bootstrap_command_and_proc_bind_reach_procs_on_job_hosts() -> None:
    from actormesh.job import ProcessJob

    cpus = sorted(os.sched_getaffinity(0))
    job = ProcessJob({"hosts": 2})
    try:
        hosts = job.state().hosts
        procs = hosts.spawn_procs(
            per_host={"gpus": 2},
            bootstrap_command=lambda p: default_bootstrap_cmd().with_env({"CUDA_VISIBLE_DEVICES": f"{p['hosts']}.{p['gpus']}"}),
            proc_bind=[{"cpus": str(cpus[0])}, {"cpus": str(cpus[-1])}],
        )
        values = procs.spawn("env", Env).probe.call("CUDA_VISIBLE_DEVICES").get(timeout=60).values()
        assert [v[0] for v in values] == ["0.0", "0.1", "1.0", "1.1"]
        assert [v[1] for v in values] == [[cpus[0]], [cpus[-1]]] * 2
        procs.stop().get(timeout=60)
    finally:
        job.kill()
