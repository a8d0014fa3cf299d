"""This layer as the mesh layer's :class:`~actormesh.mesh.TensorEngineAPI`: what
``procs.activate()``, ``procs.rank_tensor()``, ``procs.process_group()`` and
``endpoint.rref()`` call. Registered when ``actormesh.tensor`` is imported."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from ._activate import activate
from ._endpoint_tensors import endpoint_rref
from ._process_group import RemoteProcessGroup
from ._ranks import rank_tensor

__all__ = ["MESH_ENGINE", "MeshTensorEngine"]


class MeshTensorEngine:
    """The tensor engine's entry points, by the mesh layer's names."""

    def activate(self, mesh: Any) -> AbstractContextManager[Any]:
        return activate(mesh)  # type: ignore[no-any-return]

    def rank_tensor(self, mesh: Any, dim: str) -> Any:
        return rank_tensor(mesh, dim)

    def process_group(self, mesh: Any, dims: str | Sequence[str]) -> Any:
        return RemoteProcessGroup(mesh, dims)

    def endpoint_rref(self, actors: Any, prop: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return endpoint_rref(actors, prop, args, kwargs)


#: The engine ``actormesh.tensor`` registers with the mesh layer when imported.
MESH_ENGINE = MeshTensorEngine()
