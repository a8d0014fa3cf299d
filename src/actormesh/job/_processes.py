"""Host agents started as local child processes (``ProcessJob``, and ``SSHJob``'s
``ssh`` clients): their logs, their liveness while the controller waits for
them to join, and their end (``terminate``, and at interpreter exit)."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

__all__ = ["AgentProcess", "start_agents", "stop_agents", "terminate_pids", "log_tail", "agent_env"]

_running: set[AgentProcess] = set()
_lock = threading.Lock()


@dataclass(eq=False)
class AgentProcess:
    """One local child process that runs (or reaches) a host agent."""

    label: str
    popen: subprocess.Popen[bytes]
    log_path: str

    def exit_reason(self) -> str | None:
        """``"the agent for H exited with code N"`` once it is gone, else None."""
        if self.popen.poll() is None:
            return None
        return f"the agent for {self.label} {self.status()}"

    def status(self) -> str:
        """How it stands: exited (code or signal), or running."""
        code = self.popen.poll()
        if code is None:
            return "is running but has not joined"
        return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def agent_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for agents started from this interpreter: this one's plus
    ``extra``, with ``PYTHONPATH`` set so that they (and the procs they spawn)
    import what this controller imports: actormesh, and the modules actor
    classes live in (classes from ``__main__`` travel by value anyway)."""
    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [pkg_parent, *(p for p in sys.path if p and os.path.isdir(p)), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    env.update(extra or {})
    return env


def start_agents(commands: Sequence[tuple[str, list[str]]], log_dir: str, env: dict[str, str], stdin_data: bytes | None = None) -> list[AgentProcess]:
    """Start ``(label, argv)`` processes, stdout and stderr to ``log_dir/agent-<i>.log``.

    With ``stdin_data``, it is written to each one's stdin, which stays open:
    closing it (:func:`stop_agents`, or this process ending) tells an ``ssh``
    wrapper to stop its agent. On a failure to start, those started are stopped.
    """
    started: list[AgentProcess] = []
    try:
        for i, (label, argv) in enumerate(commands):
            log_path = os.path.join(log_dir, f"agent-{i}.log")
            with open(log_path, "wb") as log:
                popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    close_fds=True,
                )
            agent = AgentProcess(label, popen, log_path)
            with _lock:
                _running.add(agent)
            started.append(agent)
            if stdin_data is not None:
                _feed(popen.stdin, stdin_data)
    except BaseException:
        stop_agents(started)
        raise
    return started


def _feed(stdin: IO[bytes] | None, data: bytes) -> None:
    assert stdin is not None
    try:
        stdin.write(data)
        stdin.flush()
    except BrokenPipeError:
        pass  # it died at once: exit_reason() tells why


def stop_agents(agents: Sequence[AgentProcess], grace_s: float = 5.0) -> None:
    """Stop agents and reap them: close their stdin (an ``ssh`` wrapper's signal to
    stop) and wait, then SIGTERM, then SIGKILL, ``grace_s`` apart."""
    waiting = [a for a in agents if a.popen.stdin is not None and not a.popen.stdin.closed]
    for a in waiting:
        try:
            a.popen.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
    _wait_all(waiting, grace_s)
    for a in agents:
        if a.popen.poll() is None:
            try:
                a.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    _wait_all(agents, grace_s)
    for a in agents:
        if a.popen.poll() is None:
            a.popen.kill()
            a.popen.wait(timeout=5)
        with _lock:
            _running.discard(a)


def terminate_pids(pids: Sequence[int], grace_s: float = 5.0) -> None:
    """SIGTERM processes that are not our children, SIGKILL those left after ``grace_s``.

    (A host agent can miss a SIGTERM that lands on a thread other than its main one.)
    """
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if _exists(p)]
        if left:
            time.sleep(0.05)  # polling processes we cannot wait() on; bounded by the deadline
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_all(agents: Sequence[AgentProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for a in agents:
        try:
            a.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def log_tail(path: str, lines: int = 6) -> list[str]:
    """The last ``lines`` lines of a log file ([] if unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


def _stop_all_at_exit() -> None:
    with _lock:
        agents = list(_running)
    stop_agents(agents, grace_s=2.0)


atexit.register(_stop_all_at_exit)


def describe(agents: Sequence[AgentProcess], labels: Any) -> str:
    """For each agent in ``labels``: how it stands, its log file and the log's last lines."""
    wanted = set(labels)
    lines = []
    for a in agents:
        if a.label in wanted:
            lines.append(f"  {a.label}: {a.status()}; log {a.log_path}")
            lines.extend(f"      {line}" for line in log_tail(a.log_path))
    return "\n".join(lines)
