"""Measure per-layer costs of a model: forward+backward time, parameter and activation bytes.

:func:`profile_layers` times each layer in place, inside whole training
passes of the model (forward, then backward from all-ones output gradients
into every parameter, with ``torch.autograd.grad`` so no ``.grad`` is
touched), so caches and allocator behave as in training. Forward hooks
timestamp each layer's forward; tensor hooks on its output and inputs
timestamp when its backward starts (output gradient ready) and ends (input
gradient ready; for a layer without an input gradient, such as an embedding,
when the next layer's backward starts or backward ends). A layer's time is
the fastest over ``repeats`` passes after ``warmup`` passes (other work on
the machine only ever adds time), with the device synchronised
at each timestamp (CUDA and other accelerators). Activation bytes are the
storages autograd saves for backward during the layer's forward (saved-tensor
hooks; parameters excluded; each storage once, to the first layer that saves
it). The RNG state is restored afterwards.

Which layers: ``blocks`` if given; else, when ``model.blocks`` is an
``nn.ModuleList``, every top-level child the forward calls, in call order,
with ``blocks`` expanded into one entry per block (so embeddings come first
and norm/head last, named ``tok_emb``, ``blocks.0``, ..., ``head``); else the
top-level children the forward calls. Work done in ``model.forward`` itself
(outside any child, e.g. adding position embeddings) is not attributed, and a
child called twice is profiled on its first call.

:class:`Link` holds what collectives cost (bandwidth, latency, the slowdown
of all-gather/reduce-scatter and of FSDP's calls) for
:func:`actormesh.parallel.auto_plan`; :func:`measure_link` measures one
between two local procs with gloo (``link_gbps="measure"``).

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    >>> costs = profile_layers(model, torch.randn(4, 8), repeats=1)
    >>> [c.name for c in costs], costs[0].param_bytes
    (['0', '1', '2'], 2304)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._partition import LayerCost

__all__ = ["Link", "batch_size_of", "measure_link", "model_inputs", "profile_layers", "slice_batch"]


def model_inputs(sample_batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` to call the model with, from a sample batch.

    A tensor is the input; a dict gives keyword arguments; a tuple or list is
    ``(inputs, targets)`` as ``Trainer.step`` takes it (targets are ignored,
    and ``inputs`` may itself be a tuple of positional arguments).

    Example:
        >>> model_inputs(("x", "y"))
        (('x',), {})
    """
    if isinstance(sample_batch, dict):
        return (), dict(sample_batch)
    if isinstance(sample_batch, (tuple, list)):
        if not sample_batch:
            raise ValueError("sample_batch is an empty sequence: pass the model input or (inputs, targets)")
        inputs = sample_batch[0]
        return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), {}
    return (sample_batch,), {}


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def batch_size_of(sample_batch: Any) -> int:
    """Leading dimension of the first input tensor (the global batch size).

    Example:
        >>> import torch
        >>> batch_size_of((torch.zeros(6, 3), torch.zeros(6)))
        6
    """
    args, kwargs = model_inputs(sample_batch)
    found = [t for t in _tensors((args, kwargs)) if t.dim() > 0]
    if not found:
        raise ValueError("sample_batch holds no tensor with a batch dimension")
    return int(found[0].shape[0])


def slice_batch(sample_batch: Any, n: int) -> Any:
    """The first ``n`` samples of every tensor whose leading dimension is the batch size."""
    import torch

    size = batch_size_of(sample_batch)

    def cut(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj[:n] if obj.dim() > 0 and obj.shape[0] == size else obj
        if isinstance(obj, (tuple, list)):
            return type(obj)(cut(o) for o in obj)
        if isinstance(obj, dict):
            return {k: cut(v) for k, v in obj.items()}
        return obj

    return cut(sample_batch)


def _entries(model: Any, blocks: Sequence[Any] | None) -> list[tuple[str, Any]]:
    from torch import nn

    names = {id(m): n for n, m in model.named_modules()}
    if blocks is not None:
        mods = list(blocks)
        if not mods or not all(isinstance(m, nn.Module) for m in mods):
            raise TypeError("blocks must be a non-empty sequence of nn.Module")
        return [(names.get(id(m), f"block{i}"), m) for i, m in enumerate(mods)]
    out: list[tuple[str, Any]] = []
    for name, child in model.named_children():
        if child is None:
            continue
        if name == "blocks" and isinstance(child, nn.ModuleList):
            out.extend((f"blocks.{i}", b) for i, b in enumerate(child) if b is not None)
        else:
            out.append((name, child))
    if not out:
        raise ValueError(f"{type(model).__name__} has no child modules to profile: pass blocks=[...]")
    return out


def _sync(device: Any) -> None:
    import torch

    if device.type != "cpu":
        mod = getattr(torch, device.type, None)
        if mod is not None and hasattr(mod, "synchronize"):
            mod.synchronize()


def _nbytes(tensors: Sequence[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Recorder:
    """Hooks that timestamp each layer's forward and backward and attribute saved tensors to it."""

    def __init__(self, device: Any, param_ptrs: set[int]) -> None:
        self.device, self.param_ptrs = device, param_ptrs
        self.reset()

    def reset(self) -> None:
        self.fwd: dict[int, list[float]] = {}
        self.bwd_start: dict[int, float] = {}
        self.bwd_end: dict[int, float] = {}
        self.saved: dict[int, tuple[int, int]] = {}  # storage -> (layer, bytes)
        self.out_bytes: dict[int, int] = {}
        self.order: list[int] = []
        self.current: int | None = None

    def now(self) -> float:
        _sync(self.device)
        return time.perf_counter()

    def _on_grad(self, store: dict[int, float], i: int, pick: Callable[[float, float], float]) -> Callable[[Any], None]:
        def hook(_grad: Any) -> None:
            t = self.now()
            store[i] = pick(store.get(i, t), t)

        return hook

    def pre(self, i: int) -> Callable[..., None]:
        def hook(_mod: Any, args: Any, kwargs: Any) -> None:
            if i in self.fwd:  # a layer called twice is timed on its first call
                return
            for t in _tensors((args, kwargs)):
                if t.requires_grad:  # its gradient is ready when this layer's backward is done
                    t.register_hook(self._on_grad(self.bwd_end, i, max))
            self.order.append(i)
            self.current = i
            self.fwd[i] = [self.now(), math.nan]

        return hook

    def post(self, i: int) -> Callable[..., None]:
        def hook(_mod: Any, _args: Any, _kwargs: Any, out: Any) -> None:
            if not math.isnan(self.fwd[i][1]):
                return
            self.fwd[i][1] = self.now()
            self.current = None
            outs = _tensors(out)
            self.out_bytes[i] = _nbytes(outs)
            for t in outs:
                if t.requires_grad:  # the layer's backward starts when its output gradient is ready
                    t.register_hook(self._on_grad(self.bwd_start, i, min))

        return hook

    def pack(self, t: Any) -> Any:
        ptr = t.untyped_storage().data_ptr()
        if self.current is not None and ptr not in self.param_ptrs and ptr not in self.saved:
            self.saved[ptr] = (self.current, t.untyped_storage().nbytes())
        return t

    def seconds(self, i: int, end: float) -> float:
        """Forward plus backward of layer ``i``; without an input gradient, backward ends at the next layer's start."""
        fwd = self.fwd[i][1] - self.fwd[i][0]
        start = self.bwd_start.get(i)
        if start is None:
            return fwd
        stop = self.bwd_end.get(i)
        if stop is None:
            stop = min([t for t in self.bwd_start.values() if t > start] + [end])
        return fwd + max(0.0, stop - start)


def profile_layers(
    model: Any,
    sample_batch: Any,
    *,
    blocks: Sequence[Any] | None = None,
    warmup: int = 1,
    repeats: int = 3,
) -> list[LayerCost]:
    """Per-layer forward+backward time, parameter bytes and activation bytes, measured here.

    ``sample_batch`` is the model input (see :func:`model_inputs`), on the
    model's device. Returns one :class:`LayerCost` per layer in execution
    order (see the module docstring for which layers); parameters shared by
    several layers count in the first. Layers the forward never calls are
    left out.

    Example:
        >>> import torch
        >>> from actormesh.parallel.models import gpt
        >>> costs = profile_layers(gpt(n_blocks=2), torch.zeros(2, 16, dtype=torch.long), repeats=1)
        >>> [c.name for c in costs]
        ['tok_emb', 'pos_emb', 'blocks.0', 'blocks.1', 'norm', 'head']
    """
    import torch

    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    entries = _entries(model, blocks)
    args, kwargs = model_inputs(sample_batch)
    params = [p for p in model.parameters() if p.requires_grad]
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    rec = _Recorder(device, {p.untyped_storage().data_ptr() for p in model.parameters()})
    handles = [h for i, (_, m) in enumerate(entries) for h in (
        m.register_forward_pre_hook(rec.pre(i), with_kwargs=True),
        m.register_forward_hook(rec.post(i), with_kwargs=True))]
    runs: list[list[float]] = []
    try:
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []), torch.enable_grad():
            for r in range(warmup + repeats):
                rec.reset()
                with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
                    out = model(*args, **kwargs)
                outs = [t for t in _tensors(out) if t.requires_grad]
                if outs and params:
                    torch.autograd.grad(outs, params, grad_outputs=[torch.ones_like(t) for t in outs], allow_unused=True)
                end = rec.now()
                del out, outs
                if r >= warmup:
                    runs.append([rec.seconds(i, end) for i in rec.order])
    finally:
        for h in handles:
            h.remove()
    if not rec.order:
        raise ValueError("the model's forward called none of the layers to profile")
    return _layer_costs(rec, entries, runs)


def _layer_costs(rec: _Recorder, entries: Sequence[tuple[str, Any]], runs: list[list[float]]) -> list[LayerCost]:
    """One LayerCost per layer the forward called, in call order: the best run's time,
    the parameters it is the first to use, and the activations it saved."""
    act = {i: 0 for i in rec.order}
    for layer, nbytes in rec.saved.values():
        act[layer] += nbytes
    seen: set[int] = set()
    costs: list[LayerCost] = []
    for k, i in enumerate(rec.order):
        name, mod = entries[i]
        own = [p for p in mod.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        seconds = min(run[k] for run in runs)
        costs.append(LayerCost(seconds, _nbytes(own), act[i], name, rec.out_bytes.get(i, 0)))
    return costs


@dataclass(frozen=True)
class Link:
    """What collectives cost between ranks, for :func:`actormesh.parallel.auto_plan`'s model.

    ``gbps``: ring bandwidth (Gbit/s) of an all-reduce; ``latency_s`` per
    message; ``sharded_factor``: all-gather and reduce-scatter time over the
    ring model's (torch's gloo runs them several times slower than its
    all-reduce; about 1 on NCCL); ``fsdp_call_s``: time of each FSDP2
    collective call beyond its bytes (its CPU-side work and latency) between
    two ranks. The defaults were measured on this 2-core box with gloo over
    loopback (torch 2.13); ``measure_link()`` measures all four.

    Example:
        >>> Link(gbps=100.0, sharded_factor=1.0).gbps
        100.0
    """

    gbps: float = 12.0
    latency_s: float = 50e-6
    sharded_factor: float = 2.5
    fsdp_call_s: float = 0.6e-3
    source: str = "defaults measured on a 2-core box, gloo over loopback"


_LINK_WORKER = """
import json, sys, time, warnings
import torch, torch.distributed as dist
warnings.simplefilter("ignore")
rank, port, nbytes, iters = map(int, sys.argv[1:5])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
full, half, tiny = torch.ones(nbytes // 4), torch.ones(nbytes // 8), torch.ones(1)
def layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(8)])
ddp, fsdp, mesh = torch.nn.parallel.DistributedDataParallel(layers()), layers(), init_device_mesh("cpu", (2,))
for layer in fsdp:
    fully_shard(layer, mesh=mesh)
x = torch.ones(4, 8)
ops = [lambda: dist.all_reduce(tiny), lambda: dist.all_reduce(full),
       lambda: dist.all_gather_into_tensor(full, half), lambda: dist.reduce_scatter_tensor(half, full),
       lambda: ddp(x).sum().backward(), lambda: fsdp(x).sum().backward()]
result = []
for op in ops:
    for _ in range(2):
        op()
    best = float("inf")
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        op()
        best = min(best, time.perf_counter() - t0)
    result.append(best)
dist.barrier()
dist.destroy_process_group()
print(json.dumps(result))
"""


def measure_link(nbytes: int = 8 << 20, iters: int = 10, timeout_s: float = 120.0) -> Link:
    """Measure a :class:`Link` between two local procs with gloo (about 10 s).

    Two ``python -c`` workers time, each the fastest of ``iters`` started
    together after a barrier: all-reduces of 4 bytes and of ``nbytes`` (a
    two-rank all-reduce takes ``2 * latency + nbytes / bw``), an all-gather
    into and a reduce-scatter of ``nbytes`` (their time over that model's is
    ``sharded_factor``), and a training pass of 8 small Linear layers under
    DDP and under FSDP2 (``fully_shard`` per layer): the difference over the
    24 FSDP collectives is ``fsdp_call_s``.
    """
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", _LINK_WORKER]
    procs = [subprocess.Popen([*cmd, str(r), str(port), str(nbytes), str(iters)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lines = [ln for ln in outs[0][0].splitlines() if ln.startswith("[")]
    if not lines:
        err = next((e for (_, e), p in zip(outs, procs) if p.returncode), "") or "no result"
        raise RuntimeError(f"link measurement failed: {err.strip().splitlines()[-1]}")
    small, big, gather, scatter, ddp, fsdp = json.loads(lines[0])
    latency = max(small / 2, 1e-7)
    bw = nbytes / max(big - small, 1e-9)
    return Link(gbps=8 * bw / 1e9, latency_s=latency,
                sharded_factor=max(1.0, (gather + scatter) / 2 / (nbytes / 2 / bw + latency)),
                fsdp_call_s=max(latency, (fsdp - ddp) / 24), source="measured: gloo between 2 local procs")
