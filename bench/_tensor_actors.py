"""Actors for ``bench.tensor_bench``'s baselines: torch DDP and ``dist.all_reduce``
run SPMD-style in an actor per proc (gloo), timed inside the actors.

Only the tensor bench's workers import this module (it imports torch lazily
anyway, so importing it is cheap everywhere).
"""

from __future__ import annotations

import os
import time
from typing import Any

from actormesh.actor import Actor, endpoint

#: The MLP of the training figure: in -> hidden -> out, batch rows per rank.
IN, HIDDEN, OUT, BATCH, LR = 1024, 1024, 1024, 64, 0.01


def make_mlp() -> Any:
    """The training figure's 2-layer MLP (seed 0), built with whatever torch mode is active."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))


class ThreadProbe(Actor):
    """Pins torch to one intra-op thread in its proc (fair on 2 cores) and says what it got."""

    @endpoint
    def threads(self) -> tuple[int, str]:
        import torch

        torch.set_num_threads(1)
        return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS", "")


class SPMDBench(Actor):
    """One rank of a gloo world made by ``actormesh.spmd`` (call ``setup_torch_elastic_env`` first)."""

    def __init__(self) -> None:
        import torch

        from actormesh.spmd import init_process_group

        torch.set_num_threads(1)
        init_process_group("gloo", timeout_s=120)
        self.step: Any = None
        self.buffers: dict[int, Any] = {}

    @endpoint
    def setup_ddp(self) -> int:
        """Build the MLP under DDP with SGD on fixed data; returns the parameter count."""
        import torch
        import torch.nn.functional as F

        model = torch.nn.parallel.DistributedDataParallel(make_mlp())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        x, y = torch.randn(BATCH, IN), torch.randn(BATCH, OUT)

        def step() -> Any:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        self.step = step
        return sum(p.numel() for p in model.parameters())

    @endpoint
    def ddp_steps(self, k: int) -> float:
        """Seconds per step over ``k`` steps, until the last loss is read."""
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            loss = self.step()
        loss.item()
        return (time.perf_counter() - t0) / k

    @endpoint
    def all_reduce(self, numel: int, m: int, clone: bool = False) -> float:
        """Seconds per ``dist.all_reduce`` (sum) of ``numel`` float32s, over ``m`` calls; in place,
        or with ``clone`` on a fresh copy each call (torch's way to an out-of-place result)."""
        import torch
        import torch.distributed as dist

        t = self.buffers.get(numel)
        if t is None:
            t = self.buffers[numel] = torch.zeros(numel)
            dist.all_reduce(t)  # warm-up: gloo's buffers for this size
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(m):
            if clone:
                u = t.clone()
                dist.all_reduce(u)
                del u
            else:
                dist.all_reduce(t)
        return (time.perf_counter() - t0) / m

    @endpoint
    def concurrency(self) -> float:
        """How many ranks really run at once (see ``bench.partition_bench.concurrency``)."""
        import torch.distributed as dist

        from bench.partition_bench import concurrency

        return concurrency(dist.get_rank(), dist.get_world_size())

    def __cleanup__(self, exc: Exception | None = None) -> None:
        import gc

        from actormesh.spmd import destroy_process_group

        self.step = None
        self.buffers.clear()
        gc.collect()  # DDP's reducer holds the group
        destroy_process_group()
