"""``ValueMesh``: one value per point of a mesh, e.g. the results of ``endpoint.call()``.

Slicing a ValueMesh is O(ndims): every slice shares the parent's value list and
only carries a :class:`Shape` whose global ranks are indices into that list.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

from ._shape import MeshTrait, Point, Shape

__all__ = ["ValueMesh"]

R = TypeVar("R")


class ValueMesh(MeshTrait, Generic[R]):
    """Values indexed by the points of a mesh, with Monarch's slicing operations.

    ``values`` are given in row-major order of ``shape``'s points (whatever its
    offset and strides); points yielded by the mesh are relative to its own extent.

    >>> vm = ValueMesh(Shape.row_major(["hosts", "gpus"], [2, 2]), ["a", "b", "c", "d"])
    >>> vm.item(hosts=1, gpus=0), vm.slice(gpus=1).values()
    ('c', ['b', 'd'])
    >>> [(dict(p), v) for p, v in vm.slice(hosts=1)]
    [({'gpus': 0}, 'c'), ({'gpus': 1}, 'd')]
    """

    # _shape: view whose global ranks index _values.  _values: shared by all
    # slices of one mesh and never mutated, so slicing needs no copy.
    __slots__ = ("_shape", "_values")

    def __init__(self, shape: Shape, values: Iterable[R]) -> None:
        if not isinstance(shape, Shape):
            raise TypeError(f"ValueMesh needs a Shape, got {type(shape).__name__} {shape!r}")
        values = list(values)
        if len(values) != shape.nelements:
            raise ValueError(f"ValueMesh over {shape} needs {shape.nelements} values (one per point, in row-major "
                             f"order), got {len(values)}")
        # The caller's offset/strides name global ranks elsewhere (e.g. actors);
        # here ranks must be list indices, so re-base onto a dense layout.
        self._shape = Shape.row_major(shape.labels, shape.sizes)
        self._values = values

    def _new_with_shape(self, shape: Shape) -> ValueMesh[R]:
        new = type(self).__new__(type(self))
        new._shape = shape
        new._values = self._values
        return new

    def __len__(self) -> int:
        return self._shape.nelements

    def values(self) -> list[R]:
        """The values in row-major (local rank) order: ``vm.values() == [vm.get(i) for i in range(len(vm))]``."""
        vals, shape = self._values, self._shape
        if shape.offset == 0 and shape.nelements == len(vals):
            # Sub-views of a dense layout that keep every rank are the identity.
            return list(vals)
        return [vals[r] for r in shape.ranks()]

    def items(self) -> Iterator[tuple[Point, R]]:
        """``(Point, value)`` pairs in rank order; points are over this mesh's extent, ranks from 0.

        >>> [(p.rank, v) for p, v in ValueMesh(Shape.row_major(["g"], [3]), "xyz").slice(g=slice(1, 3)).items()]
        [(0, 'y'), (1, 'z')]
        """
        extent, vals = self._shape.extent, self._values
        for i, rank in enumerate(self._shape.ranks()):
            yield Point._trusted(i, extent), vals[rank]

    def __iter__(self) -> Iterator[tuple[Point, R]]:
        return self.items()

    def get(self, index: int) -> R:
        """Value at local (row-major) index ``index``, ``0 <= index < len(self)``."""
        if not 0 <= index < self._shape.nelements:
            raise IndexError(f"index {index} out of range for ValueMesh over {self._shape.extent} "
                             f"with {self._shape.nelements} values")
        return self._values[self._shape.rank_at(index)]

    def item(self, **coords: int) -> R:
        """The value at ``coords``, which must name every dimension; a one-value mesh allows ``item()``.

        >>> ValueMesh(Shape.row_major(["h", "g"], [2, 2]), range(4)).item(h=1, g=0)
        2

        Raises KeyError for missing or unknown labels and IndexError for out-of-range
        coordinates (negative ones count from the end, as in :meth:`slice`).
        """
        shape = self._shape
        if not coords and shape.nelements == 1:
            return self._values[shape.offset]
        labels = shape.labels
        unknown = [k for k in coords if k not in labels]
        if unknown:
            raise KeyError(f"item() got unknown dimension(s) {unknown}; this mesh has {list(labels)}")
        missing = [k for k in labels if k not in coords]
        if missing:
            raise KeyError(f"item() is missing coordinate(s) for {missing}; pass all of {list(labels)} "
                           f"(mesh extent {shape.extent})")
        rank = shape.offset
        for label, size, stride in zip(labels, shape.sizes, shape.strides):
            c = coords[label]
            if isinstance(c, bool) or not hasattr(c, "__index__"):
                raise TypeError(f"item({label}=...) needs an int coordinate, got {type(c).__name__} {c!r}")
            c = c.__index__()
            if not -size <= c < size:
                raise IndexError(f"index out of range: {label}={c} but dimension {label!r} has size {size}")
            rank += (c % size) * stride
        return self._values[rank]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ValueMesh):
            return NotImplemented
        return self._shape.extent == other._shape.extent and self.values() == other.values()

    __hash__ = None  # type: ignore[assignment]  # holds arbitrary, possibly unhashable values

    def __reduce__(self) -> tuple[Any, ...]:
        # Only the selected values travel: pickling a 1-rank slice of a 4096-rank mesh sends one value.
        return (type(self), (Shape.row_major(self._shape.labels, self._shape.sizes), self.values()))

    def __repr__(self) -> str:
        body = "".join(f"\n  ({p}, {v!r})" for p, v in self.items())
        return f"ValueMesh({self._shape.extent}):{body}"
