"""SPMD worlds on proc meshes: torch.distributed's environment and torchrun-style scripts.

Monarch's ``monarch.spmd`` (``setup_torch_elastic_env``, ``SPMDActor``) plus
:func:`run_script`, which runs an unmodified torchrun script on every proc and
reports each rank's exit status, and the in-actor helpers
:func:`init_process_group_and_mesh` / :func:`destroy_process_group`.

Example::

    from actormesh.actor import this_host
    from actormesh.spmd import run_script

    procs = this_host().spawn_procs(per_host={"gpus": 4})
    run_script(procs, "train_ddp.py", ["--steps", "10"], timeout=600)   # prints "[rank0]: ..." lines
    procs.stop().get(timeout=30)

Importing this package does not import torch.
"""

from ._dist import default_backend, destroy_process_group, init_process_group, init_process_group_and_mesh, mesh_dims, share_host_cores
from ._env import ElasticEnv, SPMDActor, setup_torch_elastic_env, setup_torch_elastic_env_async
from ._script import ScriptError, run_script

__all__ = [
    "ElasticEnv",
    "SPMDActor",
    "ScriptError",
    "default_backend",
    "destroy_process_group",
    "init_process_group",
    "init_process_group_and_mesh",
    "mesh_dims",
    "run_script",
    "setup_torch_elastic_env",
    "setup_torch_elastic_env_async",
    "share_host_cores",
]
