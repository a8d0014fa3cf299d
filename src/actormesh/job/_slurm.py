"""``SlurmJob``: host agents started by one ``sbatch`` job, one per node.

The batch script runs ``srun python -m actormesh.job._agent --controller ADDR
--secret-file FILE`` (one task per node): ``python -m actormesh.host`` listening
on the node's address on the route to the controller. The secret file and
the script live in ``state_dir`` (mode 0700, the file 0600), which must be on a
filesystem the nodes share with the submitting host (the default,
``./.actormesh/`` under the current directory, usually is). Agents announce
themselves with their host name and are matched to the allocation's nodes
(``scontrol show hostnames``), so meshes are filled in node order.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence

from ._controller import controller_address, write_secret_file
from ._errors import JobError
from ._job import Job, JobState, check_meshes
from ._join import JoinWaiter, Slot, by_host_name
from ._processes import agent_env, log_tail
from ._progress import Progress

__all__ = ["SlurmJob"]

_ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "RESIZING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}


class SlurmJob(Job):
    """Hosts from a Slurm allocation: ``meshes`` maps mesh names to node counts.

    ``apply()`` submits one batch job of ``sum(meshes.values())`` nodes;
    ``state()`` waits (``job_start_timeout`` seconds for the job to start,
    then ``join_timeout_s`` for the agents) and fills the meshes in node order;
    ``kill()`` runs ``scancel``. The controller must listen where the nodes can
    reach it: it is set up for TCP on ``0.0.0.0`` (advertised under this
    machine's host name) if the runtime has not started; otherwise call
    ``actormesh.config.configure(default_transport="tcp", bind_host=...)`` first.
    ``python_exe`` must run actormesh on the nodes.

    Example::

        job = SlurmJob({"trainers": 2}, partition="gpu", time_limit="00:30:00", gpus_per_node=8)
        procs = job.state().trainers.spawn_procs(per_host={"gpus": 8})
    """

    _transient = ("_waiter",)

    def __init__(
        self,
        meshes: dict[str, int],
        python_exe: str = sys.executable,
        slurm_args: Sequence[str] = (),
        job_name: str = "actormesh",
        time_limit: str | None = None,
        partition: str | None = None,
        log_dir: str | None = None,
        job_start_timeout: float = 60.0,
        *,
        gpus_per_node: int | None = None,
        cpus_per_task: int | None = None,
        mem: str | None = None,
        account: str | None = None,
        qos: str | None = None,
        exclusive: bool = False,
        agent_port: int = 0,
        state_dir: str | None = None,
        join_timeout_s: float = 60.0,
    ) -> None:
        super().__init__()
        self.meshes = check_meshes(meshes)
        self.python_exe = python_exe
        self.slurm_args = tuple(slurm_args)
        self.job_name = job_name
        self.time_limit = time_limit
        self.partition = partition
        self.log_dir = log_dir
        self.job_start_timeout = job_start_timeout
        self.gpus_per_node = gpus_per_node
        self.cpus_per_task = cpus_per_task
        self.mem = mem
        self.account = account
        self.qos = qos
        self.exclusive = exclusive
        self.agent_port = agent_port
        self.state_dir = state_dir
        self.join_timeout_s = join_timeout_s
        self._waiter: JoinWaiter | None = None
        self._job_id: str | None = None
        self._dir: str | None = None
        self._nodes: list[str] = []
        self._log = ""

    @property
    def job_id(self) -> str | None:
        """The Slurm job id once applied."""
        return self._job_id

    @property
    def nodes(self) -> list[str]:
        """The allocation's node names in order, once ``state()`` returned."""
        return list(self._nodes)

    def sbatch_args(self) -> list[str]:
        """The ``sbatch`` options this job submits with (before ``slurm_args``)."""
        args = ["--parsable", f"--job-name={self.job_name}", f"--nodes={sum(self.meshes.values())}", "--ntasks-per-node=1"]
        for flag, value in (("--time", self.time_limit), ("--partition", self.partition), ("--cpus-per-task", self.cpus_per_task),
                            ("--mem", self.mem), ("--account", self.account), ("--qos", self.qos), ("--gpus-per-node", self.gpus_per_node)):
            if value is not None:
                args.append(f"{flag}={value}")
        if self.exclusive:
            args.append("--exclusive")
        return args

    def batch_script(self, controller: str, secret_file: str) -> str:
        """The batch script: one host agent per node, dialing ``controller``."""
        agent = [self.python_exe, "-m", "actormesh.job._agent", "--port", str(self.agent_port), "--controller", controller, "--secret-file", secret_file]
        return (
            "#!/bin/sh\n"
            "# Generated by actormesh.job.SlurmJob: one host agent per node; each dials the controller.\n"
            f"exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 {' '.join(shlex.quote(a) for a in agent)}\n"
        )

    def _create(self) -> None:
        from ..runtime import current_runtime

        ctrl = controller_address(need_tcp=True, what=repr(self))
        rt = current_runtime()
        self._dir = os.path.abspath(os.path.join(self.state_dir or os.path.join(".actormesh", "slurm"), f"{self.job_name}-{self._uid}"))
        secret_file = write_secret_file(self._dir, rt.secret, tls=rt.tls)
        script = os.path.join(self._dir, "agents.sbatch")
        with open(script, "w") as f:
            f.write(self.batch_script(ctrl, secret_file))
        log_dir = os.path.abspath(self.log_dir or self._dir)
        os.makedirs(log_dir, exist_ok=True)
        self._waiter = JoinWaiter(rt)
        argv = ["sbatch", *self.sbatch_args(), f"--output={log_dir}/slurm-%j.out", *self.slurm_args, script]
        try:
            out = _run(argv, self)
        except JobError:
            self._waiter.close()
            raise
        self._job_id = out.strip().split(";")[0]
        self._log = os.path.join(log_dir, f"slurm-{self._job_id}.out")

    def _info(self) -> dict[str, str]:
        """``scontrol show job`` as a dict; JobState GONE once Slurm forgot the job,
        UNKNOWN when ``scontrol`` cannot be run."""
        try:
            r = subprocess.run(["scontrol", "show", "job", "--oneliner", str(self._job_id)], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"JobState": "UNKNOWN", "Reason": f"scontrol failed: {exc}"}
        if r.returncode != 0:
            return {"JobState": "GONE", "Reason": r.stderr.strip()}
        return dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)

    def _wait_state(self) -> JobState:
        waiter = self._waiter
        if waiter is None or self._job_id is None:
            raise JobError(f"{self!r} was applied by another process; its agents serve that controller only")
        try:
            nodes = self._wait_running()
            slots = [Slot(n, by_host_name(n)) for n in nodes]

            def check() -> str | None:
                info = self._info()
                return None if info.get("JobState") == "RUNNING" else f"Slurm job {self._job_id} is {info.get('JobState')}, reason {info.get('Reason')}"

            waiter.wait(slots, self.join_timeout_s, what=repr(self), check=check, details=lambda missing: self._log_block(), any_order=True, poll_s=0.5)
        except BaseException:
            self.kill()
            raise
        finally:
            waiter.close()
        self._nodes = nodes
        return JobState.from_agents(self.meshes, [s.address for s in slots if s.address])

    def _wait_running(self) -> list[str]:
        """Wait (``job_start_timeout``) for the job to run; its node names, in order."""
        deadline = time.monotonic() + self.job_start_timeout
        with Progress(f"waiting for Slurm job {self._job_id} to start") as progress:
            while True:
                info = self._info()
                state = info.get("JobState", "?")
                if state == "RUNNING" and info.get("NodeList") not in (None, "", "(null)"):
                    hostnames = _run(["scontrol", "show", "hostnames", info["NodeList"]], self)
                    return hostnames.split()
                if state not in _ACTIVE:
                    raise JobError(f"{self!r}: Slurm job {self._job_id} ended before its hosts joined: {state}, reason {info.get('Reason')}\n{self._log_block()}")
                progress.update(f"{state} ({info.get('Reason', '')})")
                if time.monotonic() > deadline:
                    raise JobError(
                        f"{self!r}: Slurm job {self._job_id} did not start within job_start_timeout={self.job_start_timeout:g}s: "
                        f"{state}, reason {info.get('Reason')}. Ask for fewer or smaller nodes, another partition, or a longer job_start_timeout."
                    )
                time.sleep(0.25)  # polling the scheduler; bounded by the deadline above

    def _log_block(self) -> str:
        """The batch log's path and last lines (agents' output goes there)."""
        return "\n".join([f"  batch log {self._log}", *(f"      {line}" for line in log_tail(self._log))])

    def _kill(self) -> None:
        if self._waiter is not None:
            self._waiter.close()
        if self._job_id is None:
            return
        try:
            _run(["scancel", str(self._job_id)], self)
        except JobError:
            if self._is_active():
                raise
        deadline = time.monotonic() + 30
        while self._info().get("JobState") in _ACTIVE | {"COMPLETING"} and time.monotonic() < deadline:
            time.sleep(0.1)  # scancel is asynchronous: wait (bounded) until the agents are gone
        if self._dir is not None:
            for name in os.listdir(self._dir) if os.path.isdir(self._dir) else ():
                if name.startswith("secret-"):
                    os.unlink(os.path.join(self._dir, name))

    def _is_active(self) -> bool:
        return self._job_id is not None and self._info().get("JobState") in _ACTIVE

    def __repr__(self) -> str:
        return f"SlurmJob({self.meshes!r}{f', job {self._job_id}' if self._job_id else ''})"


def _run(argv: list[str], job: SlurmJob) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=agent_env())
    except FileNotFoundError:
        raise JobError(f"{job!r}: {argv[0]} not found: run this on a machine with the Slurm client commands on PATH") from None
    except subprocess.TimeoutExpired:
        raise JobError(f"{job!r}: {' '.join(argv[:2])} did not answer within 60s (is slurmctld up?)") from None
    if r.returncode != 0:
        raise JobError(f"{job!r}: {' '.join(argv[:3])} failed (exit {r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout
