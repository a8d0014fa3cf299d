"""Prometheus metrics of the OpenAI-compatible server (``GET /metrics``).

Each app gets its own ``CollectorRegistry`` so that several servers in one
process (tests, benchmarks) do not share or clash over counters.

=========================================  =========  ============================
metric                                     kind       labels
=========================================  =========  ============================
actormesh_http_requests_total              counter    method, path, status
actormesh_http_request_duration_seconds    histogram  path
actormesh_http_requests_in_flight          gauge      path
actormesh_time_to_first_token_seconds      histogram  endpoint
actormesh_prompt_tokens_total              counter    endpoint
actormesh_completion_tokens_total          counter    endpoint
actormesh_requests_cancelled_total         counter    endpoint
=========================================  =========  ============================
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

#: paths counted under their own label; anything else is counted as "other"
_KNOWN_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"})


class ServerMetrics:
    """The metrics of one server, in a registry of its own."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "actormesh_http_requests", "HTTP requests answered", ["method", "path", "status"], registry=r
        )
        self.duration = Histogram(
            "actormesh_http_request_duration_seconds",
            "time from request to the end of the response",
            ["path"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("actormesh_http_requests_in_flight", "requests being answered", ["path"], registry=r)
        self.ttft = Histogram(
            "actormesh_time_to_first_token_seconds",
            "time from request to the first generated text",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("actormesh_prompt_tokens", "prompt tokens taken in", ["endpoint"], registry=r)
        self.completion_tokens = Counter(
            "actormesh_completion_tokens", "tokens generated", ["endpoint"], registry=r
        )
        self.cancelled = Counter(
            "actormesh_requests_cancelled",
            "requests cancelled because the client went away",
            ["endpoint"],
            registry=r,
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI middleware counting requests by path and status, and timing them.

    Pure ASGI (not ``BaseHTTPMiddleware``) so that streaming responses and client
    disconnects pass through untouched.
    """

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in _KNOWN_PATHS else "other"
        status = {"code": 500}
        start = time.perf_counter()

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        m = self.metrics
        m.in_flight.labels(path).inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            m.in_flight.labels(path).dec()
            m.duration.labels(path).observe(time.perf_counter() - start)
            m.requests.labels(scope["method"], path, str(status["code"])).inc()
