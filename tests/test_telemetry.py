"""Telemetry: Monarch's get_meter/span/traced, spans across actor calls, the runtime's figures."""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import actormesh.actor as am
from actormesh import config, telemetry
from actormesh.actor import Actor, get_meter, span, this_host, traced, endpoint
from actormesh.runtime import current_runtime, gather_stats
from actormesh.telemetry import _state

pytest.importorskip("opentelemetry.sdk", reason="needs the telemetry extra: pip install 'actormesh[telemetry]'")


class Traced(Actor):
    """Answers pings, fails on request, and reports its process's recent spans."""

    @endpoint
    def ping(self, x: int = 0) -> int:
        if x < 0:
            raise ValueError("negative ping")
        with span("inside"):
            return x

    @endpoint
    def spans(self) -> list[dict[str, Any]]:
        return telemetry.recent_spans()


class AsyncTraced(Actor):
    @endpoint
    async def ping(self) -> str:
        await asyncio.sleep(0)
        return "pong"


@pytest.fixture(scope="module")
def traced_procs() -> Iterator[Any]:
    """Two procs spawned with telemetry on; the controller traces too while the module runs."""
    was_on = _state.STATE.on
    telemetry.enable("test-controller")
    with config.configured(telemetry=True):  # the children take the settings in force at spawn
        pm = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        pm.initialized.get(timeout=60)
        yield pm
    finally:
        pm.stop().get(timeout=30)
        if not was_on:
            telemetry.disable()


def test_names_are_exported_from_actormesh_actor() -> None:
    for name in ("get_meter", "span", "traced"):
        assert name in am.__all__ and getattr(am, name) is getattr(telemetry, name)


def test_noops_without_opentelemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_state, "_trace", None)  # as if the API were not installed
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    with span("x") as s:
        s.set_attribute("k", 1)
        assert s.is_recording() is False
    assert span("a") is span("b")  # one shared object: nothing allocated per span
    meter = get_meter("m")
    assert isinstance(meter, telemetry.NoopMeter)
    meter.create_counter("c").add(1, {"a": "b"})
    meter.create_histogram("h").record(0.5)
    meter.create_up_down_counter("u").add(-1)

    @traced
    def f(x: int) -> int:
        return x + 1

    assert f(1) == 2 and f.__name__ == "f"


def test_get_meter_is_opentelemetry_meter() -> None:
    from opentelemetry import metrics

    meter = get_meter("actormesh-test")
    assert isinstance(meter, metrics.Meter)
    meter.create_counter("steps").add(1)


def test_traced_names_spans_sync_and_async(traced_procs: Any) -> None:
    @traced
    def plain() -> int:
        return 1

    @traced(name="custom")
    async def coro() -> int:
        return 2

    assert plain() == 1 and asyncio.run(coro()) == 2
    names = [s["name"] for s in telemetry.recent_spans()[-2:]]
    assert names == ["plain", "custom"]
    with pytest.raises(TypeError, match="traced takes a function"):
        traced(3)  # type: ignore[call-overload]


def test_call_span_is_parent_of_endpoint_span_on_the_worker(traced_procs: Any) -> None:
    mesh = traced_procs.spawn("traced", Traced)
    one = mesh.slice(gpus=1)
    with span("outer"):
        assert one.ping.call_one(7).get(timeout=30) == 7
    mine = telemetry.recent_spans()
    outer = next(s for s in reversed(mine) if s["name"] == "outer")
    call = next(s for s in reversed(mine) if s["name"] == "call traced.ping" and s["parent_id"] == outer["span_id"])
    remote = one.spans.call_one().get(timeout=30)
    ep = next(s for s in remote if s["name"] == "Traced.ping" and s["parent_id"] == call["span_id"])
    assert ep["trace_id"] == outer["trace_id"]
    inside = next(s for s in remote if s["name"] == "inside")
    assert inside["parent_id"] == ep["span_id"]  # user spans nest under the endpoint's span
    with span("failing"), pytest.raises(ValueError, match="negative ping"):
        one.ping.call_one(-1).get(timeout=30)
    failed = [s for s in one.spans.call_one().get(timeout=30) if s["name"] == "Traced.ping" and s["status"] == "ERROR"]
    assert failed, "the endpoint's span records the exception"
    before = len([s for s in one.spans.call_one().get(timeout=30) if s["name"] == "Traced.ping"])
    one.ping.call_one(1).get(timeout=30)  # outside any span: no context travels, no endpoint span
    after = len([s for s in one.spans.call_one().get(timeout=30) if s["name"] == "Traced.ping"])
    assert after == before


def test_figures_per_proc_and_actor(traced_procs: Any) -> None:
    mesh = traced_procs.spawn("figures", Traced)
    amesh = traced_procs.spawn("figures_async", AsyncTraced)
    for i in range(5):
        mesh.ping.call(i).get(timeout=30)
    amesh.ping.call().get(timeout=30)
    with pytest.raises(ValueError):
        mesh.slice(gpus=0).ping.call_one(-1).get(timeout=30)
    rt = current_runtime()
    snaps = gather_stats(rt, list(traced_procs._addresses), timeout_s=30)
    assert all(s is not None for s in snaps)
    for rank, snap in enumerate(snaps):
        assert snap["telemetry"] is True and snap["rss_bytes"] > 0 and snap["cpu_s"] > 0
        assert snap["messages_out"] >= 6 and snap["bytes_out"] > 0  # one reply per call at least
        row = next(a for a in snap["actors"] if a["mesh"] == mesh._mesh_name)
        assert row["status"] == "running" and row["class"].endswith("Traced") and row["mailbox"] == 0
        assert row["messages_in"] == 5 + (1 if rank == 0 else 0)
        assert row["errors"] == (1 if rank == 0 else 0)
        assert sum(row["latency_counts"]) == row["messages_in"] and row["latency_sum_s"] > 0
        arow = next(a for a in snap["actors"] if a["mesh"] == amesh._mesh_name)
        assert arow["messages_in"] == 1
    pickle.dumps(snaps)  # plain builtins, safe to ship anywhere


def test_prometheus_text_of_figures(traced_procs: Any) -> None:
    pytest.importorskip("prometheus_client")
    mesh = traced_procs.spawn("prom", Traced)
    mesh.ping.call(1).get(timeout=30)
    rt = current_runtime()
    text = telemetry.render_prometheus([s for s in gather_stats(rt, list(traced_procs._addresses), 30) if s]).decode()
    assert "# TYPE actormesh_endpoint_latency_seconds histogram" in text
    assert f'mesh="{mesh._mesh_name}"' in text and "actormesh_proc_rss_bytes" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("actormesh_actor_messages_in_total") and mesh._mesh_name in ln)
    assert line.endswith(" 1.0")


def test_telemetry_off_costs_no_context_and_counts_nothing(spawn_procs: Any) -> None:
    was = (_state.STATE.on, _state.STATE.tracing)
    telemetry.disable()
    try:
        procs = spawn_procs({"gpus": 1})
        mesh = procs.spawn("quiet", Traced)
        mesh.ping.call_one(3).get(timeout=30)
        (snap,) = gather_stats(current_runtime(), list(procs._addresses), 30)
        assert snap["telemetry"] is False and snap["bytes_out"] == 0
        row = next(a for a in snap["actors"] if a["mesh"] == mesh._mesh_name)
        assert row["messages_in"] == 0 and row["latency_counts"] == [0] * len(row["latency_counts"])
        assert mesh.spans.call_one().get(timeout=30) == []
    finally:
        _state.STATE.on, _state.STATE.tracing = was


def test_gather_stats_of_a_dead_address_is_none() -> None:
    rt = current_runtime()
    assert gather_stats(rt, ["unix:/nonexistent/actormesh-gone.sock"], timeout_s=10) == [None]


def test_importing_the_facade_loads_no_telemetry_backend() -> None:
    import subprocess

    code = ("import sys, actormesh.actor; heavy = ('opentelemetry', 'fastapi', 'uvicorn', 'prometheus_client', 'torch'); "
            "print([m for m in sys.modules if m.split('.')[0] in heavy])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORMESH_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
