"""Monarch's tensor-engine methods of a proc mesh (``activate``, ``rank_tensor``,
``process_group``) and ``to_table``.

The tensor engine is a layer above this one and needs torch, which the actor
runtime must not import. So this layer declares what it needs of an engine
(:class:`TensorEngineAPI`) and the engine registers itself through
:func:`use_tensor_engine`: ``actormesh.tensor`` when it is imported, and the
``actormesh.actor`` facade with a stand-in that imports it on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol


class TensorEngineAPI(Protocol):
    """What a proc mesh and an endpoint need of the tensor engine."""

    def activate(self, mesh: Any) -> AbstractContextManager[Any]:
        """Context manager: torch calls inside run on every proc of ``mesh``."""

    def rank_tensor(self, mesh: Any, dim: str) -> Any:
        """A distributed 0-dim long tensor: each proc's coordinate along ``dim``."""

    def process_group(self, mesh: Any, dims: str | Sequence[str]) -> Any:
        """A torch process group over ``dims`` of ``mesh``."""

    def endpoint_rref(self, actors: Any, prop: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``actors.<prop>(*args, **kwargs)`` as a tensor command; its distributed results."""


_engine: TensorEngineAPI | None = None


def use_tensor_engine(engine: TensorEngineAPI) -> None:
    """Make ``engine`` the one this process's meshes use (the latest registration wins)."""
    global _engine
    _engine = engine


def tensor_engine() -> TensorEngineAPI | None:
    """The registered tensor engine, or None."""
    return _engine


def need_engine(what: str) -> TensorEngineAPI:
    if _engine is None:
        raise RuntimeError(f"{what} needs the tensor engine, which is not loaded in this process: "
                           "`import actormesh.tensor` (it needs torch: `pip install 'actormesh[torch]'`)")
    return _engine


class TensorMethods:
    """Mixed into :class:`ProcMesh`."""

    __slots__ = ()

    def activate(self) -> Any:
        """Context manager: torch calls inside run on every proc of this mesh.

        >>> with procs.activate():            # doctest: +SKIP
        ...     t = torch.rand(3, 4)          # one shard per proc
        >>> actormesh.inspect(t)              # doctest: +SKIP
        """
        return need_engine("ProcMesh.activate()").activate(self)

    def rank_tensor(self, dim: str) -> Any:
        """A distributed 0-dim long tensor: each proc's coordinate along ``dim``."""
        return need_engine("ProcMesh.rank_tensor()").rank_tensor(self, dim)

    def rank_tensors(self) -> dict[str, Any]:
        """``{dim: rank_tensor(dim)}`` for every dim of this mesh."""
        return {d: self.rank_tensor(d) for d in self._shape.labels}  # type: ignore[attr-defined]

    def process_group(self, dims: str | Sequence[str]) -> Any:
        """A torch process group over ``dims`` of this mesh, for remote functions."""
        return need_engine("ProcMesh.process_group()").process_group(self, dims)

    def to_table(self) -> str:
        """The mesh as a table: one row per proc, its coordinates and its rank."""
        shape = self._shape  # type: ignore[attr-defined]
        labels = list(shape.labels)
        rows = []
        for i in range(len(shape)):
            coords = shape.point(i)
            rows.append([str(coords[label]) for label in labels] + [str(shape.rank_at(i))])
        head = labels + ["rank"]
        widths = [max(len(h), *(len(r[j]) for r in rows)) if rows else len(h) for j, h in enumerate(head)]
        line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
        return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])
