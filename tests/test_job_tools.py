"""Monarch's job switches for the tools: enable_telemetry(TelemetryConfig), enable_admin(MeshAdminConfig),
DEFAULT_JOB_PATH. Each job runs in a controller process of its own (the dashboard is one per process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from actormesh.job import DEFAULT_JOB_PATH, LocalJob, MeshAdminConfig, TelemetryConfig

pytest.importorskip("fastapi")

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, urllib.request
    from actormesh.actor import Actor, endpoint
    from actormesh.job import DEFAULT_JOB_PATH, LocalJob, MeshAdminConfig, TelemetryConfig, job_load

    class Ping(Actor):
        @endpoint
        def ping(self):
            return "pong"

    mode = sys.argv[1]
    job = LocalJob(hosts=("trainers",))
    if mode == "dashboard":
        job = job.enable_telemetry(TelemetryConfig(include_dashboard=True, dashboard_port=0))
    elif mode == "admin":
        job = job.enable_admin(admin_addr="127.0.0.1:0")
    else:
        job = job.enable_telemetry(retention_secs=0)
    state = job.state(cached_path=DEFAULT_JOB_PATH)
    procs = state.trainers.spawn_procs(per_host={"gpus": 1})
    assert procs.spawn("p", Ping).ping.call_one().get(timeout=60) == "pong"
    out = {"telemetry_url": state.telemetry_url, "admin_url": state.admin_url, "query_engine": state.query_engine,
           "cached": type(job_load(DEFAULT_JOB_PATH)).__name__}
    url = state.admin_url or state.telemetry_url
    if url:
        with urllib.request.urlopen(url + "api/state", timeout=30) as r:
            out["api_keys"] = sorted(json.load(r))
    procs.stop().get(timeout=60)
    print("RESULT " + json.dumps(out), flush=True)
    """
)


def _run(tmp_path, mode: str) -> dict:
    (tmp_path / "job.py").write_text(_SCRIPT)
    p = subprocess.run([sys.executable, "job.py", mode], cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:])


@pytest.mark.timeout(180)
def test_enable_telemetry_with_the_dashboard_serves_it_and_says_where(tmp_path):
    out = _run(tmp_path, "dashboard")
    assert out["telemetry_url"].startswith("http://127.0.0.1:") and out["admin_url"] is None
    assert out["query_engine"] is None and out["cached"] == "LocalJob"
    assert (tmp_path / DEFAULT_JOB_PATH).exists()
    assert {"hosts", "meshes", "failures"} <= set(out["api_keys"]), out["api_keys"]


@pytest.mark.timeout(180)
def test_enable_admin_serves_the_mesh_api_on_its_address(tmp_path):
    out = _run(tmp_path, "admin")
    assert out["admin_url"].startswith("http://127.0.0.1:") and out["telemetry_url"] is None
    assert {"hosts", "meshes", "failures"} <= set(out["api_keys"]), out


@pytest.mark.timeout(180)
def test_telemetry_without_a_dashboard_serves_nothing(tmp_path):
    out = _run(tmp_path, "plain")
    assert out["telemetry_url"] is None and out["admin_url"] is None and "api_keys" not in out


def test_bad_tool_settings_are_refused_with_what_was_wrong():
    with pytest.raises(ValueError, match="dashboard_port must be a TCP port"):
        TelemetryConfig(dashboard_port=70000)
    with pytest.raises(ValueError, match="retention_secs must be a non-negative int"):
        TelemetryConfig(retention_secs=-1)
    with pytest.raises(ValueError, match="admin_addr must be 'host:port'"):
        MeshAdminConfig(admin_addr="localhost")
    with pytest.raises(TypeError):
        LocalJob().enable_telemetry(no_such_field=1)
    assert MeshAdminConfig("[::1]:1729").host_port() == ("::1", 1729)
    job = LocalJob()
    assert job.enable_admin() is job and job.enable_telemetry() is job  # chainable, as in Monarch
