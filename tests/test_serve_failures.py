"""Services under failure: a replica's proc SIGKILLed under load, idempotent retries,
queued requests moving to healthy replicas, an actor that fails, rebuilds.

Like tests/test_chaos.py: every request is numbered, each replica logs the
numbers it ran to a per-proc file, and the test checks that every future
resolved exactly once, that nothing ran twice, that every success ran, and that
only the may-have-run error (``ReplicaFailed``) was seen.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import pytest

from actormesh.actor import Actor, context, endpoint
from actormesh.serve import ReplicaFailed, Service

from conftest import wait_for

GET_S = 30


class Logged(Actor):
    """Logs each request number to a per-proc file before replying; can block on a gate file."""

    def __init__(self, log_dir: str, gate: str = "") -> None:
        self.log = open(os.path.join(log_dir, f"calls-{os.getpid()}.log"), "a", buffering=1)
        self.gate = gate

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def work(self, n: int) -> tuple[int, int]:
        self.log.write(f"{n}\n")  # line-buffered: on disk before the reply leaves
        return (n, os.getpid())

    @endpoint
    def gated(self, n: int) -> tuple[int, int]:
        self.log.write(f"{n}\n")
        while self.gate and not os.path.exists(self.gate):
            time.sleep(0.005)
        return (n, os.getpid())

    @endpoint
    def abort(self) -> None:
        context().actor_instance.abort("asked to fail")


def _executed(log_dir) -> Counter[int]:
    runs: Counter[int] = Counter()
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name)) as f:
            runs.update(int(line) for line in f if line.strip())
    return runs


def _healthy_again(svc: Service, slot: int, generation: int) -> bool:
    return any(r.slot == slot and r.state == "healthy" and r.generation >= generation for r in svc.replicas())


@pytest.mark.timeout(120)
def test_sigkill_one_replica_under_steady_load_loses_nothing(tmp_path, faults):
    svc = Service(1, 3, Logged, str(tmp_path), max_concurrency=32, max_queue=256)
    try:
        svc.ready().get(timeout=60)
        victim = svc.replicas()[0]
        victim_pid = victim.mesh.pid.call_one().get(timeout=GET_S)
        total, kill_at = 600, 200
        futures = []
        resolutions: Counter[int] = Counter()
        lock = threading.Lock()

        def count(n: int):
            def cb(_):
                with lock:
                    resolutions[n] += 1
            return cb

        for n in range(total):  # ~200 requests/s: paced load, not a synchronisation
            if n == kill_at:
                os.kill(victim_pid, signal.SIGKILL)
                killed_at = time.monotonic()
            fut = svc.work.route(n)
            fut._add_done_callback(count(n))
            futures.append(fut)
            time.sleep(0.005)
        ok, failed = [], []
        for n, fut in enumerate(futures):
            try:
                assert fut.get(timeout=GET_S)[0] == n
                ok.append(n)
            except ReplicaFailed as exc:
                assert "may or may not have run" in str(exc) and exc.replica == 0
                failed.append(n)
        wait_for(lambda: _healthy_again(svc, 0, 1), timeout=30)
        back_s = time.monotonic() - killed_at
        runs = _executed(tmp_path)
        assert [n for n, c in runs.items() if c > 1] == [], "a request ran twice"
        assert all(resolutions[n] == 1 for n in range(total)), "a future resolved twice or never"
        assert len(ok) + len(failed) == total
        assert all(runs[n] == 1 for n in ok), "a success without an execution record"
        assert len(failed) <= 32, "only requests in flight on the killed replica (max_concurrency 32) may fail"
        m = svc.metrics()
        assert m.restarts == 1 and m.replicas[0].restarts == 1
        assert faults.failures == [], "the service's owner handled the failure; nothing reached the fault hook"
        # The rebuilt replica serves again, on a new proc.
        new_pid = next(r for r in svc.replicas() if r.slot == 0).mesh.pid.call_one().get(timeout=GET_S)
        assert new_pid != victim_pid
        print(f"ok={len(ok)} failed={len(failed)} back_in={back_s:.2f}s p99={m.p99_ms:.1f}ms")
    finally:
        svc.stop().get(timeout=60)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("idempotent", [False, True])
def test_in_flight_requests_fail_as_may_have_run_or_are_retried(tmp_path, idempotent):
    gate = tmp_path / "gate"
    logs = tmp_path / "logs"
    logs.mkdir()
    svc = Service(1, 2, Logged, str(logs), str(gate), router="round_robin", max_concurrency=2,
                  idempotent=["gated"] if idempotent else [])
    try:
        svc.ready().get(timeout=60)
        pid0 = svc.replicas()[0].mesh.pid.call_one().get(timeout=GET_S)
        futures = [svc.gated.route(n) for n in range(4)]  # 0, 2 on replica 0; 1, 3 on replica 1
        wait_for(lambda: sum(_executed(logs).values()) >= 2 and svc.metrics().in_flight == 4, timeout=GET_S)
        wait_for(lambda: {0} <= set(_executed(logs)), timeout=GET_S)
        os.kill(pid0, signal.SIGKILL)
        wait_for(lambda: svc.metrics().replicas[0].failed_in_flight == 2, timeout=GET_S)
        gate.write_text("open")
        outcomes = {}
        for n, f in enumerate(futures):
            try:
                outcomes[n] = f.get(timeout=GET_S)[1]
            except ReplicaFailed:
                outcomes[n] = "may-have-run"
        if idempotent:
            assert all(isinstance(v, int) and v != pid0 for v in outcomes.values()), outcomes
            assert svc.metrics().replicas[0].retried == 2
        else:
            assert outcomes[1] != "may-have-run" and outcomes[3] != "may-have-run"
            assert outcomes[0] == outcomes[2] == "may-have-run"
        wait_for(lambda: _healthy_again(svc, 0, 1), timeout=30)
    finally:
        gate.write_text("open")
        svc.stop().get(timeout=60)


@pytest.mark.timeout(90)
def test_queued_requests_of_a_dead_replica_move_to_a_healthy_one(tmp_path):
    gate = tmp_path / "gate"
    logs = tmp_path / "logs"
    logs.mkdir()
    svc = Service(1, 2, Logged, str(logs), str(gate), router="round_robin", max_concurrency=1, max_queue=4)
    try:
        svc.ready().get(timeout=60)
        pids = [r.mesh.pid.call_one().get(timeout=GET_S) for r in svc.replicas()]
        futures = [svc.gated.route(n) for n in range(6)]  # replica 0: 0 running, 2 and 4 queued
        wait_for(lambda: {0, 1} <= set(_executed(logs)), timeout=GET_S)
        assert [r.queued for r in svc.metrics().replicas] == [2, 2]
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(ReplicaFailed):
            futures[0].get(timeout=GET_S)
        gate.write_text("open")
        results = {n: futures[n].get(timeout=GET_S) for n in range(1, 6)}
        assert {results[n][1] for n in (1, 3, 5)} == {pids[1]}
        assert all(results[n][0] == n for n in results)
        assert _executed(logs)[2] == 1 and _executed(logs)[4] == 1, "moved requests ran once"
    finally:
        gate.write_text("open")
        svc.stop().get(timeout=60)


@pytest.mark.timeout(90)
def test_failed_actor_on_a_live_proc_is_rebuilt_and_its_proc_freed(tmp_path, faults):
    import psutil

    svc = Service(1, 1, Logged, str(tmp_path))
    try:
        svc.ready().get(timeout=60)
        old_pid = svc.replicas()[0].mesh.pid.call_one().get(timeout=GET_S)
        svc.abort.route().get(timeout=GET_S)  # answers, then the actor fails (its proc lives on)
        wait_for(lambda: _healthy_again(svc, 0, 1), timeout=30)
        assert svc.metrics().restarts == 1
        assert svc.work.route(5).get(timeout=GET_S)[0] == 5
        wait_for(lambda: not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE, timeout=15)
        assert faults.failures == []
    finally:
        svc.stop().get(timeout=60)


@pytest.mark.timeout(90)
def test_killing_one_member_of_a_two_proc_replica_rebuilds_the_whole_replica(tmp_path, faults):
    import psutil

    svc = Service({"gpus": 2}, 2, Logged, str(tmp_path), name="tp", all_members=["work"])
    try:
        svc.ready().get(timeout=60)
        old = svc.replicas()[0].mesh.pid.call().get(timeout=GET_S).values()
        os.kill(old[1], signal.SIGKILL)  # rank 1 of replica 0; its rank 0 lives on
        wait_for(lambda: _healthy_again(svc, 0, 1), timeout=30)
        new = svc.replicas()[0].mesh.pid.call().get(timeout=GET_S).values()
        assert set(new).isdisjoint(old), "both procs of the replica were replaced"
        wait_for(lambda: not psutil.pid_exists(old[0]) or psutil.Process(old[0]).status() == psutil.STATUS_ZOMBIE, timeout=15)
        assert [svc.work.route(n).get(timeout=GET_S)[0] for n in range(4)] == [0, 1, 2, 3]
        assert faults.failures == []
    finally:
        svc.stop().get(timeout=60)


@pytest.mark.timeout(90)
def test_a_stopped_replica_proc_is_declared_dead_and_rebuilt(tmp_path):
    svc = Service(1, 2, Logged, str(tmp_path))
    try:
        svc.ready().get(timeout=60)
        pid = svc.replicas()[0].mesh.pid.call_one().get(timeout=GET_S)
        os.kill(pid, signal.SIGSTOP)  # liveness kills a stopped proc after heartbeat_timeout
        futures = [svc.work.route(n) for n in range(20)]
        wait_for(lambda: _healthy_again(svc, 0, 1), timeout=40)
        outcomes = Counter()
        for f in futures:
            try:
                f.get(timeout=GET_S)
                outcomes["ok"] += 1
            except ReplicaFailed:
                outcomes["may-have-run"] += 1
        assert sum(outcomes.values()) == 20 and outcomes["ok"] >= 10
    finally:
        svc.stop().get(timeout=60)


class FailsIfFlagged(Actor):
    """``__init__`` raises while a flag file exists (a rebuild that cannot start)."""

    def __init__(self, flag: str) -> None:
        if os.path.exists(flag):
            raise RuntimeError("flagged: cannot start")

    @endpoint
    def pid(self) -> int:
        return os.getpid()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("give_up", [False, True])
def test_failed_rebuilds_are_retried_then_given_up(tmp_path, faults, give_up):
    from actormesh.serve import ServiceUnavailable

    flag = tmp_path / "flag"
    svc = Service(1, 1, FailsIfFlagged, str(flag), max_rebuilds=1 if give_up else 3)
    try:
        svc.ready().get(timeout=60)
        flag.write_text("x")
        os.kill(svc.replicas()[0].mesh.pid.call_one().get(timeout=GET_S), signal.SIGKILL)
        wait_for(lambda: svc.replicas()[0].generation >= 2, timeout=30)  # a rebuild failed and was retried
        if give_up:
            wait_for(lambda: svc.replicas()[0].state == "failed", timeout=30)
            with pytest.raises(ServiceUnavailable, match="replica 0: failed"):
                svc.pid.route()
        else:
            flag.unlink()
            wait_for(lambda: svc.replicas()[0].state == "healthy", timeout=30)
            assert svc.pid.route().get(timeout=GET_S) > 0
        assert faults.failures == []
    finally:
        svc.stop().get(timeout=60)


@pytest.mark.timeout(120)
def test_restart_replica_rebuilds_it_and_fanout_each_reports_every_replica(tmp_path, faults):
    import psutil

    svc = Service(1, 2, Logged, str(tmp_path), gate=str(tmp_path / "open"))
    try:
        svc.ready().get(timeout=60)
        parts = svc.work.fanout_each(7)
        assert [(slot, gen) for slot, gen, _ in parts] == [(0, 0), (1, 0)]
        pids = [fut.get(timeout=GET_S)[1] for _, _, fut in parts]
        held = svc.gated.route(1)  # in flight on one replica (its gate is closed)
        wait_for(lambda: sum(r.in_flight for r in svc.metrics().replicas) == 1, timeout=GET_S)
        slot = next(r.replica for r in svc.metrics().replicas if r.in_flight == 1)
        assert svc.restart_replica(slot, 0, "test restart") is True
        assert svc.restart_replica(slot, 0) is False  # that incarnation is already gone
        with pytest.raises(ReplicaFailed, match="may or may not have run"):
            held.get(timeout=GET_S)
        wait_for(lambda: _healthy_again(svc, slot, 1), timeout=60)
        wait_for(lambda: not psutil.pid_exists(pids[slot]) or psutil.Process(pids[slot]).status() == psutil.STATUS_ZOMBIE, timeout=15)
        (tmp_path / "open").touch()
        new = svc.work.fanout_each(8)
        assert [(s, g) for s, g, _ in new] == [(0, int(slot == 0)), (1, int(slot == 1))]
        assert [fut.get(timeout=GET_S)[0] for _, _, fut in new] == [8, 8]
        assert svc.metrics().restarts == 1 and faults.failures == []
        with pytest.raises(ValueError, match="slot must be an int"):
            svc.restart_replica(-1)
    finally:
        svc.stop().get(timeout=60)
