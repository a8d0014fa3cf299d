"""Progress of long waits: a ``rich`` status line on a terminal, silence otherwise."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

__all__ = ["Progress"]


class Progress:
    """``with Progress("waiting for hosts") as p: p.update("1/2 joined")``.

    Shows a spinner on stderr only when stderr is a terminal and ``rich`` is
    installed; otherwise every call is a no-op.
    """

    def __init__(self, title: str, *, enabled: bool | None = None) -> None:
        self.title = title
        self._status: Any = None
        if enabled is None:
            enabled = sys.stderr.isatty()
        if enabled:
            try:
                from rich.console import Console
            except ImportError:
                return
            self._status = Console(stderr=True).status(title)

    def __enter__(self) -> Progress:
        if self._status is not None:
            self._status.start()
        return self

    def update(self, detail: str) -> None:
        """Show ``title: detail``."""
        if self._status is not None:
            self._status.update(f"{self.title}: {detail}")

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._status is not None:
            self._status.stop()
