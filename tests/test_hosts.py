"""Host agents: remote-style host meshes, log forwarding, and hosts in their
own network namespaces so traffic really crosses interfaces."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import bridged_namespaces

from actormesh.actor import Actor, endpoint
from actormesh.errors import ActorDiedError, SupervisionError
from actormesh.mesh import HostMesh
from actormesh.runtime import current_runtime


class Where(Actor):
    @endpoint
    def where(self) -> tuple[int, str]:
        return (os.getpid(), os.readlink("/proc/self/ns/net"))

    @endpoint
    def say(self, text: str) -> None:
        print(text, flush=True)

    @endpoint
    def ask(self, other) -> list[int]:
        return [pid for pid, _ in other.where.call().get(timeout=20).values()]


class Crasher(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def exit(self, code: int) -> None:
        os._exit(code)

    @endpoint
    def nap(self, seconds: float) -> None:
        time.sleep(seconds)


def _env_with_tests() -> dict[str, str]:
    here = os.path.dirname(os.path.abspath(__file__))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))


@pytest.fixture
def agents(tmp_path):
    """Two host agents on this machine (unix sockets), stopped after the test."""
    rt = current_runtime()
    secret = tmp_path / "secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, rt.secret.hex().encode())
    os.close(fd)
    procs = []
    addresses = []
    try:
        for i in range(2):
            p = subprocess.Popen(
                [sys.executable, "-m", "actormesh.host", "--address", f"unix:{tmp_path}/agent{i}.sock", "--secret-file", str(secret), "--print-address"],
                stdout=subprocess.PIPE,
                text=True,
                env=_env_with_tests(),  # like a real host: user code must be importable there
            )
            procs.append(p)
            addresses.append(p.stdout.readline().strip())
        yield addresses
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=20)


def test_host_mesh_over_agents(agents):
    hosts = HostMesh(agents=agents)
    assert hosts.initialized.get(timeout=20)
    assert dict(hosts.extent) == {"hosts": 2}
    info = hosts.host_info().get(timeout=30)  # one row per agent, in host order
    assert [row["address"] for row in info] == list(agents) and len({row["pid"] for row in info}) == 2
    procs = hosts.spawn_procs(per_host={"gpus": 2})
    try:
        assert dict(procs.extent) == {"hosts": 2, "gpus": 2}
        w = procs.spawn("w", Where)
        pids = [pid for pid, _ in w.where.call().get(timeout=30).values()]
        assert len(set(pids)) == 4
        # procs talk to each other directly, across hosts
        assert w.slice(hosts=0, gpus=0).ask.call_one(w.slice(hosts=1)).get(timeout=30) == pids[2:]
        # slicing by host
        assert [p for p, _ in w.slice(hosts=1).where.call().get(timeout=30).values()] == pids[2:]
    finally:
        procs.stop().get(timeout=30)


def test_log_forwarding_prefixes_and_aggregates(agents, capfd):
    procs = HostMesh(agents=agents).spawn_procs(per_host={"gpus": 2})
    try:
        w = procs.spawn("w", Where)
        asyncio.run(procs.logging_option(stream_to_client=True, aggregate_window_sec=None))
        w.slice(hosts=1, gpus=0).say.call_one("only-from-rank-2").get(timeout=30)
        asyncio.run(procs.logging_option(stream_to_client=True, aggregate_window_sec=30))
        w.say.call("same line everywhere").get(timeout=30)
    finally:
        procs.stop().get(timeout=30)  # stop() flushes the aggregation window
        from actormesh.mesh._logs import sink

        sink.configure(False, None)
    out = capfd.readouterr().out
    assert "[2 " in out and "only-from-rank-2" in out
    assert "[4 similar log lines] same line everywhere" in out


_NETNS_CONTROLLER = textwrap.dedent(
    """
    import os, subprocess, sys
    from actormesh import config
    net = sys.argv[2]
    config.configure(default_transport="tcp", bind_host=f"{net}.1")
    from actormesh.mesh import HostMesh
    from actormesh.runtime import current_runtime
    sys.path.insert(0, sys.argv[1])
    from test_hosts import Where

    rt = current_runtime()
    secret = os.path.join(rt.job_dir, "secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, rt.secret.hex().encode()); os.close(fd)
    agents, addrs = [], []
    try:
        for i, ns in enumerate(sys.argv[3:]):
            p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "actormesh.host", "--address",
                                  f"tcp:{net}.{11 + i}:0", "--secret-file", secret, "--print-address"], stdout=subprocess.PIPE, text=True,
                                 env=dict(os.environ, PYTHONPATH=sys.argv[1]))
            agents.append(p)
            addrs.append(p.stdout.readline().strip())
        procs = HostMesh(agents=addrs).spawn_procs(per_host={"gpus": 1})
        w = procs.spawn("w", Where)
        got = w.where.call().get(timeout=60).values()
        assert len({ns for _, ns in got} | {os.readlink("/proc/self/ns/net")}) == 3, got
        assert w.slice(hosts=0).ask.call_one(w.slice(hosts=1)).get(timeout=60) == [got[1][0]]
        procs.stop().get(timeout=60)
        print("ok", addrs)
    finally:
        for p in agents:
            p.terminate()
            p.wait(timeout=30)
    """
)


def test_agents_in_separate_network_namespaces(tmp_path):
    with bridged_namespaces(2, "am") as net:
        script = tmp_path / "controller.py"
        script.write_text(_NETNS_CONTROLLER)
        out = subprocess.run([sys.executable, str(script), os.path.dirname(__file__), net.net, *net.namespaces], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.startswith("ok")


_DEPARTING_CONTROLLER = """
import json, os, sys
from actormesh.actor import Actor, endpoint
from actormesh.mesh import HostMesh
from actormesh.runtime import current_runtime

class Pid(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

with open(sys.argv[2]) as f:
    current_runtime(secret=bytes.fromhex(f.read().strip()))
procs = HostMesh(agents=[sys.argv[1]]).spawn_procs(per_host={"gpus": 2})
print(json.dumps(procs.spawn("p", Pid).pid.call().get(timeout=30).values()), flush=True)
sys.stdin.readline()  # the test kills us here
"""


def test_an_agent_stops_the_procs_of_a_controller_that_died(agents, tmp_path):
    """An agent without --controller serves one controller after another; a dead one's procs must go."""
    import json
    import signal

    import psutil

    script = tmp_path / "controller.py"
    script.write_text(_DEPARTING_CONTROLLER)
    ctl = subprocess.Popen([sys.executable, str(script), agents[0], str(tmp_path / "secret")],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        line = ctl.stdout.readline()
        assert line, "the controller printed nothing"
        pids = json.loads(line)
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=10)
        watched = []
        for p in pids:
            try:
                watched.append(psutil.Process(p))
            except psutil.NoSuchProcess:
                pass  # already stopped by the agent: what we want
        gone, alive = psutil.wait_procs(watched, timeout=20)
        assert not alive, f"procs {[p.pid for p in alive]} outlived their controller"
        # The agent itself stays and serves the next controller.
        hosts = HostMesh(agents=agents)
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        try:
            assert len(procs.spawn("w", Where).where.call().get(timeout=30).values()) == 2
        finally:
            procs.stop().get(timeout=30)
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait(timeout=10)
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def test_a_remote_proc_that_dies_fails_its_callers_with_how_it_ended(agents):
    """Its connection closes as its agent sees it exit: the caller waits for the agent's
    word (the exit code, the signal) instead of failing with "lost connection"."""
    procs = HostMesh(agents=agents[:1]).spawn_procs(per_host={"gpus": 2})
    try:
        c = procs.spawn("c", Crasher)
        pids = list(c.pid.call().get(timeout=30).values())
        with pytest.raises(ActorDiedError, match="exited with non-zero code 3"):
            c.slice(gpus=0).exit.call_one(3).get(timeout=30)
        nap = c.slice(gpus=1).nap.call_one(60)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(ActorDiedError, match=r"Killed\(sig=9\)"):
            nap.get(timeout=30)
    finally:
        procs.stop().get(timeout=30)


def test_calls_to_the_procs_of_an_agent_that_died_fail_at_once(agents):
    """Nobody will report how they ended: their calls fail when the agent is lost,
    not after the wait for its report (2 * heartbeat_timeout + 5 s)."""
    hosts = HostMesh(agents=agents[1:])
    agent_pid = hosts.host_info().get(timeout=30)[0]["pid"]
    procs = hosts.spawn_procs(per_host={"gpus": 1})
    c = procs.spawn("c", Crasher)
    c.pid.call().get(timeout=30)
    nap = c.nap.call_one(60)
    t0 = time.monotonic()
    os.kill(agent_pid, signal.SIGKILL)  # its procs die with it
    with pytest.raises(SupervisionError):
        nap.get(timeout=30)
    assert time.monotonic() - t0 < 2 * current_runtime().config.heartbeat_timeout + 5
    try:
        procs.stop().get(timeout=30)
    except Exception:
        pass  # their agent is gone: nothing left to stop
