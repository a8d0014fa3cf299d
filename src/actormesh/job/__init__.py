"""Allocating hosts for a job: locally, as local processes, over SSH, on Slurm or on
Kubernetes (Monarch's ``monarch.job``). See docs/jobs.md.

Example::

    from actormesh.job import SlurmJob

    job = SlurmJob({"trainers": 4}, partition="gpu", time_limit="01:00:00")
    state = job.state()                        # submits, waits for the 4 hosts to join
    procs = state.trainers.spawn_procs(per_host={"gpus": 8})
    ...
    procs.stop().get()
    job.kill()
"""

from ._applied import APPLIED_DIR, AppliedJob, applied_job, load_job, start_keeper
from ._attach import attach, attach_to_workers, run_worker_loop_forever, run_worker_loop_until_shutdown, start_worker_loop_forever
from ._current import CURRENT_JOB_FILE, hosts_from_config, job_from_spec, load_current_job, set_current_job
from ._errors import JobError
from ._exec import exec_command
from ._job import Job, JobState, job_load, job_loads
from ._kubernetes import KubernetesJob
from ._local import LocalJob, ProcessJob
from ._port_forward import PortForwarder
from ._shell import shell
from ._slurm import SlurmJob
from ._ssh import SSHJob
from ._tools import DEFAULT_JOB_PATH, MeshAdminConfig, TelemetryConfig

JobTrait = Job  #: Monarch's name for the base class

__all__ = [
    "Job",
    "JobTrait",
    "JobError",
    "AppliedJob",
    "APPLIED_DIR",
    "applied_job",
    "load_job",
    "start_keeper",
    "job_from_spec",
    "JobState",
    "LocalJob",
    "ProcessJob",
    "SSHJob",
    "SlurmJob",
    "KubernetesJob",
    "job_load",
    "job_loads",
    "CURRENT_JOB_FILE",
    "set_current_job",
    "load_current_job",
    "hosts_from_config",
    "exec_command",
    "PortForwarder",
    "shell",
    "DEFAULT_JOB_PATH",
    "TelemetryConfig",
    "MeshAdminConfig",
    "attach",
    "attach_to_workers",
    "run_worker_loop_forever",
    "run_worker_loop_until_shutdown",
    "start_worker_loop_forever",
]
