"""``exec_command``: run a command on every host (or proc) of a host mesh (Monarch's).

A proc is started per host (or ``per_host`` procs per host); in each, an actor
runs the command as a child process and returns its exit status. Output goes
to the caller's terminal through the proc's forwarded stdout/stderr, or to
files on the hosts with ``output_dir``. The procs are stopped before the
Future completes. ``cmd[0]`` ending in ``.py``, or ``cmd[0] == "-m"``, runs
with the proc's Python interpreter.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..mesh import HostMesh
from ..runtime import Actor, Future, endpoint

__all__ = ["exec_command"]


class _CommandRunner(Actor):
    """Runs one command in its proc and returns the exit status."""

    @endpoint
    def run(self, cmd: list[str], env: dict[str, str], workdir: str, output_dir: str | None, subdir: str | None,
            timeout_s: float | None) -> int:
        argv = [sys.executable, *cmd] if cmd[0].endswith(".py") or cmd[0] == "-m" else list(cmd)
        out = err = None
        try:
            if output_dir is not None:
                where = os.path.join(output_dir, subdir) if subdir else output_dir
                os.makedirs(where, exist_ok=True)
                out = open(os.path.join(where, "stdout.txt"), "wb")
                err = open(os.path.join(where, "stderr.txt"), "wb")
            try:
                child = subprocess.Popen(argv, cwd=workdir, env={**os.environ, **env}, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
            except OSError as exc:
                raise RuntimeError(f"exec_command: cannot start {argv[0]!r} in {workdir!r}: {exc}") from None
            try:
                return child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(timeout=10)
                raise TimeoutError(f"exec_command: {argv!r} did not finish within {timeout_s}s and was killed") from None
        finally:
            for f in (out, err):
                if f is not None:
                    f.close()


def _check(host_mesh: Any, cmd: Any, env: Any, rank: Any, point: Any, per_host: Any, timeout_s: Any) -> None:
    if not isinstance(host_mesh, HostMesh):
        raise TypeError(f"exec_command() needs a HostMesh (e.g. job.state().trainers), got {host_mesh!r}")
    if isinstance(cmd, str) or not isinstance(cmd, Sequence) or not cmd or not all(isinstance(c, str) for c in cmd):
        raise TypeError(f"cmd must be a non-empty list of str like ['nvidia-smi'], got {cmd!r}")
    if env is not None and (not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise TypeError(f"env must be a dict of str to str, got {env!r}")
    if rank is not None and point is not None:
        raise ValueError("give rank or point, not both")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"rank must be an int >= 0, got {rank!r}")
    if point is not None and not isinstance(point, Mapping):
        raise TypeError(f"point must be a dict of dimension -> index, got {point!r}")
    if per_host is not None and not isinstance(per_host, Mapping):
        raise TypeError(f"per_host must be a dict like {{'gpus': 4}}, got {per_host!r}")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


def exec_command(host_mesh: HostMesh, cmd: list[str], env: dict[str, str] | None = None, workdir: str | None = None,
                 output_dir: str | None = None, rank: int | None = None, point: dict[str, int] | None = None,
                 per_host: dict[str, int] | None = None, *, timeout_s: float | None = None) -> Future[int]:
    """Run ``cmd`` on ``host_mesh``; the Future gives the largest exit status over all ranks (0: all succeeded).

    The work starts before this returns (dropping the Future does not cancel
    it). ``rank`` picks one flat rank, ``point`` a coordinate slice
    (``{"hosts": 1}``). ``workdir`` defaults to this process's working
    directory. ``timeout_s`` (actormesh's addition) kills commands still
    running after that long. Example::

        code = exec_command(state.trainers, ["nvidia-smi"]).get()
    """
    _check(host_mesh, cmd, env, rank, point, per_host, timeout_s)
    if point is not None:
        target = host_mesh.slice(**point)
    elif rank is not None:
        flat = host_mesh.flatten("rank")
        if rank >= flat.size():
            raise IndexError(f"rank {rank} out of range: the host mesh has {flat.size()} hosts")
        target = flat.slice(rank=rank)
    else:
        target = host_mesh
    procs = target.spawn_procs(per_host=dict(per_host) if per_host else None, name="exec")
    per = math.prod(per_host.values()) if per_host else 1
    runners: Any = procs.spawn("exec_command", _CommandRunner)  # an ActorMesh (spawn is typed as returning the class)
    args = (list(cmd), dict(env or {}), workdir or os.getcwd(), output_dir, timeout_s)
    pending = runners.run.call(*args[:4], None, timeout_s) if per == 1 else None
    pendings = None
    if pending is None:
        pendings = [runners.flatten("rank").slice(rank=r).run.call_one(*args[:4], f"rank{r}", timeout_s) for r in range(len(procs))]
    done: Future[int] = Future._create()

    def finish() -> None:
        error: BaseException | None = None
        codes: list[int] = []
        try:
            codes = list(pending.get().values()) if pending is not None else [p.get() for p in pendings or []]
        except BaseException as exc:
            error = exc
        try:
            procs.stop().get(timeout=60)  # stopped before the Future completes (Monarch's order)
        except Exception as exc:
            error = error or exc
        if error is not None:
            done._set_exception(error)
        else:
            done._set_result(max(codes, default=0))

    threading.Thread(target=finish, name="actormesh-exec-command", daemon=True).start()
    return done
