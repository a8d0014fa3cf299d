"""Shapes on the controller without a round trip: run an op once on fake tensors,
remember what came out, and answer the next op with the same input metadata
from the cache.

A cache entry maps (op, every argument's metadata or value) to an *output
spec*: the pytree structure of the result and, per leaf, either "this input
itself" (in-place ops, ``out=``), "a new tensor with this metadata", or a plain
value. Building outputs from a spec costs one wrapper allocation per tensor;
running FakeTensorMode costs ~300 us, so the cache is what makes dispatch cheap.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["Meta", "meta_of", "fake_from_meta", "fake_mode", "OutputSpec", "propagate", "DataDependent"]

#: (size, stride, storage_offset, dtype, device): all a controller knows of a shard.
Meta = tuple

_local = threading.local()
_CACHE_MAX = 65536
_cache: dict[Any, "OutputSpec"] = {}

_NEW, _INPUT, _VALUE = 0, 1, 2


class DataDependent(Exception):
    """The op's result depends on tensor values (``.item()``, ``nonzero``): the
    controller cannot know it without asking a worker."""


class _QuietWhilePropagating(logging.Filter):
    """FakeTensorMode logs a full traceback for every op that fails shape checks;
    here that failure is re-raised at the user's call site, so the log is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_local, "propagating", False)


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QuietWhilePropagating())


def fake_mode() -> Any:
    """This thread's FakeTensorMode (fake tensors never mix across modes)."""
    mode = getattr(_local, "mode", None)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = _local.mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def meta_of(t: torch.Tensor) -> Meta:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device)


def fake_from_meta(meta: Meta) -> torch.Tensor:
    """A fake tensor with exactly this metadata (under this thread's fake mode)."""
    size, stride, offset, dtype, device = meta
    with fake_mode():
        if offset == 0:
            return torch.empty_strided(size, stride, dtype=dtype, device=device)
        extent = offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1 if all(size) else offset
        base = torch.empty((max(extent, 1),), dtype=dtype, device=device)
        return base.as_strided(size, stride, offset)


class OutputSpec:
    """How to build an op's result from its inputs (see the module doc)."""

    __slots__ = ("treespec", "leaves", "single")

    def __init__(self, treespec: Any, leaves: list[tuple[int, Any]]) -> None:
        self.treespec = treespec
        self.leaves = leaves
        #: the common case, one new tensor: skips pytree entirely
        self.single = leaves[0][1] if treespec is None else None


def _fake_args(args: Any, kwargs: Any, inputs: list[Any]) -> tuple[Any, Any, list[torch.Tensor]]:
    fakes: list[torch.Tensor] = []
    index = {id(t): i for i, t in enumerate(inputs)}

    def swap(x: Any) -> Any:
        i = index.get(id(x))
        if i is not None:
            while len(fakes) <= i:
                fakes.append(None)  # type: ignore[arg-type]
            if fakes[i] is None:
                fakes[i] = fake_from_meta(x._meta)
            return fakes[i]
        return x

    fa, fk = pytree.tree_map(swap, (args, kwargs))
    return fa, fk, fakes


def propagate(func: Any, args: Any, kwargs: Any, inputs: list[Any], key: Any) -> OutputSpec:
    """The output spec of ``func(*args, **kwargs)``, cached under ``key`` (None: uncacheable).

    ``inputs`` are the distributed tensors among the arguments, in scan order.
    Raises DataDependent when fake tensors cannot tell.
    """
    if key is not None:
        spec = _cache.get(key)
        if spec is not None:
            return spec
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    fa, fk, fakes = _fake_args(args, kwargs, inputs)
    _local.propagating = True
    try:
        with fake_mode():
            out = func(*fa, **fk)
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        raise DataDependent(str(exc)) from None
    finally:
        _local.propagating = False
    by_id = {id(f): i for i, f in enumerate(fakes) if f is not None}
    if isinstance(out, torch.Tensor) and id(out) not in by_id:
        spec = OutputSpec(None, [(_NEW, meta_of(out))])
    else:
        flat, treespec = pytree.tree_flatten(out)
        leaves: list[tuple[int, Any]] = []
        for leaf in flat:
            if isinstance(leaf, torch.Tensor):
                i = by_id.get(id(leaf))
                if i is not None:
                    if meta_of(leaf) != inputs[i]._meta:
                        raise TypeError(
                            f"{func} changes the shape or strides of its input in place; distributed tensors keep "
                            f"their shape: use the out-of-place form (e.g. t = t.t() instead of t.t_())"
                        )
                    leaves.append((_INPUT, i))
                else:
                    leaves.append((_NEW, meta_of(leaf)))
            else:
                leaves.append((_VALUE, leaf))
        spec = OutputSpec(treespec, leaves)
    if key is not None:
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        _cache[key] = spec
    return spec


def cache_size() -> int:
    """Entries in the propagation cache (for benchmarks and tests)."""
    return len(_cache)
