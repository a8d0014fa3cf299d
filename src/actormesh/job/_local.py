"""Jobs on this machine: ``LocalJob`` (every mesh is ``this_host()``) and
``ProcessJob`` (every host is a host-agent process on its own loopback address)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import sys
from collections.abc import Sequence

from ..mesh import this_host
from ._controller import controller_address, write_secret_file
from ._errors import JobError
from ._job import Job, JobState, check_meshes
from ._join import JoinWaiter, Slot, by_pid
from ._processes import AgentProcess, agent_env, describe, start_agents, stop_agents, terminate_pids

__all__ = ["LocalJob", "ProcessJob"]


class LocalJob(Job):
    """Every named mesh is this machine (``this_host()``): run a job's code locally.

    Example::

        job = LocalJob(hosts=("trainers",))
        procs = job.state().trainers.spawn_procs(per_host={"gpus": 2})
    """

    def __init__(self, hosts: Sequence[str] = ("hosts",)) -> None:
        super().__init__()
        if isinstance(hosts, str):
            hosts = (hosts,)
        check_meshes({name: 1 for name in hosts} if hosts else {})
        self.hosts = tuple(hosts)

    def _create(self) -> None:
        pass

    def _wait_state(self) -> JobState:
        return JobState({name: this_host() for name in self.hosts})

    def _kill(self) -> None:
        pass

    def _is_active(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"LocalJob(hosts={self.hosts!r})"


class ProcessJob(Job):
    """Each host is a local ``python -m actormesh.host`` process listening on its own
    loopback address (127.0.0.2, 127.0.0.3, ...): multi-host behaviour on one machine.

    Agents dial this controller and join; they exit on :meth:`kill`, at
    interpreter exit and when the controller goes away.

    Example::

        job = ProcessJob({"trainers": 2, "generators": 1})
        state = job.state()                      # waits for the 3 agents to join
        procs = state.trainers.spawn_procs(per_host={"gpus": 2})   # {hosts: 2, gpus: 2}
        ...
        procs.stop().get()
        job.kill()
    """

    _transient = ("_agents", "_waiter")

    def __init__(self, meshes: dict[str, int], env: dict[str, str] | None = None, *, join_timeout_s: float = 30.0, python_exe: str = sys.executable) -> None:
        super().__init__()
        self.meshes = check_meshes(meshes)
        self.env = dict(env or {})
        self.join_timeout_s = join_timeout_s
        self.python_exe = python_exe
        self._agents: list[AgentProcess] | None = None
        self._waiter: JoinWaiter | None = None
        self._pids: list[int] = []
        self._job_dir: str | None = None

    def _create(self) -> None:
        from ..runtime import current_runtime

        hosts = _loopback_hosts(sum(self.meshes.values()))
        ctrl = controller_address(need_tcp=False, what=repr(self))
        rt = current_runtime()
        self._job_dir = os.path.join(rt.job_dir, f"job-{self._uid}")
        secret_file = write_secret_file(self._job_dir, rt.secret, tls=rt.tls)
        self._waiter = JoinWaiter(rt)
        base = [self.python_exe, "-m", "actormesh.host", "--secret-file", secret_file, "--controller", ctrl]
        try:
            self._agents = start_agents([(h, [*base, "--address", f"tcp:{h}:0", *self._workspace_args(i)]) for i, h in enumerate(hosts)],
                                        self._job_dir, agent_env(self.env))
        except OSError as exc:
            self._waiter.close()
            raise JobError(f"{self!r}: could not start host agents with {self.python_exe}: {exc}") from exc
        self._pids = [a.popen.pid for a in self._agents]

    def _workspace_args(self, index: int) -> list[str]:
        """Each host its own workspace root, as separate machines would have (unless ``env`` names one)."""
        if "ACTORMESH_WORKSPACE_DIR" in self.env or self._job_dir is None:
            return []
        return ["--workspace-dir", os.path.join(self._job_dir, f"host-{index}", "workspace")]

    def _wait_state(self) -> JobState:
        agents, waiter = self._agents, self._waiter
        if agents is None or waiter is None:
            raise JobError(f"{self!r} was applied by another process; its agents serve that controller only")
        slots = [Slot(a.label, by_pid(a.popen.pid)) for a in agents]

        def check() -> str | None:
            return next((r for r in (a.exit_reason() for a in agents) if r), None)

        try:
            waiter.wait(slots, self.join_timeout_s, what=repr(self), check=check, details=lambda missing: describe(agents, [s.label for s in missing]))
        except JobError:
            self.kill()
            raise
        finally:
            waiter.close()
        return JobState.from_agents(self.meshes, [s.address for s in slots if s.address])

    def _kill(self) -> None:
        if self._waiter is not None:
            self._waiter.close()
        clean = False
        if self._agents is not None:
            stop_agents(self._agents)
            clean = all(a.popen.returncode in (0, -signal.SIGTERM) for a in self._agents)
        elif self._applied_by and self._applied_by[0] == socket.gethostname():
            terminate_pids([p for p in self._pids if _is_agent(p)])  # loaded elsewhere: the agents it recorded
        if self._job_dir is not None:
            if clean:  # nothing to debug: the logs go with the secret
                shutil.rmtree(self._job_dir, ignore_errors=True)
            else:  # the secret goes; the logs of agents that failed stay until the runtime closes
                for path in glob.glob(os.path.join(self._job_dir, "secret-*")):
                    os.unlink(path)
        self._agents = None

    def _is_active(self) -> bool:
        if self._agents is not None:
            return all(a.popen.poll() is None for a in self._agents)
        return bool(self._applied_by and self._applied_by[0] == socket.gethostname() and any(_is_agent(p) for p in self._pids))

    def __repr__(self) -> str:
        return f"ProcessJob({self.meshes!r})"


def _loopback_hosts(count: int) -> list[str]:
    """127.0.0.2, 127.0.0.3, ...; all 127.0.0.1 where only that one is configured (macOS)."""
    if count > 250:
        raise ValueError(f"ProcessJob supports at most 250 hosts on one machine, got {count}")
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
    except OSError:
        return ["127.0.0.1"] * count
    return [f"127.0.0.{i + 2}" for i in range(count)]


def _is_agent(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"actormesh.host" in f.read()
    except OSError:
        return False
