"""``NDSlice`` and ``Selection``: Monarch's rank-set vocabulary, in Python.

``NDSlice(offset=, sizes=, strides=)`` names the ranks ``offset + sum(c_i *
strides[i])`` for every coordinate ``c`` below ``sizes`` (row-major order).
``Selection.from_string("*, 0:4")`` parses Monarch's selection syntax and
``sel.eval(ndslice)`` lists the ranks it picks:

    expression ::= union;  union ::= inter ("|" inter)*;  inter ::= chain ("&" chain)*
    chain ::= group ("," group)*   (each "," descends one dimension)
    group ::= "(" expression ")" | range | index | "*" | "?"
    range ::= [start] ":" [end] [":" step];  index ::= number

``*`` takes every index of the current dimension, ``?`` one at random, and a
selection shorter than the slice takes everything in the remaining dimensions.
Neither module imports torch.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from typing import Any, Union, overload

__all__ = ["NDSlice", "Selection"]


class NDSlice:
    """Ranks ``offset + sum(c[i] * strides[i])`` for coordinates ``c`` within ``sizes``."""

    __slots__ = ("_offset", "_sizes", "_strides")

    def __init__(self, *, offset: int, sizes: Sequence[int], strides: Sequence[int]) -> None:
        if len(sizes) != len(strides):
            raise ValueError(f"NDSlice: {len(sizes)} sizes but {len(strides)} strides")
        if offset < 0 or any(s < 0 for s in sizes) or any(s < 0 for s in strides):
            raise ValueError(f"NDSlice: offset, sizes and strides must be >= 0 (got {offset}, {list(sizes)}, {list(strides)})")
        self._offset, self._sizes, self._strides = int(offset), [int(s) for s in sizes], [int(s) for s in strides]

    @staticmethod
    def new_row_major(ranks: Sequence[int]) -> NDSlice:
        """The dense row-major slice with these sizes (Monarch's name for it)."""
        sizes = list(ranks)
        strides, acc = [0] * len(sizes), 1
        for i in range(len(sizes) - 1, -1, -1):
            strides[i], acc = acc, acc * sizes[i]
        return NDSlice(offset=0, sizes=sizes, strides=strides)

    @staticmethod
    def from_list(ranks: Sequence[int]) -> list[NDSlice]:
        """1-d slices covering ``ranks`` (sorted, duplicates dropped): one per run of equal steps."""
        rs = sorted(set(int(r) for r in ranks))
        out: list[NDSlice] = []
        i = 0
        while i < len(rs):
            if i + 1 == len(rs):
                out.append(NDSlice(offset=rs[i], sizes=[1], strides=[1]))
                break
            step, j = rs[i + 1] - rs[i], i + 1
            while j + 1 < len(rs) and rs[j + 1] - rs[j] == step:
                j += 1
            out.append(NDSlice(offset=rs[i], sizes=[j - i + 1], strides=[step]))
            i = j + 1
        return out

    offset = property(lambda self: self._offset, doc="The first rank.")
    sizes = property(lambda self: list(self._sizes), doc="Size of each dimension.")
    strides = property(lambda self: list(self._strides), doc="Stride of each dimension.")
    ndim = property(lambda self: len(self._sizes), doc="Number of dimensions.")

    def __len__(self) -> int:
        n = 1
        for s in self._sizes:
            n *= s
        return n

    def nditem(self, coordinates: Sequence[int]) -> int:
        """The rank at ``coordinates`` (IndexError if out of bounds)."""
        if len(coordinates) != len(self._sizes) or any(not 0 <= c < s for c, s in zip(coordinates, self._sizes)):
            raise IndexError(f"coordinates {list(coordinates)} out of bounds for sizes {self._sizes}")
        return self._offset + sum(c * st for c, st in zip(coordinates, self._strides))

    def get(self, index: int) -> int:
        """The rank at row-major position ``index`` (inverse of :meth:`index`)."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a slice of {len(self)} ranks")
        coords = []
        for s in reversed(self._sizes):
            coords.append(index % s)
            index //= s
        return self.nditem(coords[::-1])

    def coordinates(self, value: int) -> list[int]:
        """The coordinates of rank ``value`` (ValueError if not in the slice)."""
        rest, coords = value - self._offset, [0] * len(self._sizes)
        order = sorted(range(len(self._sizes)), key=lambda i: -self._strides[i])
        for i in order:
            if self._strides[i] and self._sizes[i] > 1:
                coords[i] = min(rest // self._strides[i], self._sizes[i] - 1) if rest >= 0 else -1
                rest -= coords[i] * self._strides[i]
        if rest != 0 or any(not 0 <= c < s for c, s in zip(coords, self._sizes)):
            raise ValueError(f"rank {value} is not in {self!r}")
        return coords

    def index(self, value: int) -> int:
        """The row-major position of rank ``value`` (ValueError if not in the slice)."""
        pos = 0
        for c, s in zip(self.coordinates(value), self._sizes):
            pos = pos * s + c
        return pos

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...

    def __getitem__(self, i: Union[int, slice]) -> Any:
        if isinstance(i, slice):
            return tuple(self.get(j) for j in range(*i.indices(len(self))))
        return self.get(i + len(self) if i < 0 else i)

    def __iter__(self) -> Iterator[int]:
        return (self.get(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NDSlice) and (self._offset, self._sizes, self._strides) == (other._offset, other._sizes, other._strides)

    def __hash__(self) -> int:
        return hash((self._offset, tuple(self._sizes), tuple(self._strides)))

    def __reduce__(self) -> Any:
        return (_ndslice, (self._offset, self._sizes, self._strides))

    def __repr__(self) -> str:
        return f"NDSlice(offset={self._offset}, sizes={self._sizes}, strides={self._strides})"


def _ndslice(offset: int, sizes: list[int], strides: list[int]) -> NDSlice:
    return NDSlice(offset=offset, sizes=sizes, strides=strides)


_Node = tuple  # ("true",) ("false",) ("all", s) ("any", s) ("range", (start, end, step), s) ("union"|"inter", a, b)
_TRUE: _Node = ("true",)
_ANY_EVERY: _Node = ("any", _TRUE)  # Selection.any(): expanded to one `?` per dimension at eval


class Selection:
    """A set of ranks described per dimension (Monarch's selection algebra)."""

    __slots__ = ("_node",)

    def __init__(self, node: _Node) -> None:
        self._node = node

    @classmethod
    def from_string(cls, s: str) -> Selection:
        """Parse ``"(*, 0:4)"``, ``"0 & (1 | 2)"``, ... (ValueError for bad syntax)."""
        return cls(_Parser(s).parse())

    @classmethod
    def all(cls) -> Selection:
        """Every rank (``*`` in every dimension)."""
        return cls(("all", _TRUE))

    @classmethod
    def any(cls) -> Selection:
        """One rank at random (``?`` in every dimension of the slice it is evaluated on)."""
        return cls(_ANY_EVERY)

    def eval(self, ndslice: NDSlice) -> list[int]:
        """The ranks of ``ndslice`` this selection picks, ascending (ValueError if it has
        more dimensions than the slice)."""
        sizes = ndslice.sizes or [1]
        if not ndslice.sizes:
            ndslice = NDSlice(offset=ndslice.offset, sizes=[1], strides=[1])
        node = self._node
        if node is _ANY_EVERY:
            for _ in sizes:
                node = ("any", node if node is not _ANY_EVERY else _TRUE)
        _validate(node, len(sizes), 0, self)
        return _eval(node, ndslice, [0] * len(sizes), 0)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Selection) and self._node == other._node

    def __hash__(self) -> int:
        return hash(self._node)

    def __reduce__(self) -> Any:
        return (Selection, (self._node,))

    def __repr__(self) -> str:
        return _debug(self._node)


def _debug(n: _Node) -> str:
    kind = n[0]
    if kind == "true":
        return "True"
    if kind == "false":
        return "False"
    if kind in ("all", "any"):
        return f"{kind.capitalize()}({_debug(n[1])})"
    if kind == "range":
        start, end, step = n[1]
        return f"Range(Range({start}, {'None' if end is None else f'Some({end})'}, {step}), {_debug(n[2])})"
    return f"{'Union' if kind == 'union' else 'Intersection'}({_debug(n[1])}, {_debug(n[2])})"


def _validate(n: _Node, ndim: int, dim: int, top: Selection) -> None:
    kind = n[0]
    if dim == ndim:
        if kind not in ("true", "false"):
            raise ValueError(f"selection {top!r} is deeper than the slice's {ndim} dimension(s)")
        return
    if kind in ("union", "inter"):
        _validate(n[1], ndim, dim, top)
        _validate(n[2], ndim, dim, top)
    elif kind != "true" and kind != "false":
        _validate(n[-1], ndim, dim + 1, top)


def _eval(n: _Node, s: NDSlice, env: list[int], dim: int) -> list[int]:
    kind = n[0]
    if kind == "false":
        return []
    if dim == s.ndim:
        return [s.nditem(env)]
    size = s.sizes[dim]
    if kind == "true" or kind == "all":
        indices: Any = range(size)
    elif kind == "any":
        indices = [random.randrange(size)] if size else []
    elif kind == "range":
        start, end, step = n[1]
        indices = range(min(start, size), size if end is None else min(end, size), step)
    else:
        a, b = set(_eval(n[1], s, env, dim)), set(_eval(n[2], s, env, dim))
        return sorted(a | b if kind == "union" else a & b)
    inner = _TRUE if kind == "true" else n[-1]
    out: list[int] = []
    for i in indices:
        out.extend(_eval(inner, s, env[:dim] + [i] + env[dim + 1:], dim + 1))
    return out


def _nest(dim: _Node, tail: _Node) -> _Node:
    kind = dim[0]
    if kind == "true":
        return tail
    if kind == "false":
        return dim
    if kind in ("union", "inter"):
        return (kind, _nest(dim[1], tail), _nest(dim[2], tail))
    return (*dim[:-1], _nest(dim[-1], tail))


class _Parser:
    def __init__(self, text: str) -> None:
        self.src = text
        self.s = re.sub(r"\s+", "", text)
        self.i = 0

    def fail(self, what: str) -> ValueError:
        return ValueError(f"parse error: {what} at position {self.i} of selection {self.src!r}")

    def parse(self) -> _Node:
        node = self.expression()
        if self.i != len(self.s):
            raise self.fail(f"unexpected {self.s[self.i]!r}")
        return node

    def expression(self) -> _Node:
        node = self.intersection()
        while self.peek("|"):
            self.i += 1
            node = ("union", node, self.intersection())
        return node

    def intersection(self) -> _Node:
        node = self.chain()
        while self.peek("&"):
            self.i += 1
            node = ("inter", node, self.chain())
        return node

    def chain(self) -> _Node:
        dims = [self.group()]
        while self.peek(","):
            self.i += 1
            dims.append(self.group())
        node = _TRUE
        for d in reversed(dims):
            node = _nest(d, node)
        return node

    def group(self) -> _Node:
        if self.peek("("):
            self.i += 1
            node = self.expression()
            if not self.peek(")"):
                raise self.fail("missing ')'")
            self.i += 1
            return node
        if self.peek("*"):
            self.i += 1
            return ("all", _TRUE)
        if self.peek("?"):
            self.i += 1
            return ("any", _TRUE)
        start = self.number()
        if self.peek(":"):
            self.i += 1
            end = self.number()
            step = 1
            if self.peek(":"):
                self.i += 1
                given = self.number()
                if given is None:
                    raise self.fail("missing step")
                step = given
                if step == 0:
                    raise self.fail("step must be positive")
            return ("range", (start or 0, end, step), _TRUE)
        if start is None:
            raise self.fail("expected an index, a range, '*', '?' or '('")
        return ("range", (start, start + 1, 1), _TRUE)

    def number(self) -> int | None:
        m = re.match(r"[0-9]+", self.s[self.i:])
        if m is None:
            return None
        self.i += m.end()
        return int(m.group())

    def peek(self, c: str) -> bool:
        return self.s.startswith(c, self.i)
