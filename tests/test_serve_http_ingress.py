"""Any Service over HTTP (``serve_http``, Ray Serve's HTTP ingress): arguments from the
JSON body, the value as JSON, and each failure as the status a client can act on."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from actormesh.actor import Actor, endpoint
from actormesh.serve import Service, create_service_app, serve_http

from conftest import wait_for
from test_serve_service import FileGate

GET_S = 60


class Calc(Actor):
    @endpoint
    def add(self, a: int, b: int = 0) -> int:
        return a + b

    @endpoint
    def echo(self, x: Any) -> Any:
        return x

    @endpoint
    def info(self) -> dict[str, int]:
        return {"pid": os.getpid()}

    @endpoint
    def boom(self) -> None:
        raise ValueError("bad input (test)")

    @endpoint
    def opaque(self) -> Any:
        return complex(1, 2)


@pytest.fixture(scope="module")
def calc() -> Iterator[tuple[Service[Calc], httpx.Client]]:
    svc = Service(1, 1, Calc)
    svc.ready().get(timeout=GET_S)
    server = serve_http(svc, port=0)
    try:
        with httpx.Client(base_url=server.url, timeout=GET_S) as client:
            yield svc, client
    finally:
        server.stop()
        svc.stop().get(timeout=GET_S)


def test_the_body_gives_the_arguments_and_the_value_comes_back_as_json(calc: Any) -> None:
    _, http = calc
    assert http.post("/add", json={"a": 2, "b": 3}).json() == 5
    assert http.post("/add", json=[2, 3]).json() == 5
    assert http.post("/echo", json="hi").json() == "hi"
    assert http.post("/echo", json=[[1, 2]]).json() == [1, 2]  # one list argument: inside an array
    assert http.post("/info").json()["pid"] != os.getpid()
    assert http.get("/-/healthz").status_code == 200
    assert "POST /add" in http.get("/-/routes").json()["routes"]


def test_each_failure_has_the_status_a_client_can_act_on(calc: Any) -> None:
    _, http = calc

    def error(resp: httpx.Response) -> dict[str, str]:
        return resp.json()["error"]

    resp = http.post("/add", content=b"{nope", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "must be JSON" in error(resp)["message"]
    resp = http.post("/add", json={"a": 1, "c": 1})
    assert resp.status_code == 400 and error(resp)["type"] == "invalid_request" and "'c'" in error(resp)["message"]
    resp = http.post("/boom")
    assert resp.status_code == 500 and error(resp)["type"] == "endpoint_error" and "ValueError: bad input" in error(resp)["message"]
    resp = http.post("/opaque")
    assert resp.status_code == 500 and error(resp)["type"] == "not_json" and "complex" in error(resp)["message"]
    assert http.post("/nope").status_code == 404
    assert http.post("/add", json=[1]).json() == 1, "the service still serves"


def test_overload_and_a_replica_dying_mid_request(tmp_path: Path) -> None:
    flag = tmp_path / "open"
    svc = Service(1, 1, FileGate, str(flag), max_concurrency=1, max_queue=0)
    server = None
    try:
        svc.ready().get(timeout=GET_S)
        server = serve_http(svc, port=0, endpoints=["wait"])
        with httpx.Client(base_url=server.url, timeout=GET_S) as http:
            pid = svc.replicas()[0].mesh.pid.call_one().get(timeout=GET_S)
            first: list[httpx.Response] = []
            caller = threading.Thread(target=lambda: first.append(http.post("/wait", json=[1])))
            caller.start()
            wait_for(lambda: svc.metrics().in_flight == 1)
            busy = http.post("/wait", json=[2])
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "overloaded"
            os.kill(pid, signal.SIGKILL)
            caller.join(GET_S)
            assert first[0].status_code == 503 and first[0].json()["error"]["type"] == "replica_failed"
            assert "may or may not have run" in first[0].json()["error"]["message"]
            assert "retry-after" not in first[0].headers
            assert http.post("/pid").status_code == 404, "only the endpoints asked for are served"
    finally:
        flag.write_text("go")
        if server is not None:
            server.stop()
        svc.stop().get(timeout=GET_S)


def test_unknown_endpoints_are_refused_at_once() -> None:
    svc = Service(1, 1, Calc)
    try:
        with pytest.raises(ValueError, match=r"\['nope'\] are not endpoints of service Calc"):
            create_service_app(svc, ["add", "nope"])
    finally:
        svc.stop().get(timeout=GET_S)
