"""``SSHJob``: host agents started over ``ssh`` on machines you can log in to.

Each host runs, through ``ssh HOST sh -c '<wrapper>'``, a small POSIX shell
wrapper that reads the job secret as one line from ssh's stdin into a 0600
file in a fresh private temp directory (the secret is never in argv or the
environment), starts ``python -m actormesh.host`` and keeps reading stdin:
when stdin ends (``kill()``, or this controller gone) it stops the agent
(SIGTERM, then SIGKILL after 5 s) and removes the directory.
"""

from __future__ import annotations

import os
import shlex
import socket
from collections.abc import Callable, Sequence

from ..host import format_credentials
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
stop() { kill $pid; i=0; while kill -0 $pid && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done; kill -9 $pid; }
trap '[ -n "$pid" ] && stop >/dev/null 2>&1; exit 143' HUP INT TERM
IFS= read -r s || { echo "actormesh: no job secret on stdin" >&2; exit 1; }
printf '%s\\n' "$s" > "$d/secret"
s=
exec 3<&0
AGENT --secret-file "$d/secret" </dev/null &
pid=$!
{ cat <&3; stop; } >/dev/null 2>&1 &
wait $pid
"""


class SSHJob(Job):
    """Host agents on remote machines, started with ``ssh``.

    ``hosts`` is a list of ssh targets (``"gpu1"``, ``"me@10.0.0.5"``) for one
    mesh named ``hosts``, or a dict ``{mesh name: [targets]}``. Each agent
    listens on ``agent_port`` (default: any free port) at ``bind_host``: by
    default the target itself when it is an IP address, else the remote
    machine's address on its route to this controller. The remote ``python``
    must have actormesh installed; ``env`` is set for the agent (it appears in
    the remote command line: no secrets there). The controller listens on TCP
    (set up automatically if the runtime has not started) unless every target
    is a loopback address.

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
        if bind_host in ("0.0.0.0", "::", "*"):
            raise ValueError("bind_host must be an address the controller can dial; leave it None to use the one on the route to the controller")
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

    def _targets(self) -> list[tuple[str, str | None]]:
        """(ssh target, bind address or None for the route to the controller) per host, in mesh order."""
        out = []
        for targets in self.hosts.values():
            for t in targets:
                host = t.rsplit("@", 1)[-1]
                out.append((t, self.bind_host or (host if _is_ip(host) else None)))
        return out

    def remote_command(self, bind_host: str | None, controller: str) -> str:
        """The command line ``ssh`` runs on a host (the secret comes on stdin)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        argv = [self.python, "-m", "actormesh.job._agent", "--controller", controller, "--port", str(self.agent_port)]
        if bind_host:
            argv += ["--bind", bind_host]
        script = _WRAPPER.replace("AGENT", f"{env} {' '.join(shlex.quote(a) for a in argv)}".strip())
        return "sh -c " + shlex.quote(script)

    def _create(self) -> None:
        from ..runtime import current_runtime

        targets = self._targets()
        local_only = all(b is not None and is_loopback(b) for _, b in targets)
        ctrl = controller_address(need_tcp=not local_only, what=repr(self))
        rt = current_runtime()
        self._log_dir = os.path.join(rt.job_dir, f"job-{self._uid}")
        os.makedirs(self._log_dir, mode=0o700, exist_ok=True)
        self._waiter = JoinWaiter(rt)
        commands = [(t, [self.ssh, *self.ssh_args, t, self.remote_command(b, ctrl)]) for t, b in targets]
        try:
            self._agents = start_agents(commands, self._log_dir, agent_env(), stdin_data=format_credentials(rt.secret, rt.tls).encode() + b"\n")
        except OSError as exc:
            self._waiter.close()
            raise JobError(f"{self!r}: could not run {self.ssh!r}: {exc}") from exc

    def _wait_state(self) -> JobState:
        agents, waiter = self._agents, self._waiter
        if agents is None or waiter is None:
            raise JobError(f"{self!r} was applied by another process; its agents serve that controller only")
        slots = [Slot(t, _matcher(t, b)) for t, b in self._targets()]

        def check() -> str | None:
            return next((r for r in (a.exit_reason() for a in agents) if r), None)

        try:
            waiter.wait(
                slots,
                self.join_timeout_s,
                what=repr(self),
                check=check,
                details=lambda missing: describe(agents, [s.label for s in missing]),
                any_order=True,
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


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host.strip("[]"))
        return True
    except OSError:
        return False


def _matcher(target: str, bind: str | None) -> Callable[[str, str, int], bool]:
    """Whether an announcement comes from ``target``: by its bind address, else by
    the addresses its name resolves to here, else by its reported host name."""
    host = target.rsplit("@", 1)[-1]
    if bind is not None:
        return lambda address, hostname, pid: host_of(address) == bind.strip("[]")
    try:
        ips = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        ips = set()
    short = host.split(".")[0]
    return lambda address, hostname, pid: host_of(address) in ips or hostname.split(".")[0] == short
