"""The telemetry half of :class:`~._cell.Cell`: timing, spans and the actor's row in a snapshot.

Kept out of the message path when telemetry is off: the cell checks
``self.figures`` (None when off) and the message's length, nothing more.
"""

from __future__ import annotations

import time
from typing import Any

from ..telemetry import STATE, ActorFigures, EndpointScope

__all__ = ["CellFigures", "now"]

now = time.perf_counter


class CellFigures:
    """Mixin of :class:`~._cell.Cell` (uses its state)."""

    figures: ActorFigures | None

    def _trace_scope(self, msg: tuple[Any, ...], env: Any) -> EndpointScope | None:
        """The endpoint's span, child of the caller's ``call`` span whose context the message carried."""
        if not STATE.tracing:
            return None  # a traced caller, but this process does not trace: drop the context
        cls = getattr(self, "cls", None)
        name = f"{cls.__qualname__ if cls is not None else self.display}.{env.endpoint}"  # type: ignore[attr-defined]
        return EndpointScope(msg[2], name, self.display, env.member)  # type: ignore[attr-defined]

    @staticmethod
    def _handled(fig: ActorFigures | None, t0: float, scope: EndpointScope | None, exc: BaseException | None = None) -> None:
        """A message is done: end its span (with ``exc``), count it. Returns None (to clear both)."""
        if scope is not None:
            scope.finish(exc)
        if fig is not None:
            fig.handled(now() - t0)
        return None

    def mailbox_depth(self) -> int:
        """Messages waiting for this actor."""
        return len(self._mailbox)  # type: ignore[attr-defined]

    def snapshot_row(self) -> dict[str, Any]:
        """This actor's row in its process's stats snapshot (builtins only)."""
        fig = self.figures
        cls = getattr(self, "cls", None)
        row = {
            "name": self.name,  # type: ignore[attr-defined]
            "display": self.display,  # type: ignore[attr-defined]
            "mesh": self.mesh_name,  # type: ignore[attr-defined]
            "rank": self.rank_raw[0],  # type: ignore[attr-defined]
            "class": f"{cls.__module__}.{cls.__qualname__}" if cls is not None else "",
            "status": self.status,  # type: ignore[attr-defined]
            "cause": self.cause,  # type: ignore[attr-defined]
            "owner": list(self.owner) if self.owner is not None else None,  # type: ignore[attr-defined]
            "mailbox": self.mailbox_depth(),
        }
        row.update(fig.as_dict() if fig is not None else ActorFigures().as_dict())
        return row
