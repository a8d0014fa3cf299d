"""Stand-ins for the optional layers above the mesh, registered by the
``actormesh.actor`` facade: each imports its layer on first use.

The tensor engine (torch) and the dashboard (FastAPI) register themselves with
the layers below when imported (``use_tensor_engine``, ``use_dashboard``). A
Monarch program calls ``procs.activate()`` or sets ``dashboard_port`` without
importing either, so the facade, which sits above every layer, registers these
stand-ins; the first use imports the real layer, which then takes over.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from .mesh import TensorEngineAPI, tensor_engine, use_tensor_engine
from .runtime import use_dashboard

__all__ = ["install"]


def _loaded_engine() -> TensorEngineAPI:
    try:
        from .tensor import MESH_ENGINE
    except ImportError as exc:
        raise ImportError(f"the tensor engine needs torch ({exc}); install it with `pip install 'actormesh[torch]'`") from exc
    return MESH_ENGINE


class LazyTensorEngine:
    """Imports ``actormesh.tensor`` (and torch) the first time a mesh needs it."""

    def activate(self, mesh: Any) -> AbstractContextManager[Any]:
        return _loaded_engine().activate(mesh)

    def rank_tensor(self, mesh: Any, dim: str) -> Any:
        return _loaded_engine().rank_tensor(mesh, dim)

    def process_group(self, mesh: Any, dims: str | Sequence[str]) -> Any:
        return _loaded_engine().process_group(mesh, dims)

    def endpoint_rref(self, actors: Any, prop: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _loaded_engine().endpoint_rref(actors, prop, args, kwargs)


def _start_dashboard(port: int, host: str, runtime: Any) -> str:
    try:
        from .dashboard import serve_for_runtime
    except ImportError as exc:
        raise ImportError(f"the dashboard needs FastAPI and uvicorn ({exc}); pip install 'actormesh[dashboard]'") from exc
    return serve_for_runtime(port, host, runtime)


def install() -> None:
    """Register the stand-ins where no real layer has registered yet."""
    if tensor_engine() is None:
        use_tensor_engine(LazyTensorEngine())
    use_dashboard(_start_dashboard)  # the same call the dashboard makes; harmless after it
