"""Inside an actor: the process group and a DeviceMesh named after the proc mesh.

Call these from an actor on procs prepared by :func:`setup_torch_elastic_env`
(they read its environment variables). torch is imported only when called.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from ._env import MESH_DIMS_ENV

__all__ = ["mesh_dims", "default_backend", "init_process_group", "init_process_group_and_mesh", "destroy_process_group",
           "share_host_cores"]


def mesh_dims() -> list[tuple[str, int]]:
    """The proc mesh's dims as ``[(label, size), ...]``, from this proc's environment."""
    raw = os.environ.get(MESH_DIMS_ENV)
    if raw is None:
        raise RuntimeError(f"{MESH_DIMS_ENV} is not set in this proc: call actormesh.spmd.setup_torch_elastic_env(procs) on the controller first")
    dims = []
    for part in filter(None, raw.split(",")):
        label, size = part.split("=")
        dims.append((label, int(size)))
    return dims


def share_host_cores(local_world_size: int) -> int:
    """Give this rank its share of the host's cores for torch's CPU kernels, unless
    ``OMP_NUM_THREADS`` says otherwise (as torchrun and Lightning do); the thread count.

    Each process's kernels otherwise use every core, and with several ranks per host
    their threads spin-wait for cores the others hold (a TP=2 replica on 2 cores
    decoded 2x slower so)."""
    import torch

    if "OMP_NUM_THREADS" in os.environ:
        return int(torch.get_num_threads())
    threads = max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads


def default_backend() -> str:
    """"cpu:gloo,cuda:nccl" where CUDA is available (CPU collectives still work), else "gloo"."""
    import torch

    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(backend: str | None = None, timeout_s: float = 600.0) -> None:
    """``torch.distributed.init_process_group`` from torchrun's variables (idempotent).

    On CUDA it also selects ``cuda:LOCAL_RANK`` as this proc's device.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        if var not in os.environ:
            raise RuntimeError(f"{var} is not set in this proc: call actormesh.spmd.setup_torch_elastic_env(procs) on the controller first")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend or default_backend(), timeout=timedelta(seconds=timeout_s))


def init_process_group_and_mesh(
    dim_names: Sequence[str] | Mapping[str, str] | None = None,
    *,
    backend: str | None = None,
    device_type: str | None = None,
    timeout_s: float = 600.0,
) -> Any:
    """Init the process group and return a ``DeviceMesh`` shaped like the proc mesh.

    The mesh has the proc mesh's dims (``{"hosts": 2, "gpus": 4}`` gives dims
    ``("hosts", "gpus")``), renamed by ``dim_names``: a sequence of new names
    in order, or a mapping ``{old: new}``.

    Example (inside an actor, after ``setup_torch_elastic_env(procs)``)::

        mesh = init_process_group_and_mesh({"hosts": "dp", "gpus": "tp"})
        model = parallelize_module(model, mesh["tp"], plan)
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    dims = mesh_dims() or [("world", int(os.environ.get("WORLD_SIZE", "1")))]
    labels = [label for label, _ in dims]
    if dim_names is None:
        names = labels
    elif isinstance(dim_names, Mapping):
        unknown = set(dim_names) - set(labels)
        if unknown:
            raise ValueError(f"dim_names renames {sorted(unknown)}, which the proc mesh does not have (its dims: {labels})")
        names = [dim_names.get(label, label) for label in labels]
    else:
        names = list(dim_names)
        if len(names) != len(labels):
            raise ValueError(f"dim_names has {len(names)} names but the proc mesh has {len(labels)} dims {labels}")
    if len(set(names)) != len(names):
        raise ValueError(f"DeviceMesh dim names must be distinct, got {names}")
    init_process_group(backend, timeout_s)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, tuple(size for _, size in dims), mesh_dim_names=tuple(names))


def destroy_process_group() -> None:
    """Destroy this proc's default process group if one exists (safe to call always)."""
    import sys

    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
