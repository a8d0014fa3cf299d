"""torchrun's environment on every proc of a mesh: ``setup_torch_elastic_env``.

Each proc gets the variables ``torch.distributed.run`` would give it
(``MASTER_ADDR``/``MASTER_PORT`` on rank 0's host, ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ...), derived from its point in the proc mesh, so that
``torch.distributed.init_process_group("gloo")`` (env:// init) just works in any
actor spawned there afterwards. Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from typing import Any, cast

from ..mesh import ActorMesh, ProcMesh
from ..runtime import Actor, context, current_runtime, endpoint

__all__ = ["SPMDActor", "ElasticEnv", "setup_torch_elastic_env", "setup_torch_elastic_env_async", "MESH_DIMS_ENV"]

#: Environment variable holding the proc mesh's dims ("hosts=2,gpus=4"); read by
#: :func:`actormesh.spmd.init_process_group_and_mesh` to name DeviceMesh dims.
MESH_DIMS_ENV = "ACTORMESH_MESH_DIMS"

#: Dimension names taken as "the GPUs of one host" (LOCAL_RANK), else the last dim.
_LOCAL_DIMS = ("gpus", "gpu", "procs", "local")


@dataclass(frozen=True)
class ElasticEnv:
    """The torchrun variables of one proc (see ``torch.distributed.run``)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    group_world_size: int
    dims: tuple[tuple[str, int], ...]

    @staticmethod
    def for_point(labels: tuple[str, ...], sizes: tuple[int, ...], coords: tuple[int, ...], rank: int) -> ElasticEnv:
        """The variables of the proc at ``coords`` (row-major ``rank``) of a mesh.

        >>> ElasticEnv.for_point(("hosts", "gpus"), (2, 4), (1, 2), 6).local_rank
        2
        """
        if not labels:  # a single proc
            return ElasticEnv(rank, 0, 1, 1, 0, 1, ())
        local = next((labels.index(d) for d in _LOCAL_DIMS if d in labels), len(labels) - 1)
        local_world = sizes[local]
        others = [(c, s) for i, (c, s) in enumerate(zip(coords, sizes)) if i != local]
        group_rank = 0
        for c, s in others:
            group_rank = group_rank * s + c
        return ElasticEnv(
            rank=rank,
            local_rank=coords[local],
            world_size=math.prod(sizes),
            local_world_size=local_world,
            group_rank=group_rank,
            group_world_size=math.prod(s for _, s in others),
            dims=tuple(zip(labels, sizes)),
        )

    def variables(self, master_addr: str, master_port: int) -> dict[str, str]:
        """The environment variables, as torchrun names them (plus the mesh dims)."""
        return {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.group_rank),
            "GROUP_WORLD_SIZE": str(self.group_world_size),
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "ROLE_NAME": "rank",
            "TORCHELASTIC_RUN_ID": os.environ.get("TORCHELASTIC_RUN_ID", "actormesh"),
            MESH_DIMS_ENV: ",".join(f"{label}={size}" for label, size in self.dims),
        }


def _free_port(host: str) -> int:
    """A TCP port free right now on ``host`` (bind port 0, report, release)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _my_host(use_ipaddr: str | None) -> str:
    """This proc's host as peers should dial it (from the runtime's address)."""
    address: str = current_runtime().address
    if address.startswith("tcp:"):
        host = address[4:].rsplit(":", 1)[0].strip("[]")
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
    else:  # unix socket: every proc that can reach us lives on this host
        host = "127.0.0.1" if use_ipaddr is None else socket.gethostname()
    if use_ipaddr is None:
        return host
    family = {"ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}.get(str(use_ipaddr).lower())
    if family is None:
        raise ValueError(f"use_ipaddr must be None, 'ipv4' or 'ipv6', got {use_ipaddr!r}")
    return str(socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)[0][4][0])


class SPMDActor(Actor):
    """Sets torchrun's environment variables in its proc and runs SPMD scripts.

    Spawned by :func:`setup_torch_elastic_env` and :func:`run_script`, one per
    proc. Its rank comes from its spawn point, so a slice of a proc mesh is a
    world of its own (ranks renumbered from 0).
    """

    def __init__(self) -> None:
        point = context().actor_instance.rank
        extent = point.extent
        labels, sizes = tuple(extent.labels), tuple(extent.sizes)
        coords = tuple(point[label] for label in labels)
        self.env = ElasticEnv.for_point(labels, sizes, coords, point.rank)
        self._runs: set[str] = set()

    @endpoint
    def get_host_port(self, use_ipaddr: str | None = None) -> tuple[str, int]:
        """(host, free port) on this proc's host: rank 0's answer becomes MASTER_ADDR/PORT."""
        host = _my_host(use_ipaddr)
        bind = "::" if ":" in host else ""
        return host, _free_port(bind)

    @endpoint
    def setup_env(self, master_addr: str, master_port: int) -> dict[str, str]:
        """Set the variables in this proc's ``os.environ``; returns them."""
        variables = self.env.variables(master_addr, master_port)
        os.environ.update(variables)
        return variables

    @endpoint
    def main(self, master_addr: str, master_port: int, script_args: list[str]) -> bool:
        """Monarch's ``SPMDActor.main``: set the env, then run a script *in this proc*.

        ``script_args`` is ``[path, *args]`` or ``["-m", module, *args]``. Prefer
        :func:`actormesh.spmd.run_script`, which runs each rank in a child
        process (exit status, output with rank prefixes, failing fast).
        """
        import runpy
        import sys

        os.environ.update(self.env.variables(master_addr, master_port))
        if not script_args:
            raise ValueError("main() needs script_args: [path, *args] or ['-m', module, *args]")
        if script_args[0] == "-m":
            if len(script_args) < 2:
                raise ValueError("main(['-m', ...]) needs a module name after '-m'")
            sys.argv = [script_args[1], *script_args[2:]]
            runpy.run_module(script_args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(script_args)
            runpy.run_path(script_args[0], run_name="__main__")
        return True

    @endpoint
    def run_script(self, run_id: str, argv: list[str], env: dict[str, str], cwd: str | None, port: Any) -> tuple[int, str | None, float]:
        """Run ``argv`` in a child process; stream its lines to ``port``; return (exit code, traceback, end time)."""
        from ._script import run_child

        self._runs.add(run_id)
        try:
            return run_child(run_id, self.env.rank, argv, env, cwd, port)
        finally:
            self._runs.discard(run_id)

    def __cleanup__(self, exc: Exception | None) -> None:
        import sys

        script = sys.modules.get("actormesh.spmd._script")
        if script is not None:
            for run_id in list(self._runs):
                script.terminate(run_id)


def _check_procs(proc_mesh: Any) -> None:
    if not isinstance(proc_mesh, ProcMesh):
        raise TypeError(f"setup_torch_elastic_env needs a ProcMesh (this_host().spawn_procs(...)), got {type(proc_mesh).__name__}")


def _setup(
    proc_mesh: ProcMesh,
    master_addr: str | None = None,
    master_port: int | None = None,
    use_ipaddr: str | None = None,
    timeout: float = 60.0,
) -> tuple[ActorMesh[SPMDActor], str, int]:
    """Spawn SPMDActors, agree on the master address, set every proc's env."""
    _check_procs(proc_mesh)
    actors = cast("ActorMesh[SPMDActor]", proc_mesh.spawn("spmd", SPMDActor))
    if master_addr is None or master_port is None:
        first = actors.slice(**{label: 0 for label in actors.extent.labels})
        host, port = first.get_host_port.call_one(use_ipaddr).get(timeout=timeout)
        master_addr = master_addr if master_addr is not None else host
        master_port = master_port if master_port is not None else port
    actors.setup_env.call(master_addr, master_port).get(timeout=timeout)
    return actors, master_addr, int(master_port)


def setup_torch_elastic_env(
    proc_mesh: ProcMesh,
    master_addr: str | None = None,
    master_port: int | None = None,
    use_ipaddr: str | None = None,
    timeout: float = 60.0,
) -> None:
    """Give every proc of ``proc_mesh`` torchrun's environment (Monarch's ``monarch.spmd``).

    ``MASTER_ADDR``/``MASTER_PORT`` default to rank 0's host and a port that
    rank 0's proc found free. Afterwards any actor spawned on these procs can
    call ``torch.distributed.init_process_group()`` (or
    :func:`init_process_group_and_mesh`). Blocks until every proc is set up.

    Example::

        procs = this_host().spawn_procs(per_host={"gpus": 4})
        setup_torch_elastic_env(procs)
        trainers = procs.spawn("train", MyDDPActor)   # init_process_group("gloo") inside
    """
    actors, _, _ = _setup(proc_mesh, master_addr, master_port, use_ipaddr, timeout)
    actors.stop().get(timeout=timeout)


async def setup_torch_elastic_env_async(
    proc_mesh: ProcMesh,
    master_addr: str | None = None,
    master_port: int | None = None,
    use_ipaddr: str | None = None,
    timeout: float = 60.0,
) -> None:
    """:func:`setup_torch_elastic_env` for asyncio code (runs it on a worker thread)."""
    import asyncio

    await asyncio.get_running_loop().run_in_executor(None, setup_torch_elastic_env, proc_mesh, master_addr, master_port, use_ipaddr, timeout)
