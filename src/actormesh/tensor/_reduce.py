"""Collectives over mesh dims and moving tensors between meshes, on the controller:
check the call as Monarch does, compute the output's metadata, record one command.

The workers run them with torch.distributed process groups made lazily per set
of mesh dims (``_reduce_worker``); nothing here waits for them.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ._client import View, client_for
from ._tensor import Tensor, _where

__all__ = ["reduce_tensor", "reduce", "reduce_", "move_to_mesh", "to_mesh", "slice_mesh", "MeshSliceTensor", "REDUCTIONS", "ReduceShapeError"]

REDUCTIONS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "stack")
_BITWISE = ("band", "bor", "bxor")
GROUPS, REDUCE, MOVE = 5, 6, 7


class ReduceShapeError(ValueError, TypeError):
    """A scatter whose outer dim does not match the group size (Monarch raises TypeError here)."""


def _check_dims(view: View, dims: Any, reduction: str, scatter: bool) -> tuple[str, ...]:
    labels = view.shape.labels
    dims = (dims,) if isinstance(dims, str) else tuple(dims)
    for d in dims:
        if d not in labels:
            raise KeyError(f"dim {d!r} not found in mesh {dict(view.procs.sizes)}")
    if not dims:
        dims = tuple(labels)
    if len(set(dims)) != len(dims):
        raise ValueError(f"reducing the same dimension twice: {dims}")
    if len(dims) > 1 and (reduction == "stack" or scatter):
        raise ValueError(f"reduction {reduction!r} or scatter={scatter} is not valid for multiple dimensions {dims}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction {reduction!r} not supported, reductions are {REDUCTIONS}")
    return dims


def _output_meta(t: Tensor, n: int, reduction: str, scatter: bool) -> tuple:
    size, _, _, dtype, device = t._meta
    if reduction == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"reduction 'avg' needs a floating point tensor, got {dtype}; cast it (t.float()) or use 'sum'")
    if reduction in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"reduction {reduction!r} needs an integer or bool tensor, got {dtype}")
    if scatter:
        if len(size) == 0 or size[0] != n:
            raise ReduceShapeError(f"when scattering, the outermost dimension of a tensor of size {list(size)} must match the size ({n}) of the reduced dims")
        new = size if reduction == "stack" else size[1:]
    else:
        new = (n, *size) if reduction == "stack" else size
    stride = tuple(math.prod(new[i + 1:]) for i in range(len(new)))
    return (tuple(new), stride, 0, dtype, device)


def reduce_tensor(t: Tensor, dims: Any, reduction: str = "sum", scatter: bool = False, mesh: Any = None, inplace: bool = False, out: Any = None) -> Tensor:
    """``t.reduce(...)``: all-reduce, reduce-scatter, all-gather ("stack") or all-to-all
    ("stack" + scatter) over the mesh dims ``dims`` (all dims if empty)."""
    if mesh is not None:
        raise NotImplementedError("reduce(mesh=...) (reducing onto another mesh) is not supported, as in Monarch; reduce, then t.to_mesh(mesh)")
    view = t._view
    dims = _check_dims(view, dims, reduction, scatter)
    if t.dropped:
        raise TypeError("reduce: DROPPED: this tensor was deleted with t.drop() and can no longer be used")
    if torch.is_grad_enabled() and t.requires_grad:
        raise TypeError("reduce: REQUIRES_GRAD: this tensor requires gradients but reduce does not work with autograd; "
                        "reduce under `with torch.no_grad():` (e.g. gradients after backward)")
    n = math.prod(view.procs.size(d) for d in dims)
    if inplace:
        if out is not None:
            raise ValueError("`out` cannot be used with inplace reduce.")
        if scatter != (reduction == "stack"):
            raise ValueError(f"reduction {reduction!r} with scatter={scatter} is not valid for in-place operation because "
                             "the output size will not match the input size")
    meta = _output_meta(t, n, reduction, scatter)
    client = view.client
    _ensure_groups(client)
    if inplace:
        result = t
    elif out is not None:
        if not isinstance(out, Tensor) or out._view is not view:
            raise TypeError("reduce: `out` must be a distributed tensor on the same mesh")
        if tuple(out.shape) != meta[0]:
            raise ValueError(f"The given output shape, {list(out.shape)}, is incorrect. Reduce expects the shape to be {list(meta[0])}.")
        result = out
    else:
        result = Tensor._make(meta, view)
    client.record((REDUCE, t._ref.id, result._ref.id, view.sid, dims, reduction, scatter, inplace, t._meta[4].type, _where(), t._meta[0], t._meta[3]))
    return result


def _ensure_groups(client: Any) -> None:
    """Once per mesh: a rendezvous store on its first proc, announced to all."""
    if getattr(client, "store", None) is None:
        client.flush()
        host, port = client.member(0).start_store.call_one().get()
        client.store = (host, port)
        client.record((GROUPS, host, port))


def reduce(tensors: Any, dims: Any, reduction: str = "sum", scatter: bool = False, mesh: Any = None, _inplace: bool = False) -> Any:
    """:meth:`Tensor.reduce` on every distributed tensor of a pytree."""
    return pytree.tree_map(lambda x: reduce_tensor(x, dims, reduction, scatter, mesh, _inplace) if isinstance(x, Tensor) else x, tensors)


def reduce_(tensors: Any, dims: Any, reduction: str = "sum", scatter: bool = False, mesh: Any = None) -> Any:
    """In-place :func:`reduce`."""
    return reduce(tensors, dims, reduction, scatter, mesh, _inplace=True)


def _pairs(src: View, dst: View) -> list[tuple[int, int]]:
    """(source root rank, destination root rank) for every destination point."""
    s_labels, d_labels = src.shape.labels, dst.shape.labels
    missing = [d for d in s_labels if d not in d_labels]
    if missing:
        raise ValueError(f"destination mesh does not have dimensions {set(missing)}")
    for label in d_labels:
        if label in s_labels and src.procs.size(label) != dst.procs.size(label):
            raise ValueError(f"dimension {label} of destination mesh has a different length than the source tensor's "
                             f"({dst.procs.size(label)} vs {src.procs.size(label)})")
        if label not in s_labels:
            warnings.warn(f"to_mesh is broadcasting along {label} dimension", stacklevel=4)
    out = []
    for i in range(len(dst.shape)):
        point = dst.shape.point(i)
        index = 0
        for label, size in zip(s_labels, src.shape.sizes):
            index = index * size + point[label]
        out.append((src.shape.rank_at(index), dst.shape.rank_at(i)))
    return out


def move_to_mesh(t: Tensor, src: View, mesh: Any) -> Tensor:
    """Copy the shards of ``t`` held on ``src`` (a view) onto ``mesh``'s procs."""
    if t.dropped:
        raise TypeError("to_mesh: DROPPED: this tensor was deleted with t.drop() and can no longer be used")
    if torch.is_grad_enabled() and t.requires_grad:
        raise TypeError("to_mesh: REQUIRES_GRAD: moving a tensor that requires gradients is not differentiable; "
                        "detach it or move under `with torch.no_grad():`")
    client = src.client
    if client_for(mesh) is not client:
        raise ValueError("to_mesh: the destination is not a view of the same proc mesh; tensors move between slices of one "
                         "mesh (spawn one mesh and slice it into stages)")
    dst = client.view(mesh)
    pairs = _pairs(src, dst)
    size, _, _, dtype, device = t._meta
    stride = tuple(math.prod(size[i + 1:]) for i in range(len(size)))
    result = Tensor._make((size, stride, 0, dtype, device), dst)
    _ensure_groups(client)
    client.record((MOVE, t._ref.id, result._ref.id, tuple(pairs), size, dtype, device.type, _where()))
    return result


def to_mesh(tensors: Any, mesh: Any) -> Any:
    """:meth:`Tensor.to_mesh` on every distributed tensor of a pytree."""
    return pytree.tree_map(lambda x: x.to_mesh(mesh) if isinstance(x, Tensor) else x, tensors)


class MeshSliceTensor:
    """The shards of a tensor at some coordinates (``t.slice_mesh(pp=0)``), to move elsewhere."""

    def __init__(self, tensor: Tensor, slicing: Any) -> None:
        self.tensor = tensor
        self.slicing = slicing

    def to_mesh(self, mesh: Any, stream: Any = None) -> Tensor:
        """Copy these shards onto ``mesh`` (its dims must match the slice's, or be broadcast)."""
        src = self.tensor._view.client.view(self.slicing)
        return move_to_mesh(self.tensor, src, mesh)


def slice_mesh(tensors: Any, **coords: Any) -> Any:
    """:meth:`Tensor.slice_mesh` on every distributed tensor of a pytree."""
    return pytree.tree_map(lambda x: x.slice_mesh(**coords) if isinstance(x, Tensor) else x, tensors)
