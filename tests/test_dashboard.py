"""The dashboard: JSON API, live events, /metrics, the token, and the page in a real headless browser."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

pytest.importorskip("fastapi", reason="needs the dashboard extra: pip install 'actormesh[dashboard]'")
httpx = pytest.importorskip("httpx")

from actormesh import config, telemetry  # noqa: E402
from actormesh.actor import Actor, endpoint, this_host  # noqa: E402
from actormesh.dashboard import Collector, find_dashboards, job_token, start_dashboard  # noqa: E402
from actormesh.runtime import current_runtime  # noqa: E402
from actormesh.telemetry import _state  # noqa: E402

from conftest import wait_for  # noqa: E402


class Worker(Actor):
    @endpoint
    def work(self, x: int) -> int:
        print(f"working on {x}", flush=True)
        return x * 2

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def crash(self) -> None:
        raise RuntimeError("injected failure for the dashboard")


@pytest.fixture(scope="module")
def dash() -> Iterator[Any]:
    was_on = _state.STATE.on
    telemetry.enable("dashboard-test")
    d = start_dashboard(port=0, interval_s=0.5)
    try:
        yield d
    finally:
        d.stop()
        if not was_on:
            telemetry.disable()


def _spawn(per_host: dict[str, int]) -> Any:
    with config.configured(telemetry=True):
        return this_host().spawn_procs(per_host=per_host)


def _state_of(d: Any) -> dict[str, Any]:
    return httpx.get(d.url + "api/state", timeout=10).json()


def _actor_rows(state: dict[str, Any], mesh: str) -> list[dict[str, Any]]:
    return [a for h in state["hosts"] for p in h["procs"] for a in p["actors"] if a["mesh"] == mesh]


def test_state_shows_the_tree_rates_and_logs(dash: Any) -> None:
    pm = _spawn({"gpus": 2})
    try:
        mesh = pm.spawn("workers", Worker)
        for i in range(20):
            mesh.work.call(i).get(timeout=30)
        state = wait_for(lambda: (s := _state_of(dash)) and len(_actor_rows(s, mesh._mesh_name)) == 2
                         and all(a["messages_in"] >= 20 for a in _actor_rows(s, mesh._mesh_name)) and s, timeout=30)
        assert state["controller"]["address"] == current_runtime().address
        rows = _actor_rows(state, mesh._mesh_name)
        assert {a["rank"] for a in rows} == {0, 1} and all(a["status"] == "running" for a in rows)
        assert all(a["latency_ms"] is not None and a["latency_ms"] > 0 for a in rows)
        procs_of = {p["address"]: p for h in state["hosts"] for p in h["procs"]}
        assert all(procs_of[a]["status"] == "running" and procs_of[a]["rss_bytes"] > 0 for a in pm._addresses)
        assert any(m["name"] == mesh._mesh_name and m["size"] == 2 and m["status"] == "running" for m in state["meshes"])
        logs = wait_for(lambda: [ln for ln in _state_of(dash)["logs"] if "working on 19" in ln], timeout=30)
        assert logs[0].startswith("[")  # rank-prefixed
        text = httpx.get(dash.url + "metrics", timeout=10).text
        assert "actormesh_endpoint_latency_seconds_bucket" in text and mesh._mesh_name in text
    finally:
        pm.stop().get(timeout=30)


def test_failure_and_restart_reach_the_state_and_the_event_stream(dash: Any, faults: Any) -> None:
    pm = _spawn({"gpus": 2})
    try:
        mesh = pm.spawn("fragile", Worker).restart_policy(max_restarts=2, within_s=60)
        victim = mesh.slice(gpus=1).pid.call_one().get(timeout=30)
        with httpx.stream("GET", dash.url + "api/events", timeout=30) as stream:
            lines = stream.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            assert json.loads(first[6:])["version"] >= 1
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 30
            for line in lines:
                assert time.monotonic() < deadline, "no event with the failure"
                if line.startswith("data: "):
                    state = json.loads(line[6:])
                    if any(f["mesh"] == mesh._mesh_name for f in state["failures"]) or any(
                        m["name"] == mesh._mesh_name and m["restarts"] for m in state["meshes"]
                    ):
                        break
        state = wait_for(lambda: (s := _state_of(dash)) and any(m["name"] == mesh._mesh_name and m["restarts"] >= 1 for m in s["meshes"]) and s, timeout=30)
        assert faults.failures == []  # handled by the restart policy
    finally:
        pm.stop().get(timeout=30)


def test_an_actor_failure_shows_its_traceback_and_path(dash: Any, faults: Any) -> None:
    pm = _spawn({"gpus": 1})
    try:
        mesh = pm.spawn("doomed", Worker)
        mesh.crash.broadcast()  # no caller to tell: the actor fails, its owner hears
        faults.wait(1, timeout=30)
        state = wait_for(lambda: (s := _state_of(dash)) and [f for f in s["failures"] if f["mesh"] == mesh._mesh_name] and s, timeout=30)
        (failure,) = [f for f in state["failures"] if f["mesh"] == mesh._mesh_name]
        assert "injected failure for the dashboard" in failure["cause"] and "Traceback" in failure["cause"]
        assert failure["path"][-1] == "<root>" and "doomed" in failure["path"][0]
        assert any(m["name"] == mesh._mesh_name and m["status"] == "failed" for m in state["meshes"])
    finally:
        pm.stop().get(timeout=30)


def test_dashboard_info_file_is_private_and_found(dash: Any) -> None:
    rt = current_runtime()
    path = os.path.join(rt.job_dir, "dashboard.json")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert any(d["url"] == dash.url for d in find_dashboards())
    assert start_dashboard() is dash  # one per controller


def test_token_is_required_off_loopback() -> None:
    from starlette.testclient import TestClient

    from actormesh.dashboard._app import make_app

    token = job_token(b"\x01" * 32)
    assert len(token) == 40 and token != (b"\x01" * 32).hex()
    client = TestClient(make_app(Collector(current_runtime()), token))
    denied = client.get("/api/state")
    assert denied.status_code == 401 and "token" in denied.json()["error"]
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/api/state", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    page = client.get(f"/?token={token}")
    assert page.status_code == 200 and "actormesh" in page.text
    assert client.get("/api/state").status_code == 200  # the cookie set by ?token= now suffices


# -- the page in a real browser ------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser() -> Iterator[Any]:
    if not CHROMIUM or not CHROMEDRIVER:
        pytest.skip("needs Debian's chromium and chromium-driver (scripts/setup.sh installs them as root)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (dev extra)")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="actormesh-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    me = psutil.Process()
    try:
        yield driver
    finally:
        driver.quit()
        psutil.wait_procs([p for p in me.children(recursive=True) if "chrom" in p.name()], timeout=10)
        shutil.rmtree(profile, ignore_errors=True)


@pytest.mark.timeout(120)
def test_page_shows_the_running_mesh_and_updates_after_a_failure(dash: Any, browser: Any, faults: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    pm = _spawn({"gpus": 2})
    try:
        mesh = pm.spawn("trainers", Worker)
        mesh.work.call(1).get(timeout=30)
        browser.get(dash.url)
        wait = WebDriverWait(browser, 30, poll_frequency=0.05)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, f'tr.actor[data-mesh="{mesh._mesh_name}"]')) == 2)
        assert browser.find_element(By.ID, "live").text == "live"  # following the event stream
        assert browser.find_elements(By.CSS_SELECTOR, f'tr.mesh-row[data-mesh="{mesh._mesh_name}"][data-status="running"]')
        mesh.slice(gpus=1).crash.broadcast()
        faults.wait(1, timeout=30)
        card = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'.failure[data-mesh="{mesh._mesh_name}"]'))
        assert "injected failure for the dashboard" in card[0].text and "<root>" in card[0].text
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'tr.actor[data-mesh="{mesh._mesh_name}"][data-status="failed"]'))
        shot = os.environ.get("ACTORMESH_DASHBOARD_SCREENSHOT")
        if shot:  # docs/img/dashboard.png is made this way (see docs/dashboard.md)
            browser.save_screenshot(shot)
    finally:
        pm.stop().get(timeout=30)
