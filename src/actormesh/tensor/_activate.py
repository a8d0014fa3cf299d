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
from ._tensor import dispatch

__all__ = ["activate", "get_active_mesh", "no_mesh", "active_view", "manual_seed"]

_tls = threading.local()


def active_view() -> View | None:
    """The view torch calls go to in this thread (None: run locally)."""
    return getattr(_tls, "view", None)


class _EngineMode(TorchDispatchMode):
    def __init__(self, view: View | None) -> None:
        super().__init__()
        self.view = view

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        view = self.view
        if view is None:  # no_mesh: run locally (this mode is off the stack while it dispatches)
            return func(*args, **(kwargs or {}))
        return dispatch(func, args, kwargs or {}, view)


def _mode_dispatch(self: _EngineMode, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    view = self.view
    if view is None:
        return func(*args, **(kwargs or {}))
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
    _tls.view = view
    patched = torch.manual_seed is not manual_seed
    if patched:
        torch.manual_seed = manual_seed  # type: ignore[assignment]
        torch.random.manual_seed = manual_seed  # type: ignore[assignment]
    try:
        with _EngineMode(view):
            yield
    finally:
        _tls.view = prev
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
    """The proc mesh (view) activated in this thread, or None."""
    view = active_view()
    return None if view is None else view.procs


class _NoMesh:
    """``with no_mesh.activate():`` torch runs locally, even inside a mesh's block."""

    def activate(self) -> Any:
        return _activated(None)

    def __repr__(self) -> str:
        return "no_mesh"


no_mesh = _NoMesh()
