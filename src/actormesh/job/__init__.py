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

from ._attach import attach_to_workers, run_worker_loop_forever, run_worker_loop_until_shutdown, start_worker_loop_forever
from ._errors import JobError
from ._job import Job, JobState, job_load, job_loads
from ._kubernetes import KubernetesJob
from ._local import LocalJob, ProcessJob
from ._slurm import SlurmJob
from ._ssh import SSHJob

JobTrait = Job  #: Monarch's name for the base class

__all__ = [
    "Job",
    "JobTrait",
    "JobError",
    "JobState",
    "LocalJob",
    "ProcessJob",
    "SSHJob",
    "SlurmJob",
    "KubernetesJob",
    "job_load",
    "job_loads",
    "attach_to_workers",
    "run_worker_loop_forever",
    "run_worker_loop_until_shutdown",
    "start_worker_loop_forever",
]
