"""Telemetry: Monarch's ``get_meter``/``span``/``traced`` and the runtime's own figures.

A leaf: imports no other actormesh layer. The runtime calls in through cheap
hooks (``STATE.on`` is the one attribute it checks per message) and installs
``STATE.snapshot`` so exporters can read the process's figures.

- :func:`get_meter`, :func:`span`, :func:`traced`: OpenTelemetry when installed
  (``pip install actormesh[telemetry]``), no-ops otherwise.
- :func:`enable`: collect figures (messages, mailbox depth, latency, errors,
  restarts, bytes, RSS, CPU) and trace calls across processes. The runtime
  calls it when ``configure(telemetry=True)`` or a dashboard port is set.
- :func:`recent_spans`: the last spans that ended in this process.
- :func:`render_prometheus`: figures as Prometheus text (``/metrics``).

See docs/telemetry.md.
"""

from ._api import NoopMeter, NoopSpan, get_meter, span, traced
from ._figures import FIGURES, LATENCY_BUCKETS_S, ActorFigures, ProcFigures, process_usage
from ._otel import EndpointScope, call_context, disable, enable, flush, recent_spans
from ._prometheus import PROMETHEUS_CONTENT_TYPE, render_prometheus
from ._state import STATE

__all__ = [
    "get_meter",
    "span",
    "traced",
    "NoopMeter",
    "NoopSpan",
    "enable",
    "disable",
    "flush",
    "recent_spans",
    "call_context",
    "EndpointScope",
    "STATE",
    "FIGURES",
    "LATENCY_BUCKETS_S",
    "ActorFigures",
    "ProcFigures",
    "process_usage",
    "render_prometheus",
    "PROMETHEUS_CONTENT_TYPE",
]
