"""Composition: a Service sent to another process is a handle (Ray Serve's model
composition): a replica of one service calls another service, with the same
routing, admission and errors as a local ``route``."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from actormesh.actor import Actor, endpoint
from actormesh.serve import Service, ServiceHandle, ServiceOverloaded

from conftest import wait_for
from test_serve_service import Echo, FileGate

GET_S = 60


class Front(Actor):
    """Holds a service (a constructor argument: it arrives as a handle) and calls it."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    @endpoint
    def ask(self, x: int) -> tuple[int, int, int]:
        tag, pid, y = self.backend.hello.route(x).get(timeout=GET_S)
        return os.getpid(), pid, y

    @endpoint
    def everyone(self) -> list[str]:
        return [tag for tag, _, _ in self.backend.hello.fanout(0).get(timeout=GET_S)]

    @endpoint
    def misuse(self) -> list[str]:
        out = [type(self.backend).__name__]
        try:
            self.backend.hello.route().get(timeout=GET_S)
        except TypeError as exc:  # checked where the service lives, raised here as a TypeError
            out.append(str(exc))
        try:
            self.backend.nope
        except AttributeError as exc:
            out.append(str(exc))
        return out


def test_a_replica_of_one_service_calls_another_through_a_handle() -> None:
    back = Service(1, 2, Echo, "back", router="round_robin")
    front = None
    try:
        back.ready().get(timeout=GET_S)
        front = Service(1, 1, Front, back)
        front.ready().get(timeout=GET_S)
        out = [front.ask.route(i).get(timeout=GET_S) for i in range(4)]
        back_pids = {r.mesh.pid.call_one().get(timeout=GET_S) for r in back.replicas()}
        assert [y for _, _, y in out] == [0, 1, 2, 3]
        assert {pid for _, pid, _ in out} == back_pids, "round robin over both replicas of the back service"
        assert {front_pid for front_pid, _, _ in out}.isdisjoint(back_pids | {os.getpid()})
        assert back.metrics().requests == 4, "routed by the back service, counted there"
        assert front.everyone.route().get(timeout=GET_S) == ["back", "back"]
        kind, bad_args, missing = front.misuse.route().get(timeout=GET_S)
        assert kind == "ServiceHandle" and "missing a required argument" in bad_args
        assert "service Echo has no endpoint 'nope'" in missing and "hello" in missing
    finally:
        if front is not None:
            front.stop().get(timeout=GET_S)
        back.stop().get(timeout=GET_S)


def test_a_handle_raises_what_a_local_route_raises(tmp_path: Path) -> None:
    flag = tmp_path / "open"
    svc = Service(1, 1, FileGate, str(flag), max_concurrency=1, max_queue=0)
    try:
        svc.ready().get(timeout=GET_S)
        handle = pickle.loads(pickle.dumps(svc))
        assert isinstance(handle, ServiceHandle) and handle.name == "FileGate"
        running = handle.wait.route(1)
        wait_for(lambda: svc.metrics().in_flight == 1)
        with pytest.raises(ServiceOverloaded):
            handle.wait.route(2).get(timeout=GET_S)
        flag.write_text("go")
        assert running.get(timeout=GET_S) == 1
    finally:
        flag.write_text("go")
        svc.stop().get(timeout=GET_S)
