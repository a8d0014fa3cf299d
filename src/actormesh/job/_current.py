"""The project's current job (Monarch's ``set_current_job`` / ``load_current_job``)
and ``hosts_from_config``.

``set_current_job("pkg.jobs.trainers")`` records which module attribute
describes the project's job, in ``.actormesh/current_job`` under the current
directory; ``load_current_job()`` imports it again and returns that job
object (a description, not yet applied: call ``.state()`` on it). Scripts and
tools started from the project directory then agree on the job without
passing it around.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from typing import Any

from ._errors import JobError
from ._job import Job

__all__ = ["set_current_job", "load_current_job", "hosts_from_config", "CURRENT_JOB_FILE"]

#: Where the current job's spec is kept, relative to the working directory.
CURRENT_JOB_FILE = os.path.join(".actormesh", "current_job")
_SPEC = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+")


def job_from_spec(module_path: str) -> Job:
    """The Job at ``"package.module.attribute"``; JobError naming what is missing otherwise."""
    mod_name, attr = module_path.rsplit(".", 1)
    try:
        module = importlib.import_module(mod_name)
    except ImportError as exc:
        raise JobError(f"current job {module_path!r}: cannot import module {mod_name!r}: {exc}") from exc
    job = getattr(module, attr, None)
    if job is None:
        raise JobError(f"current job {module_path!r}: module {mod_name!r} has no attribute {attr!r}")
    if not isinstance(job, Job):
        raise JobError(f"current job {module_path!r} must be an actormesh.job Job (e.g. SlurmJob(...)), got {type(job).__name__}")
    return job


def set_current_job(module_path: str) -> None:
    """Make ``module_path`` (``"package.module.attribute"``, a Job) the project's current job.

    The spec is checked by importing it now; it is saved in ``.actormesh/current_job``.
    """
    if not isinstance(module_path, str) or not _SPEC.fullmatch(module_path):
        raise ValueError(f"set_current_job() needs 'module.attribute' naming a Job, got {module_path!r}")
    job_from_spec(module_path)
    path = Path(CURRENT_JOB_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(module_path + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a spec


def load_current_job() -> Job:
    """This directory's current job: the one ``actormesh apply`` started while its
    keeper runs (an :class:`AppliedJob`, whose ``state()`` attaches to the running
    hosts), else the one :func:`set_current_job` recorded, freshly imported.

    Raises FileNotFoundError (saying what to do) when there is neither.
    """
    from ._applied import applied_job

    applied = applied_job()
    if applied is not None:
        return applied
    path = Path(CURRENT_JOB_FILE)
    try:
        module_path = path.read_text().strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"no current job: {path.resolve()} does not exist; run `actormesh apply job.py` "
                                "or call set_current_job('module.attribute') first") from None
    if not _SPEC.fullmatch(module_path):
        raise JobError(f"{path.resolve()} holds {module_path!r}, not 'module.attribute'; call set_current_job() again")
    return job_from_spec(module_path)


def hosts_from_config(name: str) -> Any:
    """The host mesh ``name`` of the project's job.

    With a current job (:func:`set_current_job`), its ``state()[name]``; without
    one, Monarch's stand-in: a :class:`ProcessJob` of two local host processes,
    so the same code runs on a laptop and, once a job is configured, on the cluster.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"hosts_from_config() needs a mesh name (an identifier), got {name!r}")
    if Path(CURRENT_JOB_FILE).exists():
        state = load_current_job().state()
        if name not in state:
            raise JobError(f"the current job has no mesh {name!r}; it has {', '.join(state.names()) or 'none'}")
        return state[name]
    from ._local import ProcessJob

    job = _stand_ins.get(name)
    if job is None or not job.active:
        job = _stand_ins[name] = ProcessJob({name: 2})  # held here: the job is killed at exit, not collected
    return job.state()[name]


_stand_ins: dict[str, Any] = {}
