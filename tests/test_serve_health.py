"""Health checks a replica answers itself (``check_health``, Ray Serve's name): one
that raises restarts that replica only; one stuck behind a long request is waited for."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from actormesh.actor import Actor, endpoint
from actormesh.serve import Service

from conftest import wait_for
from test_serve_service import FileGate

GET_S = 60


class Fragile(Actor):
    """Healthy until ``break_me``; then its health check raises."""

    def __init__(self) -> None:
        self.broken = False

    @endpoint
    def break_me(self) -> int:
        self.broken = True
        return os.getpid()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def check_health(self) -> None:
        if self.broken:
            raise RuntimeError("the model on this replica is corrupt (test)")


class SlowGate(FileGate):
    """A FileGate that answers health checks (queued behind a ``wait`` in progress)."""

    @endpoint
    def check_health(self) -> None:
        return None


def test_a_replica_whose_check_raises_is_restarted_and_only_it() -> None:
    svc = Service(1, 2, Fragile, router="round_robin", health_check_period_s=0.05)
    try:
        svc.ready().get(timeout=GET_S)
        assert svc.health is not None
        pids = {r.slot: r.mesh.pid.call_one().get(timeout=GET_S) for r in svc.replicas()}
        broken_pid = svc.break_me.route().get(timeout=GET_S)
        broken = next(slot for slot, pid in pids.items() if pid == broken_pid)
        wait_for(lambda: {(r.slot, r.generation, r.state) for r in svc.replicas()}
                 == {(broken, 1, "healthy"), (1 - broken, 0, "healthy")}, timeout=GET_S)
        assert svc.health.failed[0][:2] == (broken, 0) and "corrupt" in svc.health.failed[0][2]
        assert svc.metrics().replicas[broken].restarts == 1
        assert svc.metrics().requests == 1, "checks are not requests"
        new_pid = next(r for r in svc.replicas() if r.slot == broken).mesh.pid.call_one().get(timeout=GET_S)
        assert new_pid != broken_pid
    finally:
        svc.stop().get(timeout=GET_S)
    assert not svc.health._thread.is_alive()


def test_a_check_stuck_behind_a_long_request_is_waited_for(tmp_path: Path) -> None:
    flag = tmp_path / "open"
    svc = Service(1, 1, SlowGate, str(flag), health_check_period_s=0.02)
    try:
        svc.ready().get(timeout=GET_S)
        assert svc.health is not None
        running = svc.wait.route(7)
        wait_for(lambda: svc.metrics().in_flight == 1)
        start = svc.health.rounds
        wait_for(lambda: svc.health.rounds >= start + 20)  # 20 periods with the check unanswered
        assert [r.generation for r in svc.replicas()] == [0] and not svc.health.failed
        flag.write_text("go")
        assert running.get(timeout=GET_S) == 7
    finally:
        flag.write_text("go")
        svc.stop().get(timeout=GET_S)


def test_no_check_without_the_endpoint_and_bad_periods_are_refused() -> None:
    svc = Service(1, 1, FileGate, "x")
    try:
        assert svc.health is None
    finally:
        svc.stop().get(timeout=GET_S)
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="health_check_period_s"):
            Service(1, 1, Fragile, health_check_period_s=bad)
