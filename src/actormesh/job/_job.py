"""The job model: a declarative description of hosts, applied to a scheduler.

``job.apply()`` creates the allocation (a no-op while it is running);
``job.state()`` waits for its hosts and returns a :class:`JobState` whose
attributes are the named host meshes; ``job.kill()`` releases it. A job can
be pickled (``dumps``/``dump``) and loaded (``job_loads``/``job_load``):
the description and the allocation's handle travel, live processes do not.

Host agents belong to the controller that applied the job: they dialed it and
exit when it goes away. So a job loaded in another process can report
``active`` and ``kill()`` the allocation, but ``state()`` there raises while
the first controller still holds the allocation, and re-applies once it is
gone.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import socket
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator
from types import TracebackType
from typing import IO, Any

from ..mesh import HostMesh, release_hosts
from ._errors import JobError
from ._tools import MeshAdminConfig, TelemetryConfig, start_tools

log = logging.getLogger("actormesh.job")

__all__ = ["Job", "JobState", "job_load", "job_loads"]


class JobState:
    """The host meshes of a running job, one attribute per mesh name.

    Example::

        state = job.state()
        procs = state.trainers.spawn_procs(per_host={"gpus": 8})
    """

    def __init__(self, meshes: dict[str, HostMesh]) -> None:
        self._meshes = dict(meshes)
        #: The dashboard, when ``enable_telemetry(include_dashboard=True)`` asked for it.
        self.telemetry_url: str | None = None
        #: The mesh admin API (the dashboard's JSON API), when ``enable_admin()`` asked for it.
        self.admin_url: str | None = None
        #: Monarch's SQL query engine over telemetry: actormesh keeps none (always None).
        self.query_engine: Any = None

    @classmethod
    def from_agents(cls, meshes: dict[str, int], agents: list[str]) -> JobState:
        """Split agent addresses, in host order, into ``meshes`` (name -> host count)."""
        out, start = {}, 0
        for name, count in meshes.items():
            out[name] = HostMesh(agents=agents[start : start + count])
            start += count
        return cls(out)

    def __getattr__(self, name: str) -> HostMesh:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._meshes[name]
        except KeyError:
            raise AttributeError(f"this job has no mesh named {name!r}; its meshes are {sorted(self._meshes)}") from None

    def __getitem__(self, name: str) -> HostMesh:
        return self._meshes[name]

    def __contains__(self, name: object) -> bool:
        return name in self._meshes

    def __iter__(self) -> Iterator[str]:
        return iter(self._meshes)

    def names(self) -> list[str]:
        """The mesh names, in the job's order."""
        return list(self._meshes)

    def __repr__(self) -> str:
        return "JobState(" + ", ".join(f"{k}={v!r}" for k, v in self._meshes.items()) + ")"


_live: weakref.WeakValueDictionary[str, Job] = weakref.WeakValueDictionary()
_applied_here: weakref.WeakSet[Job] = weakref.WeakSet()
_lock = threading.Lock()


class Job(ABC):
    """Base of every job (Monarch's ``JobTrait``).

    Subclasses implement ``_create`` (start the allocation), ``_wait_state``
    (wait for its hosts, return the JobState), ``_kill`` and ``_is_active``,
    and list in ``_transient`` the attributes that must not be pickled.
    """

    _transient: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._uid = os.urandom(8).hex()
        self._applied_by: tuple[str, int] | None = None
        self._state: JobState | None = None
        self._telemetry: TelemetryConfig | None = None
        self._mesh_admin: MeshAdminConfig | None = None
        _live[self._uid] = self

    # -- public surface --------------------------------------------------------------
    def apply(self, client_script: str | None = None) -> None:
        """Create the allocation; a no-op while this process's allocation runs.

        ``client_script`` (Monarch's batch mode) is not supported.
        """
        if client_script is not None:
            raise NotImplementedError("batch mode (apply(client_script=...)) is not supported; run the client script yourself and call state()")
        if self._applied_by is not None:
            if self._owned_here():
                if self._is_active():
                    return
                self._kill()  # release what is left of a broken allocation before a new one
            elif self._is_active():
                host, pid = self._applied_by
                raise JobError(
                    f"{self!r} is running and belongs to the controller that applied it (pid {pid} on {host}); its host agents "
                    "serve that controller only. Use the job from there, or kill() it first."
                )
        self._state = None
        self._create()
        self._applied_by = (socket.gethostname(), os.getpid())
        with _lock:
            _applied_here.add(self)

    def enable_telemetry(self, config: TelemetryConfig | None = None, **kwargs: Any) -> Job:
        """Turn telemetry on (and the dashboard, with ``include_dashboard``) when
        :meth:`state` connects; ``config`` or ``TelemetryConfig(**kwargs)``. Returns self."""
        self._telemetry = config if config is not None else TelemetryConfig(**kwargs)
        return self

    def enable_admin(self, config: MeshAdminConfig | None = None, **kwargs: Any) -> Job:
        """Serve the mesh admin API (the dashboard's JSON API) when :meth:`state`
        connects; ``config`` or ``MeshAdminConfig(**kwargs)``. Returns self."""
        self._mesh_admin = config if config is not None else MeshAdminConfig(**kwargs)
        return self

    def state(self, cached_path: str | None = None) -> JobState:
        """The job's host meshes, applying the job first if it is not running.

        Blocks until every host has joined (bounded by the job's timeout;
        JobError names the hosts that did not). With ``cached_path`` the job is
        also dumped there for other processes (see :func:`job_load`), e.g.
        ``DEFAULT_JOB_PATH``. Tools asked for with :meth:`enable_telemetry` /
        :meth:`enable_admin` start here (``state.telemetry_url``, ``state.admin_url``).
        """
        if self._state is not None and self._owned_here() and self._is_active():
            return self._state
        self.apply()
        self._state = self._wait_state()
        self._state.telemetry_url, self._state.admin_url = start_tools(
            getattr(self, "_telemetry", None), getattr(self, "_mesh_admin", None))
        if cached_path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(cached_path)), exist_ok=True)
            self.dump(cached_path)
        return self._state

    def kill(self) -> None:
        """Release the allocation and stop its host agents (idempotent).

        A deliberate teardown, not a failure: the proc meshes on its hosts are
        marked stopped (later calls fail at once) and the loss of their procs
        reaches no ``__supervise__`` or ``unhandled_fault_hook``. Stop them
        first (``procs.stop()``) for their actors' ``__cleanup__`` to run.
        """
        if self._applied_by is None:
            return
        if self._state is not None and self._owned_here():
            for name in self._state.names():
                release_hosts(self._state[name], f"its job was killed ({self!r})")
        try:
            self._kill()
        finally:
            self._state = None
            self._applied_by = None
            with _lock:
                _applied_here.discard(self)

    @property
    def active(self) -> bool:
        """Whether the allocation exists and is not finished."""
        return self._applied_by is not None and self._is_active()

    def can_run(self, spec: Job) -> bool:
        """Whether this job's allocation could serve ``spec`` (same kind and description)."""
        return type(spec) is type(self) and spec._description() == self._description()

    def dumps(self) -> bytes:
        """This job (description and allocation handle) as bytes; see :func:`job_loads`."""
        return pickle.dumps(self)

    def dump(self, file: str | os.PathLike[str] | IO[bytes]) -> None:
        """Write :meth:`dumps` to a path (created mode 0600) or a binary file object."""
        data = self.dumps()
        if hasattr(file, "write"):
            file.write(data)
            return
        fd = os.open(os.fspath(file), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.kill()

    # -- for subclasses ---------------------------------------------------------------
    @abstractmethod
    def _create(self) -> None:
        """Start the allocation (host agents will dial the controller)."""

    @abstractmethod
    def _wait_state(self) -> JobState:
        """Wait for the hosts; return the named host meshes."""

    @abstractmethod
    def _kill(self) -> None:
        """Release the allocation."""

    @abstractmethod
    def _is_active(self) -> bool:
        """Whether the allocation (applied earlier) still runs."""

    def _description(self) -> Any:
        """What identifies the request (compared by :meth:`can_run`)."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def _owned_here(self) -> bool:
        return self._applied_by == (socket.gethostname(), os.getpid())

    # -- pickling -----------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(vars(self))
        for name in ("_state", *self._transient):
            state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)


def job_loads(data: bytes) -> Job:
    """A job from :meth:`Job.dumps`. In the process that dumped it, the live job itself.

    Only load data you wrote: this is pickle.
    """
    job = pickle.loads(data)
    if not isinstance(job, Job):
        raise TypeError(f"not a dumped job: {type(job).__name__}")
    live = _live.get(job._uid)
    if live is not None:
        return live
    _live[job._uid] = job
    return job


def job_load(file: str | os.PathLike[str] | IO[bytes]) -> Job:
    """A job from a file written by :meth:`Job.dump` (only load files you wrote: pickle)."""
    if hasattr(file, "read"):
        return job_loads(file.read())
    with open(os.fspath(file), "rb") as f:
        return job_loads(f.read())


def _kill_at_exit() -> None:
    with _lock:
        jobs = list(_applied_here)
    for job in jobs:
        try:
            job.kill()
        except Exception as exc:  # keep going: every job gets its chance
            log.warning("could not kill %r at exit: %s", job, exc)


atexit.register(_kill_at_exit)


def check_meshes(meshes: Any) -> dict[str, int]:
    """Validate ``{mesh name: host count}``; names become JobState attributes."""
    if not isinstance(meshes, dict) or not meshes:
        raise TypeError(f"meshes must be a non-empty dict of mesh name -> number of hosts, e.g. {{'trainers': 2}}; got {meshes!r}")
    for name, count in meshes.items():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"mesh name {name!r} must be a Python identifier not starting with '_' (it becomes an attribute of job.state())")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"meshes[{name!r}] must be a positive number of hosts, got {count!r}")
    return dict(meshes)
