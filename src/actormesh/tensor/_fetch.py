"""Bringing shards to the controller: ``fetch_shard``, ``inspect``, ``show``."""

from __future__ import annotations

from typing import Any

from torch.utils import _pytree as pytree

from ..runtime import Future
from ._tensor import Tensor

__all__ = ["fetch_shard", "inspect", "show", "shard_index"]


def shard_index(view: Any, shard: dict[str, int] | None, coords: dict[str, int]) -> int:
    """The index in ``view`` of the proc at these coordinates (all 0 if none given)."""
    where = dict(shard or {})
    where.update(coords)
    shape = view.shape
    labels, sizes = shape.labels, shape.sizes
    unknown = [d for d in where if d not in labels]
    if unknown:
        raise KeyError(f"{unknown[0]!r} is not a dim of the tensor's mesh {dict(zip(labels, sizes))}")
    if where:
        missing = [d for d in labels if d not in where]
        if missing:
            raise ValueError(f"fetch_shard needs a coordinate for every dim of the mesh {dict(zip(labels, sizes))}: "
                             f"missing {', '.join(missing)} (give none at all for coordinate 0 everywhere)")
    index, stride = 0, 1
    for label, size in zip(reversed(labels), reversed(sizes)):
        c = where.get(label, 0)
        if not isinstance(c, int) or not 0 <= c < size:
            raise ValueError(f"coordinate {label}={c!r} is out of range for size {size}")
        index += c * stride
        stride *= size
    return index


def fetch_shard(obj: Any, shard: dict[str, int] | None = None, **coords: int) -> Future[Any]:
    """A Future of ``obj`` (a pytree) with each distributed tensor replaced by its
    shard at ``coords`` as a local CPU tensor.

    >>> actormesh.fetch_shard(t, gpu=1).result()       # doctest: +SKIP
    """
    leaves, spec = pytree.tree_flatten(obj)
    tensors = [(i, x) for i, x in enumerate(leaves) if isinstance(x, Tensor)]
    if not tensors:
        return Future.completed(obj)
    view = tensors[0][1]._view
    for _, t in tensors:
        if t._view is not view:
            raise TypeError(f"fetch_shard: tensors of different meshes ({dict(view.procs.sizes)} and {dict(t._view.procs.sizes)}); fetch them separately")
        if t.dropped:
            raise TypeError("fetch_shard: DROPPED: a tensor deleted with t.drop() cannot be fetched")
    index = shard_index(view, shard, coords)

    def rebuild(values: list[Any]) -> Any:
        out = list(leaves)
        for (i, _), v in zip(tensors, values):
            out[i] = v
        return pytree.tree_unflatten(out, spec)

    return view.client.fetch(view, index, [t._ref.id for _, t in tensors]).then(rebuild)


def inspect(obj: Any, shard: dict[str, int] | None = None, **coords: int) -> Any:
    """``fetch_shard(obj, shard, **coords).result()``: the local value, blocking."""
    return fetch_shard(obj, shard, **coords).result()


def show(obj: Any, shard: dict[str, int] | None = None, **coords: int) -> Any:
    """Display a fetched shard (with ``torchshow`` when installed, else print it)."""
    value = inspect(obj, shard, **coords)
    try:
        import torchshow  # type: ignore[import-not-found]
    except ImportError:
        print(value)
        return None
    return torchshow.show(value)
