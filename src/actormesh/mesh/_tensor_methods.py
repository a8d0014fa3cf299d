"""Monarch's tensor-engine methods of a proc mesh (``activate``, ``rank_tensor``,
``process_group``) and ``to_table``.

The tensor engine is a layer above this one and needs torch, which the actor
runtime must not import; so these methods look it up by name on first use
instead of importing it here. Everything they do lives in ``actormesh.tensor``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any


def _engine() -> Any:
    try:
        return importlib.import_module("actormesh.tensor")
    except ImportError as exc:
        raise ImportError(f"the tensor engine needs torch ({exc}); install it with `pip install 'actormesh[torch]'`") from exc


class TensorMethods:
    """Mixed into :class:`ProcMesh`."""

    __slots__ = ()

    def activate(self) -> Any:
        """Context manager: torch calls inside run on every proc of this mesh.

        >>> with procs.activate():            # doctest: +SKIP
        ...     t = torch.rand(3, 4)          # one shard per proc
        >>> actormesh.inspect(t)              # doctest: +SKIP
        """
        return _engine().activate(self)

    def rank_tensor(self, dim: str) -> Any:
        """A distributed 0-dim long tensor: each proc's coordinate along ``dim``."""
        return _engine().rank_tensor(self, dim)

    def rank_tensors(self) -> dict[str, Any]:
        """``{dim: rank_tensor(dim)}`` for every dim of this mesh."""
        return {d: self.rank_tensor(d) for d in self._shape.labels}  # type: ignore[attr-defined]

    def process_group(self, dims: str | Sequence[str]) -> Any:
        """A torch process group over ``dims`` of this mesh, for remote functions."""
        return _engine().RemoteProcessGroup(self, dims)

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
