"""Per-proc launch customisation for ``HostMesh.spawn_procs`` (Monarch's
``BootstrapCommand``, ``proc_bind`` and ``with_python_executable``).

A :class:`BootstrapCommand` is the program a host runs to start one proc.
Whatever it runs must end in ``python -m actormesh.worker`` with its stdin
kept (the proc's bootstrap, job secret included, arrives on stdin), e.g. a
wrapper script that sets variables and ``exec``s the default command.
``proc_bind`` pins each proc of a host: ``cpunodebind`` / ``membind`` /
``physcpubind`` go to ``numactl`` (which must be installed), ``cpus`` is
applied by the worker itself with ``os.sched_setaffinity``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

from ..runtime import launch as _launch
from ._shape import Point

# One name a line: a plain class assignment is a type alias to mypy, a tuple unpacking is not.
CPUS_ENV = _launch.CPUS_ENV
WORKER_ARGS = _launch.WORKER_ARGS
ProcCommand = _launch.ProcCommand

__all__ = ["BootstrapCommand", "default_bootstrap_cmd", "check_proc_bind", "proc_commands", "check_python"]

_NUMACTL_KEYS = ("cpunodebind", "membind", "physcpubind")
_BIND_KEYS = (*_NUMACTL_KEYS, "cpus")
_CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


class BootstrapCommand:
    """``program`` run with ``args`` (``arg0`` as argv[0], default the program),
    ``env`` set on top of the host's environment (a None value removes a
    variable; ``inherit_env=False`` starts from an empty environment)."""

    __slots__ = ("program", "arg0", "args", "_env", "inherit_env")

    def __init__(self, program: str, arg0: str | None, args: Sequence[str], env: Mapping[str, str | None], inherit_env: bool = True) -> None:
        if not isinstance(program, (str, os.PathLike)) or not str(program):
            raise TypeError(f"BootstrapCommand program must be a non-empty path, got {program!r}")
        if arg0 is not None and not isinstance(arg0, str):
            raise TypeError(f"BootstrapCommand arg0 must be a str or None, got {arg0!r}")
        if isinstance(args, (str, bytes)) or not all(isinstance(a, str) for a in args):
            raise TypeError(f"BootstrapCommand args must be a list of str, got {args!r}")
        if not isinstance(inherit_env, bool):
            raise TypeError(f"BootstrapCommand inherit_env must be a bool, got {inherit_env!r}")
        self.program = str(program)
        self.arg0 = arg0
        self.args = list(args)
        self.inherit_env = inherit_env
        self._env = _check_env(env)

    @property
    def env(self) -> dict[str, str | None]:
        """The variables this command sets (None: removed)."""
        return dict(self._env)

    @env.setter
    def env(self, env: Mapping[str, str | None]) -> None:
        self._env = _check_env(env)

    def with_env(self, env: Mapping[str, str | None]) -> BootstrapCommand:
        """A copy with ``env`` merged on top (its keys win; None removes)."""
        return BootstrapCommand(self.program, self.arg0, self.args, {**self._env, **_check_env(env)}, self.inherit_env)

    def to_proc_command(self) -> ProcCommand:
        """The runtime's launch record for this command."""
        return ProcCommand(self.program, (self.arg0 or self.program, *self.args), dict(self._env), self.inherit_env)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BootstrapCommand) and (self.program, self.arg0, self.args, self._env, self.inherit_env) == (
            other.program, other.arg0, other.args, other._env, other.inherit_env)

    def __repr__(self) -> str:
        return f"BootstrapCommand(program={self.program!r}, arg0={self.arg0!r}, args={self.args!r}, env={self._env!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (BootstrapCommand, (self.program, self.arg0, self.args, self._env, self.inherit_env))


def _check_env(env: Mapping[str, str | None]) -> dict[str, str | None]:
    if not isinstance(env, Mapping):
        raise TypeError(f"BootstrapCommand env must be a dict of str to str (or None), got {env!r}")
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key:
            raise ValueError(f"bad environment variable name {key!r}")
        if value is not None and not isinstance(value, str):
            raise TypeError(f"environment variable {key} must be a str or None, got {value!r}")
    return dict(env)


def default_bootstrap_cmd(python: str | None = None) -> BootstrapCommand:
    """The command that starts a proc: ``<python> -m actormesh.worker`` (this interpreter by default)."""
    return BootstrapCommand(python or sys.executable, None, list(WORKER_ARGS), {})


def check_python(path: Any) -> str:
    """Validate a ``with_python_executable`` argument (for the local host: that it runs)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"with_python_executable() needs the path of a Python interpreter, got {path!r}")
    return str(path)


def check_proc_bind(proc_bind: Any, per_host: int) -> list[dict[str, str]] | None:
    """Validate ``proc_bind`` (one dict per proc of a host) at the call site."""
    if proc_bind is None:
        return None
    if isinstance(proc_bind, (str, bytes, Mapping)) or not isinstance(proc_bind, Sequence):
        raise TypeError(f"proc_bind must be a list with one dict per proc on a host, got {proc_bind!r}")
    if len(proc_bind) != per_host:
        raise ValueError(f"proc_bind length ({len(proc_bind)}) must equal procs_per_host ({per_host})")
    out = []
    for i, bind in enumerate(proc_bind):
        if not isinstance(bind, Mapping):
            raise TypeError(f"proc_bind[{i}] must be a dict like {{'cpus': '0-3'}}, got {bind!r}")
        for key, value in bind.items():
            if key not in _BIND_KEYS:
                raise ValueError(f"proc_bind[{i}]: unknown key {key!r}; use {', '.join(_BIND_KEYS)}")
            if not isinstance(value, str) or not value:
                raise TypeError(f"proc_bind[{i}][{key!r}] must be a non-empty str like '0-3', got {value!r}")
        if "cpus" in bind:
            if any(k in bind for k in _NUMACTL_KEYS):
                raise ValueError(f"proc_bind[{i}]: 'cpus' cannot be combined with numactl keys; use physcpubind with numactl")
            if not _CPU_LIST.fullmatch(bind["cpus"]):
                raise ValueError(f"proc_bind[{i}]['cpus'] = {bind['cpus']!r}: expected a CPU list like '0-3,8'")
        out.append(dict(bind))
    return out


def _with_binding(command: ProcCommand, bind: dict[str, str] | None, numactl: str | None) -> ProcCommand:
    if not bind:
        return command
    if "cpus" in bind:
        return ProcCommand(command.executable, command.argv, {**command.env, CPUS_ENV: bind["cpus"]}, command.inherit_env)
    assert numactl is not None
    flags = [f"--{k}={bind[k]}" for k in _NUMACTL_KEYS if k in bind]
    return ProcCommand(numactl, (numactl, *flags, command.executable, *command.argv[1:]), command.env, command.inherit_env)


BootstrapSpec = Union[BootstrapCommand, Callable[[Point], BootstrapCommand], None]


def proc_commands(points: Sequence[Point], spec: BootstrapSpec, proc_bind: list[dict[str, str]] | None, python: str | None,
                  *, local: bool) -> list[ProcCommand] | None:
    """One launch command per proc (``points`` in rank order), or None for all-default.

    Raises at the call site: a callable that fails or returns something else
    than a BootstrapCommand, numactl keys on a host without numactl (checked
    for the local host).
    """
    if spec is None and proc_bind is None and python is None:
        return None
    if spec is not None and not isinstance(spec, BootstrapCommand) and not callable(spec):
        raise TypeError(f"bootstrap_command must be a BootstrapCommand or a function of the proc's Point, got {spec!r}")
    numactl = None
    if proc_bind and any(k in b for b in proc_bind for k in _NUMACTL_KEYS):
        numactl = shutil.which("numactl") if local else "numactl"
        if numactl is None:
            raise ValueError("proc_bind keys cpunodebind/membind/physcpubind need numactl, which is not installed on this host; "
                             "install numactl or bind with {'cpus': '0-3'}")
    out = []
    for i, point in enumerate(points):
        if spec is None:
            cmd = default_bootstrap_cmd(python)
        elif isinstance(spec, BootstrapCommand):
            cmd = spec
        else:
            try:
                cmd = spec(point)
            except Exception as exc:
                raise ValueError(f"bootstrap_command({point}) raised {type(exc).__name__}: {exc}") from exc
            if not isinstance(cmd, BootstrapCommand):
                raise TypeError(f"bootstrap_command({point}) must return a BootstrapCommand, got {cmd!r}")
        if local and not os.path.isabs(cmd.program) and shutil.which(cmd.program) is None:
            raise ValueError(f"bootstrap program {cmd.program!r} (for proc {point}) is not on PATH")
        if local and os.path.isabs(cmd.program) and not (os.path.isfile(cmd.program) and os.access(cmd.program, os.X_OK)):
            raise ValueError(f"bootstrap program {cmd.program!r} (for proc {point}) is not an executable file")
        bind = proc_bind[i % len(proc_bind)] if proc_bind else None
        out.append(_with_binding(cmd.to_proc_command(), bind, numactl))
    return out
