"""Monarch's user-facing telemetry calls: ``get_meter``, ``span``, ``traced``.

With the OpenTelemetry API installed (``pip install actormesh[telemetry]``) they
are the OpenTelemetry meter and tracer of this process, so whatever provider the
program (or actormesh, see :func:`~actormesh.telemetry.enable`) installs records
them. Without it they are no-op objects with the same methods, cheap enough to
leave in hot code.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar, overload

from ._state import STATE, otel_trace

__all__ = ["get_meter", "span", "traced", "NoopMeter", "NoopSpan"]

F = TypeVar("F", bound=Callable[..., Any])


class _NoopInstrument:
    """Counter, up-down counter, histogram or gauge that records nothing."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def add(self, amount: float, attributes: Mapping[str, Any] | None = None, context: Any = None) -> None:
        """Counters: add ``amount`` (dropped)."""

    def record(self, amount: float, attributes: Mapping[str, Any] | None = None, context: Any = None) -> None:
        """Histograms: record ``amount`` (dropped)."""

    def set(self, amount: float, attributes: Mapping[str, Any] | None = None, context: Any = None) -> None:
        """Gauges: set ``amount`` (dropped)."""


class NoopMeter:
    """The meter :func:`get_meter` returns when OpenTelemetry is not installed."""

    def __init__(self, name: str) -> None:
        self.name = name

    def create_counter(self, name: str, unit: str = "", description: str = "") -> _NoopInstrument:
        """A counter (``.add(n, attributes)``)."""
        return _NoopInstrument(name)

    def create_up_down_counter(self, name: str, unit: str = "", description: str = "") -> _NoopInstrument:
        """An up-down counter (``.add(±n, attributes)``)."""
        return _NoopInstrument(name)

    def create_histogram(self, name: str, unit: str = "", description: str = "", **_: Any) -> _NoopInstrument:
        """A histogram (``.record(x, attributes)``)."""
        return _NoopInstrument(name)

    def create_gauge(self, name: str, unit: str = "", description: str = "") -> _NoopInstrument:
        """A gauge (``.set(x, attributes)``)."""
        return _NoopInstrument(name)

    def create_observable_counter(self, name: str, callbacks: Any = None, unit: str = "", description: str = "") -> _NoopInstrument:
        """An observable counter (callbacks are never called)."""
        return _NoopInstrument(name)

    def create_observable_gauge(self, name: str, callbacks: Any = None, unit: str = "", description: str = "") -> _NoopInstrument:
        """An observable gauge (callbacks are never called)."""
        return _NoopInstrument(name)

    def create_observable_up_down_counter(self, name: str, callbacks: Any = None, unit: str = "", description: str = "") -> _NoopInstrument:
        """An observable up-down counter (callbacks are never called)."""
        return _NoopInstrument(name)


class NoopSpan:
    """The span :func:`span` yields when OpenTelemetry is not installed (one shared object)."""

    __slots__ = ()

    def set_attribute(self, key: str, value: Any) -> None:
        """Dropped."""

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Dropped."""

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None) -> None:
        """Dropped."""

    def record_exception(self, exception: BaseException, attributes: Any = None, timestamp: int | None = None, escaped: bool = False) -> None:
        """Dropped."""

    def set_status(self, status: Any, description: str | None = None) -> None:
        """Dropped."""

    def is_recording(self) -> bool:
        """Always False."""
        return False

    def __enter__(self) -> NoopSpan:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_NOOP_SPAN = NoopSpan()


def get_meter(name: str = "actormesh", version: str = "", schema_url: str | None = None, attributes: Mapping[str, Any] | None = None) -> Any:
    """The process's OpenTelemetry meter named ``name`` (a no-op meter without OpenTelemetry).

    Example::

        from actormesh.actor import get_meter
        steps = get_meter("trainer").create_counter("steps")
        steps.add(1, {"phase": "warmup"})
    """
    try:
        from opentelemetry import metrics
    except ImportError:
        return NoopMeter(name)
    return metrics.get_meter(name, version or None, schema_url=schema_url, attributes=attributes)  # type: ignore[arg-type]  # None: no version


def span(name: str, attributes: Mapping[str, Any] | None = None) -> Any:
    """A context manager timing a block as a span named ``name``; yields the span.

    Inside an actor the span carries the actor's name and rank; a call made
    inside it continues the trace on the callee. Example::

        with span("load_batch") as s:
            s.set_attribute("size", 32)
            batch = next(loader)
    """
    trace = otel_trace()
    if trace is None:
        return _NOOP_SPAN
    return _otel_span(trace, name, attributes)


@contextmanager
def _otel_span(trace: Any, name: str, attributes: Mapping[str, Any] | None) -> Iterator[Any]:
    attrs = dict(attributes) if attributes else {}
    actor = STATE.current_actor()
    if actor is not None:
        attrs.setdefault("actormesh.actor", actor)
    with trace.get_tracer("actormesh").start_as_current_span(name, attributes=attrs) as s:
        yield s


@overload
def traced(fn: F) -> F: ...


@overload
def traced(*, name: str) -> Callable[[F], F]: ...


def traced(fn: Any = None, *, name: str | None = None) -> Any:
    """Decorator: run each call of a sync or async function inside ``span(name)``.

    Without ``name`` the span is named after the function. Example::

        @traced
        def step(batch): ...

        @traced(name="eval")
        async def evaluate(): ...
    """

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        span_name = name if name is not None else f.__name__
        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with span(span_name):
                    return await f(*args, **kwargs)

            return async_wrapper

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with span(span_name):
                return f(*args, **kwargs)

        return wrapper

    if fn is not None:
        if not callable(fn):
            raise TypeError(f"traced takes a function or name=..., got {fn!r}; write @traced or @traced(name='...')")
        return decorate(fn)
    return decorate
