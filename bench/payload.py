"""Tensor payloads: ``sum`` (send a tensor, get a float) and ``echo`` (send it, get it back).

torch float32 tensors of 1, 16, 128 and 512 MiB to one worker proc. GB/s = bytes
moved / wall time of ``call_one(t).get()`` (echo moves the tensor twice), GB =
1e9 bytes, median of a few reps after one warm-up call per size and op. The
reference is ``dst.copy_(src)`` of the same size in the same process and run
(bytes copied / time): what one memcpy costs on this machine. For 1 MiB that
is cache bandwidth, not DRAM.

torch is set to one intra-op thread in the controller and in the actor: the
transport is under test, not torch's OpenMP pool, whose barriers on a 2-core
shared machine turn a 0.1 ms ``sum`` or ``copy_`` into 5-20 ms at random.
(The transport's own shared-memory copies split large buffers over the cores.)

Buffers of at least ``shm_threshold_bytes`` (1 MiB) go through shared memory.
``echo_socket`` repeats the echo with that path off (threshold 0, in the
controller and in a second worker), so both paths are measured in one run.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench._actors import Tensors
from bench._api import this_host
from bench._util import GET_TIMEOUT_S, now, stop_procs

MiB = 1 << 20
SIZES_MIB = (1, 16, 128, 512)
OPS = ("sum", "echo", "echo_socket")


def _reps(size_mib: int, quick: bool) -> int:
    if quick:
        return {1: 5, 16: 3}.get(size_mib, 2)
    return {1: 30, 16: 10, 512: 3}.get(size_mib, 5)


def run(quick: bool = False, sizes_mib: list[int] | None = None, ops: list[str] | None = None) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    sizes = list(sizes_mib or SIZES_MIB)
    ops = list(ops or OPS)
    out: dict[str, Any] = {"info": {"torch": torch.__version__, "torch_threads": torch.get_num_threads(), "times_s": {}}}
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    socket_procs = None
    try:
        actor = procs.spawn("tensors", Tensors)
        actor.echo.call_one(b"x").get(timeout=GET_TIMEOUT_S)  # connected (with shared memory) before the switch below
        if "echo_socket" in ops:
            socket_procs, socket_actor = _socket_only_actor()
        for size in sizes:
            nbytes = size * MiB
            src = torch.ones(nbytes // 4, dtype=torch.float32)
            # memory-bandwidth reference
            dst = torch.empty_like(src)
            dst.copy_(src)
            copies = []
            for _ in range(max(10, _reps(size, quick))):
                t0 = now()
                dst.copy_(src)
                copies.append(now() - t0)
            out[f"copy_{size}MiB_GBs"] = nbytes / statistics.median(copies) / 1e9
            out["info"][f"copy_{size}MiB_best_GBs"] = nbytes / min(copies) / 1e9
            del dst
            for op in ops:
                ep = socket_actor.echo if op == "echo_socket" else getattr(actor, op)
                moved = nbytes * (1 if op == "sum" else 2)
                first = ep.call_one(src).get(timeout=GET_TIMEOUT_S)  # warm-up + sanity check
                if op == "sum":
                    assert abs(first - src.numel()) < 1e-3 * src.numel(), first
                else:
                    assert tuple(first.shape) == tuple(src.shape) and float(first[-1]) == 1.0
                del first
                times = []
                for _ in range(_reps(size, quick)):
                    t0 = now()
                    r = ep.call_one(src).get(timeout=GET_TIMEOUT_S)
                    times.append(now() - t0)
                    del r
                out[f"{op}_{size}MiB_GBs"] = moved / statistics.median(times) / 1e9
                out["info"]["times_s"][f"{op}_{size}MiB"] = times
                out["info"][f"{op}_{size}MiB_best_GBs"] = moved / min(times) / 1e9
            del src
    finally:
        stop_procs(procs)
        if socket_procs is not None:
            stop_procs(socket_procs)
    return out


def _socket_only_actor() -> tuple[Any, Any]:
    """A worker whose connection to the controller never uses shared memory (both directions)."""
    try:
        from actormesh import config
        from actormesh.runtime._context import current_runtime
    except ImportError:  # Monarch: no such path to switch off
        return None, None
    pool = current_runtime().shm
    saved, pool.threshold = pool.threshold, 0  # connections made now stay socket-only
    try:
        with config.configured(shm_threshold_bytes=0):
            procs = this_host().spawn_procs(per_host={"gpus": 1})
            actor = procs.spawn("tensors", Tensors)
            actor.echo.call_one(b"x").get(timeout=GET_TIMEOUT_S)  # connect both ways now
    finally:
        pool.threshold = saved
    return procs, actor
