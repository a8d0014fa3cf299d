"""How one worker process is launched: the command line and the environment.

The spawner (``_spawn``) starts each worker with a :class:`ProcCommand`, or
with :func:`default_command` when none is given. Whatever the command is, it
must end up running ``python -m actormesh.worker`` with the spawner's pipe as
its stdin: the bootstrap (job secret, addresses) arrives there, never in argv
or the environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["ProcCommand", "default_command", "WORKER_ARGS", "CPUS_ENV"]

#: The arguments after the Python interpreter that start a worker.
WORKER_ARGS = ("-m", "actormesh.worker")
#: Set on a worker's environment to pin it to these CPUs (``"0-3,8"``) with sched_setaffinity.
CPUS_ENV = "ACTORMESH_PROC_CPUS"


@dataclass(frozen=True)
class ProcCommand:
    """``argv`` run as ``executable``; ``env`` applied on top of the spawner's
    environment (a None value removes a variable; ``inherit_env=False`` starts
    from an empty one)."""

    executable: str
    argv: tuple[str, ...]
    env: Mapping[str, str | None] = field(default_factory=dict)
    inherit_env: bool = True

    def environment(self, base: Mapping[str, str], launch: Mapping[str, str]) -> dict[str, str]:
        """The child's environment: ``base`` (if inherited), then ``env``, then
        ``launch`` (actormesh's own settings, which always win)."""
        out = dict(base) if self.inherit_env else {}
        for key, value in self.env.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = value
        out.update(launch)
        return out


def default_command(python: str | None = None) -> ProcCommand:
    """``<python> -m actormesh.worker`` (this interpreter unless ``python`` is given)."""
    exe = python or sys.executable
    return ProcCommand(exe, (exe, *WORKER_ARGS))


def is_executable(path: str) -> bool:
    """Whether ``path`` names an executable file on this host."""
    return os.path.isfile(path) and os.access(path, os.X_OK)
