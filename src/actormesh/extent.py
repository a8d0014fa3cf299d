"""Named sizes and coordinates: ``Extent`` (dims and sizes) and ``Point`` (a rank in an extent).

A leaf, like ``errors`` and ``config``: plain values any layer may build. The
runtime makes the ``Point`` of ``context().message_rank`` from the rank a message
carries; the mesh layer builds its ``Shape`` on the same checks and re-exports
both types (users import them from ``actormesh.actor``). Semantics mirror
PyTorch Monarch 0.7.0 (``monarch._src.actor.shape``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["Extent", "Point", "as_int", "check_labels", "check_ints", "row_major_strides"]


def as_int(value: object, what: str) -> int:
    """``operator.index`` with an error naming the argument. Bools are rejected:
    ``gpus=True`` is almost certainly a bug, not a request for index 1."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, not bool ({value!r})")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def check_labels(labels: Sequence[str]) -> tuple[str, ...]:
    """``labels`` as a tuple of distinct str; TypeError or ValueError naming the bad one."""
    # A bare str is a Sequence of characters; accepting it would silently make
    # one dimension per letter.
    if isinstance(labels, str):
        raise TypeError(f"labels must be a sequence of str, not the str {labels!r}; use [{labels!r}]")
    out = tuple(labels)
    for label in out:
        if not isinstance(label, str):
            raise TypeError(f"labels must be str, got {type(label).__name__} {label!r}")
    if len(set(out)) != len(out):
        dups = sorted({x for x in out if out.count(x) > 1})
        raise ValueError(f"duplicate labels {dups} in {list(out)}: each dimension needs a unique name")
    return out


def check_ints(values: Iterable[int], labels: tuple[str, ...], what: str) -> tuple[int, ...]:
    """One int >= 0 per label (``what`` names them in errors: ``"sizes"``, ``"strides"``)."""
    if isinstance(values, str) or not isinstance(values, Iterable):
        raise TypeError(f"{what} must be a sequence of int, got {type(values).__name__} {values!r}")
    values = tuple(values)
    if len(values) != len(labels):
        raise ValueError(f"got {len(labels)} labels {list(labels)} but {len(values)} {what} {list(values)}; "
                         "pass one per label")
    out = tuple(as_int(v, f"{what[:-1]} of {label!r}") for v, label in zip(values, labels))
    for v, label in zip(out, labels):
        if v < 0:
            raise ValueError(f"{what[:-1]} of {label!r} must be >= 0, got {v}")
    return out


def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """The strides of a dense row-major layout of ``sizes`` (the last dimension steps by 1)."""
    strides = [1] * len(sizes)
    acc = 1
    for i in range(len(sizes) - 1, -1, -1):
        strides[i] = acc
        acc *= sizes[i]
    return tuple(strides)


class Extent(Mapping[str, int]):
    """Immutable, ordered mapping from dimension label to size.

    >>> e = Extent(["hosts", "gpus"], [2, 4])
    >>> e["gpus"], e.nelements, str(e)
    (4, 8, '{hosts: 2, gpus: 4}')
    """

    __slots__ = ("_labels", "_sizes", "_index", "_strides", "_nelements")

    def __init__(self, labels: Sequence[str], sizes: Sequence[int]) -> None:
        self._labels = labels = check_labels(labels)
        self._sizes = sizes = check_ints(sizes, labels, "sizes")
        self._index = {label: i for i, label in enumerate(labels)}  # O(1) lookups
        self._strides = row_major_strides(sizes)  # lets Point decode coords in O(1)
        self._nelements = math.prod(sizes)

    @property
    def labels(self) -> tuple[str, ...]:
        """Dimension names, in order."""
        return self._labels

    @property
    def sizes(self) -> tuple[int, ...]:
        """Dimension sizes, in label order."""
        return self._sizes

    @property
    def nelements(self) -> int:
        """Number of points (product of sizes; 1 for no dimensions)."""
        return self._nelements

    def __getitem__(self, label: str) -> int:
        i = self._index.get(label)
        if i is None:
            raise KeyError(f"{label!r} is not a dimension of extent {self}; valid: {list(self._labels)}")
        return self._sizes[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._labels)

    def __len__(self) -> int:
        return len(self._labels)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Extent):  # ordered: {a: 1, b: 2} != {b: 2, a: 1}
            return self._labels == other._labels and self._sizes == other._sizes
        return Mapping.__eq__(self, other)

    def __hash__(self) -> int:
        return hash((self._labels, self._sizes))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Extent, (self._labels, self._sizes))

    def __str__(self) -> str:
        return "{" + ", ".join(f"{l}: {s}" for l, s in zip(self._labels, self._sizes)) + "}"

    def __repr__(self) -> str:
        return f"Extent({self})"


class Point(Mapping[str, int]):
    """Immutable mapping from label to coordinate: the point at row-major ``rank`` of ``extent``.

    >>> p = Point(5, Extent(["hosts", "gpus"], [2, 4]))
    >>> dict(p), p.rank, p.size("gpus"), str(p)
    ({'hosts': 1, 'gpus': 1}, 5, 4, "{'hosts': 1/2, 'gpus': 1/4}")
    """

    __slots__ = ("_rank", "_extent")

    def __init__(self, rank: int, extent: Extent) -> None:
        rank = as_int(rank, "rank")
        if not isinstance(extent, Extent):
            raise TypeError(f"extent must be an Extent, got {type(extent).__name__}")
        if not 0 <= rank < extent._nelements:
            raise IndexError(f"rank {rank} out of range for extent {extent} "
                             f"({extent._nelements} points, valid ranks 0..{extent._nelements - 1})")
        self._rank = rank
        self._extent = extent

    @classmethod
    def _trusted(cls, rank: int, extent: Extent) -> Point:
        # Skips validation; used when iterating a mesh's own points.
        self = cls.__new__(cls)
        self._rank = rank
        self._extent = extent
        return self

    @property
    def rank(self) -> int:
        """Row-major index of this point within its extent."""
        return self._rank

    @property
    def extent(self) -> Extent:
        """The extent this point lives in."""
        return self._extent

    def size(self, label: str) -> int:
        """Size of dimension ``label`` of this point's extent."""
        return self._extent[label]

    def __getitem__(self, label: str) -> int:
        e = self._extent
        i = e._index.get(label)
        if i is None:
            raise KeyError(f"{label!r} is not a dimension of point {self}; valid: {list(e._labels)}")
        return (self._rank // e._strides[i]) % e._sizes[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._extent._labels)

    def __len__(self) -> int:
        return len(self._extent._labels)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Point):
            return self._rank == other._rank and self._extent == other._extent
        return Mapping.__eq__(self, other)  # lets tests write `p == {"gpus": 1}`

    def __hash__(self) -> int:
        return hash((self._rank, self._extent))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Point, (self._rank, self._extent))

    def __str__(self) -> str:
        return "{" + ", ".join(f"{l!r}: {self[l]}/{s}" for l, s in self._extent.items()) + "}"

    __repr__ = __str__  # Monarch shows points this way inside ValueMesh reprs
