"""Per-step figures a trainer returns: loss, gradient norm, learning rate, throughput, MFU, memory.

Every rank measures its own step time and peak memory; one all-reduce of a
few numbers per rank (the same collective that averages the loss) gives
every rank the whole mesh's figures, so the controller reads any one rank's.

Memory is torch's own accounting on CUDA (``max_memory_allocated`` since the
step began) and the process's peak resident set size on CPU (``ru_maxrss``,
a high-water mark over the proc's life: CPU tensors have no allocator
statistics).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["StepFigures", "gather_figures", "peak_memory_bytes", "reset_peak_memory", "measure_matmul_flops", "peak_flops", "state_bytes"]


@dataclass(frozen=True)
class StepFigures:
    """What one optimizer step did, the same on every rank.

    ``step`` counts optimizer steps done (this one included); ``tokens`` is
    the number of input elements in the global batch (``B * T`` for token
    ids); ``mfu`` is None unless a peak figure was given or measured
    (``TrainOptions.peak_flops``); ``peak_memory_bytes[r]`` is rank ``r``'s
    peak (``memory_kind`` says which accounting). Under an elastic trainer,
    ``recovery`` says what this step had to recover from (None: nothing) and
    ``restarts`` counts recoveries so far.
    """

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    step_s: float
    tokens_per_s: float
    mfu: float | None
    peak_memory_bytes: tuple[int, ...]
    memory_kind: str
    recovery: str | None = None
    restarts: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The figures as a plain dict (for logging or JSON)."""
        return asdict(self)


def reset_peak_memory(device: Any) -> None:
    """Start this step's CUDA peak from now (CPU keeps its lifetime high-water mark)."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: Any) -> tuple[int, str]:
    """This rank's peak memory and which accounting gave it."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "rss_peak"  # Linux reports KiB


def gather_figures(*, loss: float | None, device: Any, started: float, step: int, grad_norm: float, lr: float,
                   local_tokens: int, dp_size: int, flops_per_token: float | None, peak_flops: float | None) -> StepFigures:
    """All-reduce (loss, has loss, every rank's peak memory) over the world; the step's figures.

    ``loss`` is None on pipeline ranks without the last stage; the mean is
    taken over the ranks that have one. ``local_tokens`` is this rank's share
    of the batch; there are ``dp_size`` shares.
    """
    import torch
    import torch.distributed as dist

    memory, kind = peak_memory_bytes(device)
    world = dist.get_world_size()
    # One all-reduce (as cheap as the loss average alone): each rank fills its own memory slot, the sum is the table.
    row = torch.zeros(2 + world, dtype=torch.float64)
    row[0], row[1], row[2 + dist.get_rank()] = loss or 0.0, 0.0 if loss is None else 1.0, float(memory)
    dist.all_reduce(row)
    step_s = time.perf_counter() - started
    tokens = local_tokens * dp_size
    rate = tokens / step_s if step_s > 0 else 0.0
    mfu = None
    if flops_per_token is not None and peak_flops:
        mfu = rate * flops_per_token / (peak_flops * world)
    return StepFigures(step=step, loss=float(row[0] / row[1]), grad_norm=grad_norm, lr=lr,
                       tokens=tokens, step_s=step_s, tokens_per_s=rate, mfu=mfu,
                       peak_memory_bytes=tuple(int(m) for m in row[2:].tolist()), memory_kind=kind)


def measure_matmul_flops(device: Any, dtype_name: str | None = None, budget_s: float = 0.3) -> float:
    """FLOP/s of a square matmul on ``device`` in ``dtype_name``, timed for about ``budget_s``.

    A stand-in for the data-sheet peak when none is given: it is what this
    device reaches on dense matmul now (MFU against it reads high next to a
    data-sheet figure).
    """
    import torch

    dtype = getattr(torch, dtype_name) if dtype_name else torch.float32
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # CPU fp16 matmul is an emulation, not a peak
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up: kernels chosen, memory allocated
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    sync(device)
    reps, start = 0, time.perf_counter()
    deadline = start + budget_s
    while True:
        torch.mm(a, b)
        reps += 1
        if reps % 4 == 0 or device.type != "cuda":
            sync(device)
            if time.perf_counter() >= deadline:
                break
    return 2.0 * n**3 * reps / (time.perf_counter() - start)


def peak_flops(given: float | str | None, device: Any, dtype_name: str | None) -> float | None:
    """The MFU denominator per device: ``given``, or for ``"measure"`` the mean over ranks of a timed matmul (collective)."""
    import torch
    import torch.distributed as dist

    if given != "measure":
        return None if given is None else float(given)
    mean = torch.tensor([measure_matmul_flops(device, dtype_name)], dtype=torch.float64)
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def state_bytes(chunks: Any, optimizers: Any) -> dict[str, int]:
    """Bytes this rank holds in parameters, optimizer state and (during a step) gradients, from the tensors.

    DTensors count their local shard. Gradients are freed after every step
    (``zero_grad(set_to_none=True)``), so ``grads`` is what a step allocates
    for them: one local tensor per parameter, in the parameter's dtype.
    """
    import torch

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    params = [local(p) for c in chunks for p in c.parameters()]
    optim = [local(v) for opt in optimizers for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    param_bytes = sum(t.numel() * t.element_size() for t in params)
    return {"params": param_bytes, "grads": param_bytes, "optimizer": sum(t.numel() * t.element_size() for t in optim)}
