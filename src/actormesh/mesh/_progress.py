"""Progress display for long waits (spawning many procs, hosts joining).

Shown with ``rich`` on an interactive terminal, silent otherwise (CI logs,
pipes, notebooks without a TTY).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

__all__ = ["progress"]


@contextlib.contextmanager
def progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """``with progress("spawning procs", 64) as advance: ... advance(1)``."""
    if total <= 1 or not sys.stderr.isatty():
        yield _no_progress
        return
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        yield _no_progress
        return
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
    ) as bar:
        task = bar.add_task(description, total=total)

        def advance(n: int = 1) -> None:
            bar.advance(task, n)

        yield advance


def _no_progress(n: int = 1) -> None:
    """What ``progress`` yields where no bar is shown: counts nothing."""
