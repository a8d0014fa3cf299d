"""actormesh: single-controller distributed programming for PyTorch, in pure Python.

Start with :mod:`actormesh.actor` (the Monarch-compatible API). The names
Monarch exports from ``monarch`` itself (the tensor engine: ``fetch_shard``,
``inspect``, ``remote``, ``reduce``, ...) are here too; they load
``actormesh.tensor`` (and torch) on first use, so ``import actormesh.actor``
stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: name -> module that defines it (loaded on first access).
_LAZY = {
    "Tensor": "actormesh.tensor",
    "get_active_mesh": "actormesh.tensor",
    "no_mesh": "actormesh.tensor",
    "fetch_shard": "actormesh.tensor",
    "inspect": "actormesh.tensor",
    "show": "actormesh.tensor",
    "reduce": "actormesh.tensor",
    "reduce_": "actormesh.tensor",
    "slice_mesh": "actormesh.tensor",
    "to_mesh": "actormesh.tensor",
    "RemoteProcessGroup": "actormesh.tensor",
    "remote": "actormesh.tensor",
    "call_on_shard_and_fetch": "actormesh.tensor",
    "Stream": "actormesh.tensor",
    "get_active_stream": "actormesh.tensor",
    "grad_generator": "actormesh.tensor",
    "grad_function": "actormesh.tensor",
    "coalescing": "actormesh.tensor",
    "OpaqueRef": "actormesh.tensor",
    "Selection": "actormesh.tensor",
    "NDSlice": "actormesh.tensor",
    "Future": "actormesh.runtime",
    "Shape": "actormesh.mesh",
    "Extent": "actormesh.mesh",
    "RemoteException": "actormesh.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'actormesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
