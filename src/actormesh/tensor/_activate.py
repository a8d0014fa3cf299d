"""``mesh.activate()``: while active, every torch op made on the controller in
this thread is recorded for the mesh instead of run locally."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._client import View, client_for
from ._tensor import Tensor, dispatch

__all__ = ["activate", "get_active_mesh", "no_mesh", "active_view", "manual_seed"]

_tls = threading.local()


def active_view() -> View | None:
    """The view torch calls go to in this thread (None: run locally)."""
    return getattr(_tls, "view", None)


class _EngineMode(TorchDispatchMode):
    """One per thread while any mesh is active; reads the active view at each op."""


#: Ops on local tensors that stay local inside activate(), as in Monarch (t.item(), unpickling).
_LOCAL_OK = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.set_.source_Storage_storage_offset)


def _mode_dispatch(self: _EngineMode, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    view = getattr(_tls, "view", None)
    if view is None or (func in _LOCAL_OK and not isinstance(args[0], Tensor)):
        return func(*args, **(kwargs or {}))  # no_mesh, or a local accessor: this mode is off the stack meanwhile
    return dispatch(func, args, kwargs or {}, view)


# TorchDispatchMode wraps subclasses' __torch_dispatch__ to keep dynamo out (~8 us
# per op); this one never runs under torch.compile, so it takes the plain function.
_EngineMode.__torch_dispatch__ = _mode_dispatch  # type: ignore[method-assign]

_real_seed = torch.manual_seed


def manual_seed(seed: int) -> Any:
    """``torch.manual_seed`` while a mesh is active: seeds every proc of it (and this process)."""
    view = active_view()
    if view is not None:
        view.client.record((3, int(seed), view.sid))
    return _real_seed(seed)


@contextmanager
def _activated(view: View | None) -> Iterator[None]:
    prev = getattr(_tls, "view", None)
    outermost = not getattr(_tls, "depth", 0)
    _tls.view = view
    _tls.depth = getattr(_tls, "depth", 0) + 1
    patched = torch.manual_seed is not manual_seed
    if patched:
        torch.manual_seed = manual_seed  # type: ignore[assignment]
        torch.random.manual_seed = manual_seed  # type: ignore[assignment]
    mode = _EngineMode() if outermost else None
    try:
        if mode is not None:
            mode.__enter__()
        yield
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
        _tls.view = prev
        _tls.depth -= 1
        if patched:
            torch.manual_seed = _real_seed
            torch.random.manual_seed = _real_seed
        if view is not None:
            view.client.flush()


def activate(procs: Any) -> Any:
    """Make ``procs`` (a proc mesh or a view of one) the mesh torch calls run on.

    The engine is spawned on the mesh's procs the first time; this does not wait
    for them. Leaving the block sends what is queued.
    """
    return _activated(client_for(procs).view(procs))


def get_active_mesh() -> Any:
    """The proc mesh (view) activated in this thread; ValueError if none is (as Monarch)."""
    view = active_view()
    if view is None:
        raise ValueError("no device mesh is active: use `with procs.activate():`")
    return view.procs


class _NoMesh:
    """``with no_mesh.activate():`` torch runs locally, even inside a mesh's block."""

    def activate(self) -> Any:
        return _activated(None)

    def __repr__(self) -> str:
        return "no_mesh"


no_mesh = _NoMesh()
