"""``SSHJob``: host agents started over ``ssh`` on machines you can log in to.

Each host runs, through ``ssh HOST sh -c '<wrapper>'``, a small POSIX shell
wrapper that reads the job secret as one line from ssh's stdin into a 0600
file in a fresh private temp directory (the secret is never in argv or the
environment), starts ``python -m actormesh.host`` and keeps reading stdin:
when stdin ends (``kill()``, or this controller gone) it stops the agent and
removes the directory.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence

from ._controller import controller_address, is_loopback
from ._errors import JobError
from ._job import Job, JobState, check_meshes
from ._join import JoinWaiter, Slot, host_of
from ._processes import AgentProcess, agent_env, describe, start_agents, stop_agents

__all__ = ["SSHJob"]

_WRAPPER = """umask 077
d=$(mktemp -d "${TMPDIR:-/tmp}/actormesh-XXXXXX") || exit 1
pid=
trap 'rm -rf "$d"' EXIT
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; exit 143' HUP INT TERM
IFS= read -r s || { echo "actormesh: no job secret on stdin" >&2; exit 1; }
printf '%s\\n' "$s" > "$d/secret"
s=
exec 3<&0
AGENT --secret-file "$d/secret" </dev/null &
pid=$!
{ cat <&3; kill $pid; } >/dev/null 2>&1 &
wait $pid
"""


class SSHJob(Job):
    """Host agents on remote machines, started with ``ssh``.

    ``hosts`` is a list of ssh targets (``"gpu1"``, ``"me@10.0.0.5"``) for one
    mesh named ``hosts``, or a dict ``{mesh name: [targets]}``. Each agent
    listens on ``tcp:<bind_host>:<agent_port>``; ``bind_host`` defaults to the
    target's host part, so it must be an address or name that resolves on that
    machine to an interface this controller can reach (pass ``bind_host="0.0.0.0"``
    to advertise the machine's own host name instead). The remote ``python``
    must have actormesh installed; ``env`` is set for the agent (it appears in
    the remote command line: no secrets there). The controller listens on TCP
    (set up automatically if the runtime has not started).

    Example::

        job = SSHJob(["gpu1", "gpu2"], python="/opt/venv/bin/python")
        procs = job.state().hosts.spawn_procs(per_host={"gpus": 8})
    """

    _transient = ("_agents", "_waiter")

    def __init__(
        self,
        hosts: Sequence[str] | dict[str, Sequence[str]],
        python: str = "python3",
        *,
        ssh: str = "ssh",
        ssh_args: Sequence[str] = ("-T", "-o", "BatchMode=yes"),
        bind_host: str | None = None,
        agent_port: int = 0,
        env: dict[str, str] | None = None,
        join_timeout_s: float = 60.0,
    ) -> None:
        super().__init__()
        if isinstance(hosts, str):
            raise TypeError(f"hosts must be a list of ssh targets, not one string: use [{hosts!r}]")
        groups = {k: list(v) for k, v in hosts.items()} if isinstance(hosts, dict) else {"hosts": list(hosts)}
        check_meshes({k: len(v) for k, v in groups.items()})
        self.hosts = groups
        self.python = python
        self.ssh = ssh
        self.ssh_args = tuple(ssh_args)
        self.bind_host = bind_host
        self.agent_port = agent_port
        self.env = dict(env or {})
        self.join_timeout_s = join_timeout_s
        self._agents: list[AgentProcess] | None = None
        self._waiter: JoinWaiter | None = None
        self._log_dir: str | None = None

    def _targets(self) -> list[tuple[str, str]]:
        """(ssh target, bind host) per host, in mesh order."""
        out = []
        for targets in self.hosts.values():
            for t in targets:
                out.append((t, self.bind_host or t.rsplit("@", 1)[-1]))
        return out

    def remote_command(self, bind_host: str, controller: str) -> str:
        """The command line ``ssh`` runs on a host (the secret comes on stdin)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        agent = " ".join(shlex.quote(a) for a in [self.python, "-m", "actormesh.host", "--address", f"tcp:{bind_host}:{self.agent_port}", "--controller", controller])
        script = _WRAPPER.replace("AGENT", f"{env} {agent}".strip())
        return "sh -c " + shlex.quote(script)

    def _create(self) -> None:
        from ..runtime import current_runtime

        targets = self._targets()
        local_only = all(is_loopback(b) for _, b in targets)
        ctrl = controller_address(need_tcp=not local_only, what=repr(self))
        rt = current_runtime()
        self._log_dir = os.path.join(rt.job_dir, f"job-{self._uid}")
        os.makedirs(self._log_dir, mode=0o700, exist_ok=True)
        self._waiter = JoinWaiter(rt)
        commands = [(t, [self.ssh, *self.ssh_args, t, self.remote_command(b, ctrl)]) for t, b in targets]
        try:
            self._agents = start_agents(commands, self._log_dir, agent_env(), stdin_data=rt.secret.hex().encode() + b"\n")
        except OSError as exc:
            self._waiter.close()
            raise JobError(f"{self!r}: could not run {self.ssh!r}: {exc}") from exc

    def _wait_state(self) -> JobState:
        agents, waiter = self._agents, self._waiter
        if agents is None or waiter is None:
            raise JobError(f"{self!r} was applied by another process; its agents serve that controller only")
        wildcard = self.bind_host in ("0.0.0.0", "::")
        slots = [Slot(t, lambda address, host, pid, b=b: not wildcard and host_of(address) == b) for t, b in self._targets()]

        def check() -> str | None:
            return next((r for r in (a.exit_reason() for a in agents) if r), None)

        try:
            waiter.wait(
                slots,
                self.join_timeout_s,
                what=repr(self),
                check=check,
                details=lambda missing: describe(agents, [s.label for s in missing]),
                any_order=wildcard,
            )
        except JobError:
            self.kill()
            raise
        finally:
            waiter.close()
        return JobState.from_agents({k: len(v) for k, v in self.hosts.items()}, [s.address for s in slots if s.address])

    def _kill(self) -> None:
        if self._waiter is not None:
            self._waiter.close()
        if self._agents is not None:
            stop_agents(self._agents)
        self._agents = None

    def _is_active(self) -> bool:
        return self._agents is not None and all(a.popen.poll() is None for a in self._agents)

    def __repr__(self) -> str:
        return f"SSHJob({self.hosts!r})"
