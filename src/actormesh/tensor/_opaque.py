"""``OpaqueRef``: a handle to a Python object that lives on each worker.

A remote function (or an actor) on the workers makes ``OpaqueRef(obj)`` and
returns it; the controller gets an OpaqueRef whose key is a distributed 0-dim
tensor, and passes it to later remote functions or actor calls, where it
arrives as an OpaqueRef with that proc's key and ``ref.value`` is that proc's
object. The object lives as long as the key's shard: when the controller drops
the handle, the engine deletes the key and the object goes with it.

How: the key is a tensor (a pytree leaf, so every path that carries
distributed tensors carries OpaqueRefs too), and each process keeps
``{key tensor: object}`` in a weak-keyed table. The controller never sees the
objects: reading, setting or creating one there raises RuntimeError (creating
one is allowed while propagating shapes, where the key is a fake tensor).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import register_pytree_node
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["OpaqueRef", "opaque_table_size"]

_keys: Iterator[int] = itertools.count(1)
_objects: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _on_worker() -> bool:
    from ._engine import _engines  # a proc of a mesh hosts an engine; the controller does not

    return bool(_engines)


class OpaqueRef:
    """A reference to an object that only the workers can resolve.

    >>> @remote(propagate=lambda: OpaqueRef(None))      # doctest: +SKIP
    ... def make_model():
    ...     return OpaqueRef(torch.nn.Linear(3, 4))
    >>> model = make_model()                            # doctest: +SKIP
    >>> step(model)            # a remote function reading model.value
    """

    def __init__(self, value: Any = None) -> None:
        self._key = torch.tensor(next(_keys), dtype=torch.int64)
        self._check("create")
        _objects[self._key] = value

    @classmethod
    def _create(cls, key: torch.Tensor) -> OpaqueRef:
        r = cls.__new__(cls)
        r._key = key
        return r

    def __reduce_ex__(self, protocol: Any) -> Any:
        return OpaqueRef._create, (self._key,)

    def __repr__(self) -> str:
        return f"OpaqueRef({self._key!r})"

    @property
    def value(self) -> Any:
        """This proc's object (workers only)."""
        self._check("access")
        return _objects[self._key]

    @value.setter
    def value(self, v: Any) -> None:
        self._check("set")
        _objects[self._key] = v

    def _check(self, what: str) -> None:
        from torch._subclasses.fake_tensor import FakeTensor

        if not (isinstance(self._key, FakeTensor) or (type(self._key) is torch.Tensor and _on_worker())):
            raise RuntimeError(f"The controller is attempting to {what} an OpaqueRef. This can only be done on a worker: "
                               "inside a remote function, or an actor endpoint that received the OpaqueRef")


def opaque_table_size() -> int:
    """How many OpaqueRef objects this process holds (for tests and leak checks)."""
    return len(_objects)


register_pytree_node(OpaqueRef, lambda r: ([r._key], None), lambda xs, _: OpaqueRef._create(xs[0]))
