"""The process-wide telemetry switch, read on the runtime's hot paths.

``STATE.on`` is the one attribute the runtime checks per message: False (the
default) costs one attribute load and a branch. ``STATE.tracing`` says whether
calls carry a trace context (on, and the OpenTelemetry API is importable).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["STATE", "otel_trace"]


class _State:
    __slots__ = ("on", "tracing", "current_actor", "snapshot", "service")

    def __init__(self) -> None:
        #: Runtime figures are being collected in this process.
        self.on = False
        #: Calls carry a trace context and endpoints run inside spans.
        self.tracing = False
        #: Name of the actor running the current code, or None (installed by the runtime).
        self.current_actor: Callable[[], str | None] = lambda: None
        #: This process's figures as a dict (installed by the runtime; see runtime_snapshot()).
        self.snapshot: Callable[[], dict[str, Any]] | None = None
        self.service = "actormesh"


STATE = _State()

_UNSET: Any = object()
_trace: Any = _UNSET


def otel_trace() -> Any:
    """``opentelemetry.trace`` if the OpenTelemetry API is installed, else None (cached)."""
    global _trace
    if _trace is _UNSET:
        try:
            from opentelemetry import trace as found
        except ImportError:
            found = None  # type: ignore[assignment]
        _trace = found
    return _trace
