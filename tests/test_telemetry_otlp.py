"""With OTEL_EXPORTER_OTLP_ENDPOINT set, spans (controller and worker) and the runtime's figures go out over OTLP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs opentelemetry-exporter-otlp-proto-http (telemetry extra)")
uvicorn = pytest.importorskip("uvicorn", reason="the OTLP receiver of this test runs on uvicorn (dashboard extra)")

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    from actormesh.actor import Actor, endpoint, span, this_host

    class Ping(Actor):
        @endpoint
        def ping(self):
            with span("inside-worker"):
                return "pong"

    procs = this_host().spawn_procs(per_host={"gpus": 1})
    mesh = procs.spawn("otlp_pings", Ping)
    with span("otlp-root"):
        assert mesh.ping.call_one().get(timeout=60) == "pong"
    procs.stop().get(timeout=30)
    """
)


class Receiver:
    """An OTLP/HTTP collector stand-in: decodes what it is sent."""

    def __init__(self) -> None:
        self.spans: list[str] = []
        self.metrics: list[str] = []
        self._lock = threading.Lock()

    async def traces(self, request: Request) -> Response:
        msg = ExportTraceServiceRequest.FromString(await request.body())
        with self._lock:
            self.spans += [s.name for rs in msg.resource_spans for ss in rs.scope_spans for s in ss.spans]
        return Response(b"", media_type="application/x-protobuf")

    async def metrics_in(self, request: Request) -> Response:
        msg = ExportMetricsServiceRequest.FromString(await request.body())
        with self._lock:
            self.metrics += [m.name for rm in msg.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
        return Response(b"", media_type="application/x-protobuf")


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    rec = Receiver()
    app = Starlette(routes=[Route("/v1/traces", rec.traces, methods=["POST"]), Route("/v1/metrics", rec.metrics_in, methods=["POST"])])
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    try:
        yield rec, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.timeout(120)
def test_spans_and_figures_are_exported_over_otlp(receiver: tuple[Receiver, str], tmp_path: Path) -> None:
    rec, endpoint = receiver
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env: dict[str, Any] = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "ACTORMESH_"))}
    env.update(ACTORMESH_TELEMETRY="1", OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_METRIC_EXPORT_INTERVAL="200")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    # The controller flushes at exit; the worker before it exits (worker.py).
    assert {"otlp-root", "call otlp_pings.ping", "Ping.ping", "inside-worker"} <= set(rec.spans), rec.spans
    assert {"actormesh.messages_in", "actormesh.messages_out", "actormesh.rss"} <= set(rec.metrics), rec.metrics
