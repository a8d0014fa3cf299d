"""Jobs applied from the command line (``actormesh apply``), held by a keeper process.

Host agents serve the controller that applied their job and exit when it goes
away, so a job that must outlive the command that applied it needs a process
that stays: ``actormesh apply`` starts a *keeper* (``python -m
actormesh.job._keeper``, in its own session), which applies the job, waits for
its hosts and then holds the allocation until ``actormesh kill`` (SIGTERM) or
until the allocation breaks. Everything about it lives in the project's
``.actormesh/applied/`` directory:

==================  =============================================================
``request.json``    what to apply (a file and attribute, or ``module.attribute``)
``record.json``     written once the hosts are up: keeper pid, meshes, agent addresses
``credentials``     the job secret (mode 0600) that other processes attach with
``job_state.pkl``   the job itself (``Job.dump``, Monarch's cached state), for ``kill``
``error.txt``       why applying failed, when it did
``keeper.log``      the keeper's output
==================  =============================================================

Any process started in the project directory reaches the hosts through
:class:`AppliedJob` (``load_current_job()`` returns one while the keeper runs):
its runtime starts with the job's secret and talks to the agents directly, as a
second controller; the procs it spawns are stopped when it exits.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._errors import JobError
from ._job import Job, JobState, job_load

log = logging.getLogger("actormesh.job")

__all__ = ["APPLIED_DIR", "AppliedJob", "applied_job", "start_keeper", "load_job", "read_json", "keeper_alive"]

#: Where an applied job's files live, relative to the project (working) directory.
APPLIED_DIR = os.path.join(".actormesh", "applied")
_KEEPER_MODULE = "actormesh.job._keeper"


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A JSON file's object, or None when it does not exist (or is being replaced)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write atomically (a reader sees the old file or the new one)."""
    tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def keeper_alive(pid: int) -> bool:
    """Whether ``pid`` is a running keeper (not a recycled pid, not a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if _KEEPER_MODULE.encode() not in f.read():
                return False
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def load_job(target: str, attr: str | None = None) -> Job:
    """The Job that ``target`` names: a Python file (its attribute ``attr``, default
    ``job``, called first if it is a function) or ``"module.attribute"``."""
    from ._current import job_from_spec

    if not target.endswith(".py") and not os.path.exists(target):
        if attr is not None:
            raise JobError(f"--attr is for a job file; {target!r} is a module path: write it as {target}.{attr}")
        if "." not in target:
            raise JobError(f"{target!r} is neither a Python file nor 'module.attribute'; give e.g. job.py or mypkg.jobs.trainers")
        return job_from_spec(target)
    path = os.path.abspath(target)
    if not os.path.isfile(path):
        raise JobError(f"job file {target!r} does not exist")
    module = _import_file(path)
    name = attr or "job"
    value = getattr(module, name, None)
    if value is None:
        found = [k for k, v in vars(module).items() if isinstance(v, Job) and not k.startswith("_")]
        hint = f"it defines {', '.join(found)}: pass --attr {found[0]}" if found else "define `job = ProcessJob({...})` (or a function `job()` returning one)"
        raise JobError(f"{target} has no attribute {name!r}; {hint}")
    if callable(value) and not isinstance(value, Job):
        value = value()
    if not isinstance(value, Job):
        raise JobError(f"{target}:{name} must be an actormesh.job Job (e.g. ProcessJob({{'hosts': 2}})) or a function returning one, got {type(value).__name__}")
    return value


def _import_file(path: str) -> Any:
    name = os.path.splitext(os.path.basename(path))[0]
    if not name.isidentifier():
        name = "actormesh_job_file"
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so its own imports, and classes pickled from it, resolve
    existing = sys.modules.get(name)
    if existing is not None and os.path.abspath(getattr(existing, "__file__", "") or "") == path:
        return existing
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise JobError(f"cannot load {path} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise JobError(f"running {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def start_keeper(request: dict[str, Any], directory: str = APPLIED_DIR, timeout_s: float = 300.0) -> dict[str, Any]:
    """Start a keeper for ``request`` and wait (at most ``timeout_s``) until its hosts are up; return its record."""
    d = Path(directory).resolve()
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    held = read_json(d / "record.json")
    if held is not None and keeper_alive(int(held.get("keeper_pid", 0))):
        raise JobError(f"{held.get('job')} is already applied in {d} (keeper pid {held['keeper_pid']}); kill it first (`actormesh kill`)")
    if (d / "job_state.pkl").exists():  # a keeper that was killed left its job: release what may remain of it
        try:
            job_load(d / "job_state.pkl").kill()
        except Exception as exc:
            log.warning("could not kill the job a dead keeper left in %s: %s", d, exc)
    for stale in ("record.json", "error.txt", "credentials", "job_state.pkl"):
        (d / stale).unlink(missing_ok=True)
    write_json(d / "request.json", {**request, "timeout_s": timeout_s})
    with open(d / "keeper.log", "wb") as keeper_log:
        keeper = subprocess.Popen([sys.executable, "-m", _KEEPER_MODULE, str(d)], stdin=subprocess.DEVNULL, stdout=keeper_log,
                                  stderr=subprocess.STDOUT, start_new_session=True, cwd=os.getcwd(), close_fds=True)
    deadline = time.monotonic() + timeout_s + 15
    while True:
        record = read_json(d / "record.json")
        if record is not None and record.get("keeper_pid") == keeper.pid:
            return record
        if keeper.poll() is not None:
            why = (d / "error.txt").read_text().strip() if (d / "error.txt").exists() else _tail(d / "keeper.log")
            raise JobError(f"applying the job failed: {why}")
        if time.monotonic() > deadline:
            _stop(keeper.pid, 30)
            raise JobError(f"the job's hosts were not up within {timeout_s:.0f}s; see {d / 'keeper.log'} (raise --timeout for slow schedulers)")
        time.sleep(0.05)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or "(no output)"
    except OSError:
        return "(no log)"


def _stop(pid: int, timeout_s: float) -> bool:
    """SIGTERM the keeper and wait for it; SIGKILL after ``timeout_s``. True if it ended on SIGTERM."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout_s
    while keeper_alive(pid):
        if time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return False
        time.sleep(0.05)
    return True


class AppliedJob(Job):
    """The job a keeper holds for this project directory (see the module docstring).

    ``state()`` attaches to its hosts (start the process's runtime with it:
    call this before any other actormesh call); ``kill()`` stops the keeper,
    which releases the allocation.
    """

    def __init__(self, directory: str = APPLIED_DIR, *, kill_timeout_s: float = 60.0) -> None:
        super().__init__()
        self.directory = os.path.abspath(directory)
        self.kill_timeout_s = kill_timeout_s
        record = read_json(os.path.join(self.directory, "record.json"))
        if record is None:
            raise JobError(f"no job is applied in {os.path.dirname(os.path.dirname(self.directory))}: run `actormesh apply job.py` there first")
        self.record: dict[str, Any] = record
        self._applied_by = (socket.gethostname(), int(record["keeper_pid"]))

    def apply(self, client_script: str | None = None) -> None:
        """A no-op while the keeper holds the job; JobError (saying what to do) once it is gone."""
        if client_script is not None:
            raise NotImplementedError("batch mode (apply(client_script=...)) is not supported")
        if not self._is_active():
            raise JobError(f"the applied job {self.record.get('job')} is no longer running "
                           f"(see {os.path.join(self.directory, 'keeper.log')}); run `actormesh apply` again")

    def state(self, cached_path: str | None = None) -> JobState:
        """The job's host meshes, reached with the job's secret (starts this process's runtime)."""
        if self._state is None:
            self.apply()
            self._state = self._wait_state()
        if cached_path is not None:
            self.dump(cached_path)
        return self._state

    def kill(self) -> None:
        """Stop the keeper (it kills the job); if it does not stop in time, kill the job from its cached state."""
        pid = self._applied_by[1] if self._applied_by else None
        self._state = None
        if pid is None or not keeper_alive(pid):
            return
        if not _stop(pid, self.kill_timeout_s):
            cached = os.path.join(self.directory, "job_state.pkl")
            if os.path.exists(cached):
                job_load(cached).kill()
        self._applied_by = None

    def _create(self) -> None:
        self.apply()

    def _wait_state(self) -> JobState:
        from ..config import configure, get_config
        from ..host import read_credentials
        from ..mesh import HostMesh, this_host
        from ._controller import runtime_started, runtime_with_secret

        transport = self.record.get("transport", "unix")
        if transport == "tcp" and not runtime_started() and get_config().default_transport != "tcp":
            configure(default_transport="tcp", bind_host=self.record.get("bind_host") or "0.0.0.0")
        try:
            secret, tls = read_credentials(os.path.join(self.directory, "credentials"))
        except (OSError, SystemExit) as exc:
            raise JobError(f"cannot read the applied job's credentials: {exc}") from None
        runtime_with_secret(secret, "attaching to the applied job", tls=tls)
        meshes = {}
        for name, hosts in self.record["meshes"].items():
            addresses = [h["address"] for h in hosts]
            meshes[name] = this_host() if addresses == ["local"] else HostMesh(agents=addresses)
        return JobState(meshes)

    def _kill(self) -> None:
        self.kill()

    def _is_active(self) -> bool:
        return self._applied_by is not None and keeper_alive(self._applied_by[1])

    def __repr__(self) -> str:
        return f"AppliedJob({self.record.get('job')}, keeper pid {self.record.get('keeper_pid')})"


def applied_job(directory: str = APPLIED_DIR) -> AppliedJob | None:
    """The job a live keeper holds for ``directory``, else None."""
    record = read_json(os.path.join(directory, "record.json"))
    if record is None or not keeper_alive(int(record.get("keeper_pid", 0))):
        return None
    try:
        return AppliedJob(directory)
    except JobError:
        return None
