"""Named, strided views over global ranks: ``Extent``, ``Point``, ``Shape``, ``MeshTrait``.

A mesh of ranks is described by a :class:`Shape`: ordered, named dimensions
(``labels``/``sizes``) plus a strided layout (``offset``/``strides``) mapping
each point of the view to a *global* rank.  Slicing never materialises rank
lists; it only produces a new Shape, so slicing a mesh of thousands of ranks is
O(ndims).  Semantics mirror PyTorch Monarch 0.7.0 (``monarch._src.actor.shape``).

>>> s = Shape.row_major(["hosts", "gpus"], [2, 4])
>>> s.slice(hosts=1, gpus=slice(1, 3)).ranks()
[5, 6]
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, Union

__all__ = ["Extent", "Point", "Shape", "MeshTrait"]


from ..extent import Extent, Point, as_int, check_ints, check_labels, row_major_strides  # noqa: F401  (re-exported)


class Shape:
    """A named, strided view over global ranks.

    Point ``(c0, c1, ...)`` of the view is global rank ``offset + sum(ci * strides[i])``;
    points are enumerated in row-major order of ``sizes``.  Strides must describe a
    non-overlapping layout (what row-major meshes and all their slices/splits are).

    >>> s = Shape.row_major(["hosts", "gpus"], [2, 4])
    >>> str(s), len(s), s.rank_at(5), s.index_of(5)
    ('{hosts=2,gpus=4}', 8, 5, 5)
    >>> t = s.slice(gpus=slice(1, None, 2))
    >>> t.ranks(), t.index_of(7)
    ([1, 3, 5, 7], 3)
    """

    __slots__ = ("_labels", "_offset", "_sizes", "_strides", "_nelements", "_rev", "_extent", "_decoder")

    def __init__(self, labels: Sequence[str], offset: int, sizes: Sequence[int], strides: Sequence[int]) -> None:
        labels = check_labels(labels)
        offset = as_int(offset, "offset")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        self._init(labels, offset, check_ints(sizes, labels, "sizes"), check_ints(strides, labels, "strides"))
        if self._nelements:
            self._build_decoder()  # validates that no two points share a rank

    @classmethod
    def _make(cls, labels: tuple[str, ...], offset: int, sizes: tuple[int, ...], strides: tuple[int, ...]) -> Shape:
        # Trusted constructor: slicing/splitting a valid Shape yields a valid one.
        self = cls.__new__(cls)
        self._init(labels, offset, sizes, strides)
        return self

    def _init(self, labels: tuple[str, ...], offset: int, sizes: tuple[int, ...], strides: tuple[int, ...]) -> None:
        self._labels = labels
        self._offset = offset
        self._sizes = sizes
        self._strides = strides
        self._nelements = math.prod(sizes)
        self._rev = tuple(zip(reversed(sizes), reversed(strides)))  # for rank_at
        self._extent: Extent | None = None
        self._decoder: tuple[tuple[int, int, int], ...] | None = None

    def _build_decoder(self) -> tuple[tuple[int, int, int], ...]:
        # index_of decodes a rank greedily, largest stride first.  That is exact
        # iff every stride exceeds the span of all smaller-stride dims, which
        # also guarantees distinct points have distinct ranks.
        local = row_major_strides(self._sizes)
        dims = sorted(((st, sz, lo) for st, sz, lo in zip(self._strides, self._sizes, local) if sz > 1),
                      key=lambda d: -d[0])
        span = 0
        for stride, size, _ in reversed(dims):
            if stride <= span:
                raise ValueError(f"strides {list(self._strides)} with sizes {list(self._sizes)} map several "
                                 "points to one rank or interleave dims; use non-overlapping strides "
                                 "(e.g. Shape.row_major)")
            span += (size - 1) * stride
        self._decoder = tuple(dims)
        return self._decoder

    @classmethod
    def row_major(cls, labels: Sequence[str], sizes: Sequence[int], offset: int = 0) -> Shape:
        """Dense row-major shape: ``Shape.row_major(["h", "g"], [2, 4])`` has ranks ``offset..offset+7``."""
        labels = check_labels(labels)
        sizes = check_ints(sizes, labels, "sizes")
        offset = as_int(offset, "offset")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        return cls._make(labels, offset, sizes, row_major_strides(sizes))

    @classmethod
    def unity(cls) -> Shape:
        """The 0-dimensional shape holding the single rank 0."""
        return cls._make((), 0, (), ())

    @property
    def labels(self) -> tuple[str, ...]:
        """Dimension names, in order."""
        return self._labels

    @property
    def sizes(self) -> tuple[int, ...]:
        """Dimension sizes, in label order."""
        return self._sizes

    @property
    def strides(self) -> tuple[int, ...]:
        """Global-rank step of each dimension."""
        return self._strides

    @property
    def offset(self) -> int:
        """Global rank of the first point."""
        return self._offset

    @property
    def nelements(self) -> int:
        """Number of ranks in the view."""
        return self._nelements

    @property
    def extent(self) -> Extent:
        """The view's labels and sizes as an :class:`Extent` (cached)."""
        if self._extent is None:
            self._extent = Extent(self._labels, self._sizes)
        return self._extent

    def __len__(self) -> int:
        return self._nelements

    def ranks(self) -> list[int]:
        """Global ranks of the view in row-major order: ``Shape.row_major(["a"], [3], 2).ranks() == [2, 3, 4]``."""
        out = [self._offset]
        for size, stride in zip(self._sizes, self._strides):
            steps = [c * stride for c in range(size)]
            out = [r + d for r in out for d in steps]
        return out

    def rank_at(self, index: int) -> int:
        """Global rank of the ``index``-th point (row-major), in O(ndims) without building a list."""
        if not 0 <= index < self._nelements:
            raise IndexError(f"index {index} out of range for shape {self} with {self._nelements} ranks")
        rank = self._offset
        for size, stride in self._rev:
            rank += (index % size) * stride
            index //= size
        return rank

    def index_of(self, rank: int) -> int:
        """Row-major index of global ``rank`` in the view (inverse of :meth:`rank_at`); ValueError if absent."""
        pos = operator.index(rank) - self._offset
        decoder = self._decoder
        if decoder is None:
            if not self._nelements:
                raise ValueError(f"rank {rank} is not in empty shape {self}")
            decoder = self._build_decoder()
        index = 0
        if pos >= 0:
            for stride, size, local in decoder:
                c = pos // stride
                if c >= size:
                    break
                pos -= c * stride
                index += c * local
        if pos != 0:  # negative, leftover or out-of-range coordinate
            raise ValueError(f"rank {rank} is not in shape {self!r}")
        return index

    def point(self, index: int) -> Point:
        """The ``index``-th point, relative to this view's own extent."""
        return Point(index, self.extent)

    def _dim(self, label: str) -> int:
        try:
            return self._labels.index(label)
        except ValueError:
            raise TypeError(f"shape {self} has no dimension {label!r}; valid dimensions: "
                            f"{list(self._labels)}") from None

    def slice(self, **kwargs: Union[int, slice]) -> Shape:
        """Select along named dims: an int selects and drops the dim, a ``slice`` keeps it.

        >>> Shape.row_major(["h", "g"], [2, 4]).slice(h=-1, g=slice(0, 4, 2)).ranks()
        [4, 6]
        """
        labels, sizes, strides = list(self._labels), list(self._sizes), list(self._strides)
        offset = self._offset
        for label, sel in kwargs.items():
            if label not in labels:
                self._dim(label)  # raises TypeError listing valid labels
            i = labels.index(label)
            size = sizes[i]
            if isinstance(sel, slice):
                start, stop, step = sel.indices(size)
                if step <= 0:
                    raise ValueError(f"slice step for {label!r} must be positive, got {step}")
                n = len(range(start, stop, step))
                if n == 0:
                    raise ValueError(f"slice {label}={sel} selects an empty range of dimension {label!r} "
                                     f"(size {size}); meshes cannot be empty")
                offset += start * strides[i]
                sizes[i], strides[i] = n, strides[i] * step
            elif isinstance(sel, bool) or not hasattr(sel, "__index__"):
                raise TypeError(f"slice({label}=...) takes an int or a slice, got {type(sel).__name__} {sel!r}")
            else:
                idx = operator.index(sel)
                if not -size <= idx < size:
                    raise IndexError(f"index out of range: {label}={idx} but dimension {label!r} has size {size}")
                offset += (idx % size) * strides[i]
                del labels[i], sizes[i], strides[i]
        return Shape._make(tuple(labels), offset, tuple(sizes), tuple(strides))

    def rename(self, **kwargs: str) -> Shape:
        """Rename dims, ``old=new``: ``Shape.row_major(["h"], [2]).rename(h="host").labels == ("host",)``."""
        for old, new in kwargs.items():
            self._dim(old)
            if not isinstance(new, str):
                raise TypeError(f"rename({old}=...) needs a str new name, got {type(new).__name__} {new!r}")
        labels = tuple(kwargs.get(label, label) for label in self._labels)
        if len(set(labels)) != len(labels):
            raise ValueError(f"rename({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) gives duplicate "
                             f"labels {list(labels)}; choose names not already used")
        return Shape._make(labels, self._offset, self._sizes, self._strides)

    def split(self, **kwargs: Any) -> Shape:
        """Split dims into several row-major dims; new sizes are keyword args, one unknown per split inferred.

        >>> str(Shape.row_major(["host"], [32]).split(host=("dp", "pp"), pp=16))
        '{dp=2,pp=16}'
        """
        splits: dict[str, tuple[str, ...]] = {}
        constraints: dict[str, int] = {}
        for key, value in kwargs.items():
            if key in self._labels:
                if isinstance(value, str) or not isinstance(value, (Sequence, Iterator)):
                    raise ValueError(f"split({key}=...) expects a sequence of new dimension names, got {value!r}; "
                                     f"e.g. {key}=('a', 'b')")
                names = tuple(value)
                if not all(isinstance(n, str) for n in names):
                    raise ValueError(f"split({key}=...) dimension names must be str, got {names!r}")
                splits[key] = names
            else:
                if isinstance(value, bool) or not hasattr(value, "__index__") or operator.index(value) < 1:
                    raise ValueError(f"{key!r} is not a dimension of {self} (valid: {list(self._labels)}), so it "
                                     f"must be a positive int size for a new dimension; got {value!r}")
                constraints[key] = operator.index(value)
        new_labels = [n for label in self._labels for n in splits.get(label, (label,))]
        dups = sorted({n for n in new_labels if new_labels.count(n) > 1})
        if dups:
            raise ValueError(f"split would create duplicate dimension names {dups} (result: {new_labels})")
        sizes: list[int] = []
        strides: list[int] = []
        for label, size, stride in zip(self._labels, self._sizes, self._strides):
            names = splits.get(label, (label,))
            known, unknown = 1, None
            for n in names:
                if n in constraints:
                    known *= constraints[n]
                elif unknown is None:
                    unknown = n
                else:
                    raise ValueError(f"cannot infer the sizes of both {unknown!r} and {n!r} when splitting "
                                     f"{label!r} (size {size}); pass one of them, e.g. {n}=2")
            if unknown is not None:
                if size % known:
                    raise ValueError(f"dimension {label!r} of size {size} is not evenly divided by {names} "
                                     f"with known sizes multiplying to {known}")
                constraints[unknown] = size // known
            elif known != size:
                raise ValueError(f"dimension {label!r} has size {size} but the sizes given for {names} "
                                 f"multiply to {known}")
            new_sizes = [constraints.pop(n) for n in names]
            acc, new_strides = stride, []
            for new_size in reversed(new_sizes):
                new_strides.append(acc)
                acc *= new_size
            sizes.extend(new_sizes)
            strides.extend(reversed(new_strides))
        if constraints:
            raise ValueError(f"unused size constraints {tuple(constraints)}: they name no dimension created "
                             f"by this split (dimensions: {new_labels})")
        return Shape._make(tuple(new_labels), self._offset, tuple(sizes), tuple(strides))

    def _is_dense(self) -> bool:
        # Size-1 dims never step, so their stride is irrelevant to density.
        return all(st == dense or sz == 1
                   for st, sz, dense in zip(self._strides, self._sizes, row_major_strides(self._sizes)))

    def flatten(self, name: str) -> Shape:
        """Merge all dims into one named ``name``; only for dense (contiguous) views."""
        if not isinstance(name, str):
            raise TypeError(f"flatten() needs a str dimension name, got {type(name).__name__} {name!r}")
        if not self._is_dense():
            raise ValueError(f"cannot flatten sparse mesh {self!r}: its ranks are not contiguous "
                             f"(strides {list(self._strides)} != {list(row_major_strides(self._sizes))}); "
                             "use split/rename instead")
        return Shape._make((name,), self._offset, (self._nelements,), (1,))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Shape):
            return NotImplemented
        return (self._labels == other._labels and self._offset == other._offset
                and self._sizes == other._sizes and self._strides == other._strides)

    def __hash__(self) -> int:
        return hash((self._labels, self._offset, self._sizes, self._strides))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Shape, (self._labels, self._offset, self._sizes, self._strides))

    def __str__(self) -> str:
        return "{" + ",".join(f"{l}={s}" for l, s in zip(self._labels, self._sizes)) + "}"

    def __repr__(self) -> str:
        return (f"Shape(labels={list(self._labels)!r}, offset={self._offset}, "
                f"sizes={list(self._sizes)!r}, strides={list(self._strides)!r})")


_M = TypeVar("_M", bound="MeshTrait")


class MeshTrait:
    """Mixin giving mesh-like classes Monarch's shape operations.

    Subclasses provide ``_shape`` (a :class:`Shape`; attribute or property) and
    ``_new_with_shape(shape)``, returning a mesh of the same kind over ``shape``,
    which is always a sub-view of ``self._shape``.  ``__len__`` is left to subclasses.
    """

    __slots__ = ()
    _shape: Shape

    def _new_with_shape(self: _M, shape: Shape) -> _M:
        raise NotImplementedError(f"{type(self).__name__} must implement _new_with_shape(shape) to support slicing")

    @property
    def _labels(self) -> tuple[str, ...]:
        """The dimension names, in order. Monarch's spelling, kept because its docs
        examples use it (``dict.fromkeys(procs._labels, 0)`` is the first point)."""
        return tuple(self._shape.labels)

    def slice(self: _M, **kwargs: Union[int, slice]) -> _M:
        """Select along named dims; an int drops the dim, a slice keeps it: ``mesh.slice(hosts=0, gpus=slice(2, 4))``."""
        return self._new_with_shape(self._shape.slice(**kwargs))

    def split(self: _M, **kwargs: Any) -> _M:
        """Split dims into row-major sub-dims, one size inferred: ``mesh.split(hosts=("dp", "pp"), pp=2)``."""
        return self._new_with_shape(self._shape.split(**kwargs))

    def flatten(self: _M, name: str) -> _M:
        """Merge all dims into one (dense meshes only): ``mesh.flatten("rank").sizes == {"rank": 8}``."""
        return self._new_with_shape(self._shape.flatten(name))

    def rename(self: _M, **kwargs: str) -> _M:
        """Rename dims, ``old=new``: ``mesh.rename(hosts="dp", gpus="tp").sizes == {"dp": 2, "tp": 4}``."""
        return self._new_with_shape(self._shape.rename(**kwargs))

    def size(self, dim: Union[str, Sequence[str], None] = None) -> int:
        """Total ranks, one dim's size, or a product of dims: ``mesh.size("gpus")``, ``mesh.size(["a", "b"])``.

        Raises KeyError for an unknown label.
        """
        if dim is None:
            return self._shape.nelements
        if isinstance(dim, str):
            return self._shape.extent[dim]
        n = 1
        for d in dim:
            n *= self.size(d)
        return n

    @property
    def sizes(self) -> dict[str, int]:
        """``{label: size}`` in dimension order, e.g. ``{'hosts': 2, 'gpus': 4}``."""
        return dict(zip(self._shape.labels, self._shape.sizes))

    @property
    def extent(self) -> Extent:
        """The mesh's labels and sizes as an :class:`Extent`, e.g. ``{hosts: 2, gpus: 4}``."""
        return self._shape.extent
