"""Streams and borrows (Monarch's semantics), the controller's side.

Every distributed tensor belongs to the stream that was active when it was
made (``t.stream``; the main stream unless ``with other.activate():``). An op
may only use tensors of the active stream (``WRONG_STREAM``). To use a tensor
on another stream, borrow it: ``t2, b = other.borrow(t)`` makes ``t2`` on
``other`` aliasing ``t``'s storage, until ``b.drop()``:

- immutable borrow: both streams may read the storage, neither may write it
  (``MUTATING_BORROW``);
- mutable borrow (``mutable=True``): ``other`` may read and write it, ``t``'s
  stream may do neither until the drop (``BORROWED``).

``b.drop()`` drops ``t2`` and every view of it (later use: ``DROPPED``, naming
where it was dropped) and gives the storage back to its origin stream.

Permissions belong to a *storage*, not a handle: a view op's output records
the storage root of its input (``alias``), so views of a borrowed tensor obey
the same rules. All of this is checked here, on the controller, before the op
is recorded; the workers only see three commands (``_stream_worker.py``).
Code that records commands without ``dispatch`` (collectives, remote
functions) keeps the rules by calling :func:`check` and :func:`announce` while
``live`` is true.

On the workers, streams are real ``torch.cuda.Stream``s when CUDA is present
(a borrow makes the borrowing stream wait for the origin one; the drop makes
the origin wait for the borrower). On CPU the engine runs every command in the
order the controller issued it, whatever its stream: streams serialise there
and only the controller-side rules apply.

The active stream is process-global, as in Monarch (not per thread).
"""

from __future__ import annotations

import itertools
import traceback
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Stream", "Borrow", "get_active_stream", "stream_of", "check", "alias", "SET_STREAM", "BORROW", "BORROW_DROP"]

SET_STREAM, BORROW, BORROW_DROP = 20, 21, 22

_ids = itertools.count(1)
_FRAMES = 8  # frames kept of where a borrow was made or dropped
_KEEP_DROPPED = 4096  # dropped borrows remembered for "dropped at" messages

#: The stream new tensors join, or None for the main stream (read on every tensor made).
tag: Stream | None = None
#: True once a non-main stream was activated or a borrow made: ops are then checked.
live = False
# Storages are named (engine client key, root ref): ref numbers are per mesh.
_Storage = tuple[str, int]
_access: dict[_Storage, str] = {}  # "r" / "" / "rw", only for storages in a borrow
_dropped_at: dict[_Storage, str] = {}  # a dropped borrow's storage -> where it was dropped
_borrows_of: dict[_Storage, weakref.WeakSet[Borrow]] = {}  # origin storage -> its live borrows
_access_before: dict[_Storage, str] = {}  # origin storage -> its access before its first live borrow
_aliases_of: dict[_Storage, weakref.WeakSet[Any]] = {}  # a borrowed storage -> its handles
_announced: dict[str, int] = {}  # engine client key -> id of the stream its workers run ops on


class Stream:
    """A named command stream of every proc (Monarch's ``monarch.Stream``).

    >>> other = Stream("other")                    # doctest: +SKIP
    >>> t2, b = other.borrow(t)                    # doctest: +SKIP
    >>> with other.activate():                     # doctest: +SKIP
    ...     u = t2 * 2
    >>> b.drop()                                   # doctest: +SKIP
    """

    def __init__(self, name: str, _default: bool = False) -> None:
        self.name = name
        self.default = _default
        self.id = 0 if _default else next(_ids)

    def __repr__(self) -> str:
        return f"<Stream({self.name!r}) at {hex(id(self))}>"

    def __str__(self) -> str:
        return f"stream {self.name!r}"

    def activate(self) -> Any:
        """``with stream.activate():`` ops made inside run on (and make tensors of) this stream."""
        return _activated(self)

    def borrow(self, t: Any, mutable: bool = False) -> tuple[Any, Borrow]:
        """``(t2, borrow)``: ``t2`` is ``t``'s storage on this stream until ``borrow.drop()``.

        Not mutable: both streams may read it, neither write it. Mutable: this
        stream may read and write it, ``t``'s stream neither, until the drop.
        Raises TypeError for a dropped or mutably borrowed ``t``, RuntimeError
        for a mutable borrow of a tensor already borrowed.
        """
        from ._tensor import Tensor

        if type(t) is not Tensor:
            raise TypeError(f"{self}.borrow: expected a distributed tensor (made inside `with mesh.activate():`), got {type(t).__name__}")
        root = storage_of(t)
        if t.dropped or root in _dropped_at:
            raise TypeError(f"{self}.borrow: DROPPED: this tensor (or the borrow it came from) was dropped and can no longer be used")
        prev = _access.get(root, "rw")
        if "r" not in prev:
            raise TypeError(f"{self}.borrow: BORROWED: this tensor is borrowed mutably by another stream; drop that borrow first")
        if mutable and "w" not in prev:
            raise RuntimeError("Cannot borrow this tensor mutably because it (or a view) is already being borrowed non-mutably.")
        origin = stream_of(t)
        r = Tensor._make(t._meta, t._view)
        if self.default:
            r.__dict__.pop("_stream", None)
        else:
            r._stream = self
        _go_live()
        b = Borrow(r, t, root, origin, self, mutable)
        _access[root] = "" if mutable else "r"
        _access[storage_of(r)] = "rw" if mutable else "r"
        if root not in _borrows_of:
            _borrows_of[root] = weakref.WeakSet()
            _access_before[root] = prev
        _borrows_of[root].add(b)
        _aliases_of[storage_of(r)] = weakref.WeakSet([r])
        t._view.client.record((BORROW, r._ref.id, t._ref.id, origin.id, self.id, t._view.sid))
        return r, b


class Borrow:
    """A tensor lent to another stream; ``drop()`` (or leaving ``with borrow:``) ends it."""

    def __init__(self, r: Any, t: Any, root: _Storage, origin: Stream, to: Stream, mutable: bool) -> None:
        self._tensor = r  # kept until the drop: the worker may need its failure then
        self._origin_ref, self._origin_root = t._ref.id, root
        self._view = t._view
        self._from, self._to, self.mutable = origin, to, mutable
        self._dropped = False
        self._frames = traceback.extract_stack(limit=_FRAMES + 2)[:-2]

    @property
    def traceback_string(self) -> str:
        """Where the borrow was made."""
        return "".join(traceback.format_list(self._frames))

    def __enter__(self) -> Borrow:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.drop()

    def drop(self) -> None:
        """End the borrow: the borrowed tensor and its views are dropped, the origin
        stream gets the storage back (and, after a mutable borrow, its failures)."""
        if self._dropped:
            return
        self._dropped = True
        r, self._tensor = self._tensor, None
        rid = storage_of(r)
        self._view.client.record((BORROW_DROP, r._ref.id, self._origin_ref, self._from.id, self._to.id, self.mutable, self._view.sid))
        _dropped_at[rid] = "".join(traceback.format_stack(limit=_FRAMES + 1)[:-1])
        if len(_dropped_at) > _KEEP_DROPPED:  # only for messages: the handles themselves are dropped
            del _dropped_at[next(iter(_dropped_at))]
        for alias_ in list(_aliases_of.pop(rid, ())):
            alias_.drop()
        _access.pop(rid, None)
        live_ = _borrows_of.get(self._origin_root)
        if live_ is not None:
            live_.discard(self)
            if not live_:
                del _borrows_of[self._origin_root]
                before = _access_before.pop(self._origin_root, "rw")
                if before == "rw":
                    _access.pop(self._origin_root, None)
                else:  # the origin is itself a borrowed tensor
                    _access[self._origin_root] = before

    def __del__(self) -> None:
        if not getattr(self, "_dropped", True):
            warnings.warn("borrow.drop() must be called before a borrow is freed, to say when the borrowed tensor returns "
                          "to its origin stream; dropping it now. Borrow made at:\n" + self.traceback_string, stacklevel=2)
            try:
                self.drop()
            except Exception:  # interpreter shutdown: the engine is gone anyway
                pass


_main = Stream("main", _default=True)


def get_active_stream() -> Stream:
    """The stream ops go to now (the main stream unless inside ``other.activate()``)."""
    return tag if tag is not None else _main


def stream_of(t: Any) -> Stream:
    """The stream a distributed tensor belongs to."""
    return t.__dict__.get("_stream", _main)


def storage_of(t: Any) -> _Storage:
    """The name of ``t``'s storage: its mesh and its own ref, or that of the tensor it is a view of."""
    return (t._view.client.key, t.__dict__.get("_root") or t._ref.id)


def _go_live() -> None:
    global live
    live = True


@contextmanager
def _activated(stream: Stream) -> Iterator[None]:
    global tag
    prev = tag
    tag = None if stream.default else stream
    if not stream.default:
        _go_live()
    try:
        yield
    finally:
        tag = prev


# -- checks made by dispatch while `live` -------------------------------------------------------
def alias(src: Any, out: Any) -> None:
    """``out`` is a view of ``src``: same storage, same permissions."""
    ref = getattr(src, "_ref", None)
    if ref is None:  # not a distributed tensor (dispatch has raised for it already)
        return
    root = src.__dict__.get("_root") or ref.id
    out._root = root
    if live and _aliases_of:
        handles = _aliases_of.get((src._view.client.key, root))
        if handles is not None:
            handles.add(out)


_writes: dict[Any, tuple[tuple[int, str], ...]] = {}


def _written(func: Any, args: Any, kwargs: Any) -> list[Any]:
    pos = _writes.get(func)
    if pos is None:
        pos = _writes[func] = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                                    if a.alias_info is not None and a.alias_info.is_write)
    out = []
    for i, name in pos:
        x = args[i] if i < len(args) else kwargs.get(name)
        if x is not None and hasattr(x, "_ref"):
            out.append(x)
    return out


def check(func: Any, ins: list[Any], args: Any, kwargs: Any) -> None:
    """Raise TypeError if an op breaks the stream rules (WRONG_STREAM, BORROWED,
    MUTATING_BORROW, DROPPED by a borrow's drop)."""
    active = get_active_stream()
    problems: list[str] = []
    for i, t in enumerate(ins):
        d = t.__dict__
        s = d.get("_stream", _main)
        if s is not active:
            problems.append(f"  input {i}: WRONG_STREAM: this tensor is on {s}, not the active {active}. Use "
                            f"`with stream.activate():` to switch streams, or move it with `{active.name}_stream.borrow(t)`")
        root = (d["_view"].client.key, d.get("_root") or t._ref.id)
        acc = _access.get(root)
        if acc is not None and "r" not in acc:
            problems.append(f"  input {i}: BORROWED: this tensor cannot be read because it is borrowed mutably by another "
                            f"stream; call borrow.drop() first{_borrow_traces(root)}")
        where = _dropped_at.get(root)
        if where is not None:
            problems.append(f"  input {i}: DROPPED: tensor {t._ref.id} belongs to a borrow that was dropped; "
                            f"tensor {t._ref.id} is dropped at:\n{where}")
    for t in _written(func, args, kwargs):
        acc = _access.get(storage_of(t))
        if acc is not None and "w" not in acc:
            problems.append(f"  MUTATING_BORROW: this tensor would be mutated by {func} but it is read only because it is "
                            f"being borrowed{_borrow_traces(storage_of(t))}")
    if problems:
        raise TypeError(f"Incorrect arguments to actormesh operation {func} (active stream: {active}):\n" + "\n".join(problems))


def announce(client: Any) -> None:
    """Make the workers of ``client`` run the next commands on the active stream."""
    sid = get_active_stream().id
    if _announced.get(client.key, 0) != sid:
        _announced[client.key] = sid
        client.record((SET_STREAM, sid))


def _borrow_traces(root: _Storage) -> str:
    lines = [f"\n  borrowed at (most recent call last):\n{b.traceback_string}" for b in _borrows_of.get(root, ())]
    return "".join(lines)
