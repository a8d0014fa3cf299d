"""Wiring to OpenTelemetry: providers, trace context on calls, recent spans.

:func:`enable` turns the runtime's figures on and, when the OpenTelemetry SDK
is installed and the program has not set providers of its own, installs a
tracer provider that keeps the last spans in memory (:func:`recent_spans`,
shown by the dashboard) and exports over OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``..._TRACES_ENDPOINT``) is set and the OTLP exporter is installed. The
runtime's figures are offered to whatever meter provider is in force as
observable instruments (``actormesh.*``), so an OTLP metric reader exports them.

Trace context travels with a call as ``(trace_id, span_id, flags)``: three
ints, only when tracing is on.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from ._state import STATE, otel_trace

log = logging.getLogger("actormesh.telemetry")

__all__ = ["enable", "disable", "flush", "recent_spans", "call_context", "EndpointScope"]

#: How many finished spans each process keeps for recent_spans().
RECENT_SPANS = 2048
_recent: deque[Any] = deque(maxlen=RECENT_SPANS)
_lock = threading.Lock()
_installed = False
#: Providers this module installed (flushed by flush()).
_providers: list[Any] = []


def enable(service: str = "actormesh") -> None:
    """Collect the runtime's figures in this process; trace calls if OpenTelemetry is installed.

    Idempotent. Called by the runtime when ``configure(telemetry=True)`` (or a
    dashboard) is in force; programs may call it directly too.
    """
    global _installed
    STATE.service = service
    STATE.on = True
    trace = otel_trace()
    STATE.tracing = trace is not None
    with _lock:
        if _installed or trace is None:
            return
        _installed = True
    _install_tracer_provider(trace, service)
    _install_meter_provider(service)
    _register_figures()


def disable() -> None:
    """Stop collecting figures and tracing calls (providers stay installed)."""
    STATE.on = False
    STATE.tracing = False


def _otlp_configured(signal: str) -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"))


def _install_tracer_provider(trace: Any, service: str) -> None:
    if type(trace.get_tracer_provider()).__name__ != "ProxyTracerProvider":
        return  # the program set its own provider: ours would be ignored anyway
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    except ImportError:
        return  # API only: spans are non-recording, context still propagates

    class _Recent(SpanProcessor):
        def on_end(self, span: Any) -> None:
            _recent.append(span)  # converted when read: keeps the traced path short

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(_Recent())
    if _otlp_configured("TRACES"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        except ImportError:
            log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but opentelemetry-exporter-otlp-proto-http is not installed: spans are not exported")
    trace.set_tracer_provider(provider)
    _providers.append(provider)


def _install_meter_provider(service: str) -> None:
    if not _otlp_configured("METRICS"):
        return
    try:
        from opentelemetry import metrics
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
    except ImportError:
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK or OTLP exporter is missing: metrics are not exported")
        return
    if type(metrics.get_meter_provider()).__name__ != "_ProxyMeterProvider":
        return
    reader = PeriodicExportingMetricReader(OTLPMetricExporter())
    provider = MeterProvider(resource=Resource.create({"service.name": service}), metric_readers=[reader])
    metrics.set_meter_provider(provider)
    _providers.append(provider)


def flush(timeout_s: float = 2.0) -> None:
    """Export what the providers installed here still hold (a proc calls it before it exits).

    Bounded by ``timeout_s`` per provider; a no-op when telemetry never started.
    """
    for provider in list(_providers):
        try:
            provider.force_flush(int(timeout_s * 1000))
        except Exception:
            log.debug("flushing telemetry failed", exc_info=True)


def _register_figures() -> None:
    """Offer the runtime's figures as observable instruments on the ``actormesh`` meter."""
    from opentelemetry import metrics
    from opentelemetry.metrics import Observation

    meter = metrics.get_meter("actormesh")

    def per_actor(field: str) -> Any:
        def observe(_: Any) -> list[Any]:
            snap = STATE.snapshot() if STATE.snapshot else None
            if not snap:
                return []
            return [Observation(a[field], {"actor": a["display"], "proc": snap["address"]}) for a in snap["actors"]]

        return observe

    def per_proc(field: str) -> Any:
        def observe(_: Any) -> list[Any]:
            snap = STATE.snapshot() if STATE.snapshot else None
            return [Observation(snap[field], {"proc": snap["address"]})] if snap else []

        return observe

    meter.create_observable_counter("actormesh.messages_in", [per_actor("messages_in")], description="messages an actor handled")
    meter.create_observable_counter("actormesh.errors", [per_actor("errors")], description="endpoint calls that raised")
    meter.create_observable_counter("actormesh.restarts", [per_actor("restarts")], description="restarts of an actor in place")
    meter.create_observable_gauge("actormesh.mailbox_depth", [per_actor("mailbox")], description="messages waiting in an actor's mailbox")
    meter.create_observable_counter("actormesh.messages_out", [per_proc("messages_out")], description="messages a process sent")
    meter.create_observable_counter("actormesh.bytes_out", [per_proc("bytes_out")], unit="By", description="payload bytes a process sent")
    meter.create_observable_gauge("actormesh.rss", [per_proc("rss_bytes")], unit="By", description="resident memory of a process")
    meter.create_observable_counter("actormesh.cpu_time", [per_proc("cpu_s")], unit="s", description="CPU seconds a process used")


def _span_dict(span: Any) -> dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": {k: v for k, v in (span.attributes or {}).items()},
    }


def recent_spans() -> list[dict[str, Any]]:
    """The last spans that ended in this process, oldest first (needs the OpenTelemetry SDK).

    Each is a dict: name, trace_id, span_id, parent_id (hex), start_ns, end_ns,
    status, attributes.
    """
    return [_span_dict(s) for s in list(_recent)]


def call_context(what: str) -> tuple[int, int, int] | None:
    """Record the sending of a call as a span and return its context for the wire.

    Only inside a trace (a current, valid span, e.g. ``with span("step"):`` or
    an endpoint that was itself called from a trace): else None, and the call
    travels untraced at the cost of one context lookup. The span (kind
    PRODUCER, named ``call <mesh>.<endpoint>``) is a child of the caller's
    current span and the parent of the endpoint's span on the callee.
    """
    trace = otel_trace()
    if not trace.get_current_span().get_span_context().is_valid:
        return None  # not inside a trace: calls are traced only within one (cheap when not)
    s = trace.get_tracer("actormesh").start_span(f"call {what}", kind=trace.SpanKind.PRODUCER)
    ctx = s.get_span_context()
    s.end()
    if not ctx.is_valid:
        return None
    return (ctx.trace_id, ctx.span_id, int(ctx.trace_flags))


class EndpointScope:
    """The span of one endpoint invocation on the callee, current while it runs.

    Its parent is the caller's ``call`` span when the call carried a context.
    """

    __slots__ = ("_span", "_token")

    def __init__(self, carried: Sequence[int] | None, name: str, actor: str, rank: Any) -> None:
        from opentelemetry import context as otel_context

        trace = otel_trace()
        parent = None
        if carried is not None:
            remote = trace.SpanContext(carried[0], carried[1], is_remote=True, trace_flags=trace.TraceFlags(carried[2]))
            parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
        self._span = trace.get_tracer("actormesh").start_span(
            name, context=parent, kind=trace.SpanKind.CONSUMER, attributes={"actormesh.actor": actor, "actormesh.rank": str(rank)}
        )
        self._token = otel_context.attach(trace.set_span_in_context(self._span))

    def finish(self, exc: BaseException | None = None) -> None:
        """End the span (recording ``exc`` as its error) and restore the previous context."""
        from opentelemetry import context as otel_context

        if exc is not None:
            trace = otel_trace()
            self._span.record_exception(exc)
            self._span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        otel_context.detach(self._token)
        self._span.end()
