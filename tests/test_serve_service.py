"""Services: routing, fan-out, sessions, admission, scaling, multi-proc replicas, misuse."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter

import pytest

from actormesh.actor import Actor, ActorError, Channel, Port, current_rank, endpoint
from actormesh.serve import (
    RoundRobin,
    Router,
    Service,
    ServiceError,
    ServiceOverloaded,
    ServiceStopped,
    UnknownSession,
    service,
)

from conftest import wait_for

GET_S = 30


class Echo(Actor):
    def __init__(self, tag: str = "e") -> None:
        self.tag = tag
        self.weights = 0

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def hello(self, x: int) -> tuple[str, int, int]:
        return (self.tag, os.getpid(), x)

    @endpoint
    def boom(self, msg: str) -> None:
        raise ValueError(msg)

    @endpoint
    def set_weights(self, w: int) -> int:
        self.weights = w
        return os.getpid()

    @endpoint
    def get_weights(self) -> int:
        return self.weights

    @endpoint
    def rank(self) -> int:
        return current_rank().rank

    @endpoint
    def stream(self, n: int, port: Port) -> int:
        for i in range(n):
            port.send(i)
        return n


class FileGate(Actor):
    """Sync replica whose ``wait`` blocks until a file exists (deterministic, no sleeps in the test)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @endpoint
    def wait(self, n: int) -> int:
        import time

        while not os.path.exists(self.path):
            time.sleep(0.005)
        return n

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class SlowInit(Actor):
    """``__init__`` waits for a file: the replica stays starting until the test says."""

    def __init__(self, gate: str) -> None:
        import time

        while not os.path.exists(gate):
            time.sleep(0.005)

    @endpoint
    def hello(self, x: int) -> int:
        return x


class BadInit(Actor):
    def __init__(self) -> None:
        raise RuntimeError("no model file")

    @endpoint
    def ping(self) -> int:
        return 1


@service(num_replicas=2, router="round_robin", max_queue=3)
class Marked(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


@pytest.fixture
def svc2():
    svc = Service(1, 2, Echo, "t", name="echo", router="round_robin")
    try:
        svc.ready().get(timeout=60)
        yield svc
    finally:
        svc.stop().get(timeout=60)


def test_route_round_robin_fanout_and_metrics(svc2):
    results = [svc2.hello.route(i).get(timeout=GET_S) for i in range(6)]
    assert [r[2] for r in results] == list(range(6))
    pids = [r[1] for r in results]
    assert len(set(pids)) == 2 and pids[0::2] == [pids[0]] * 3, "round-robin alternates replicas"
    fan = svc2.set_weights.fanout(7).get(timeout=GET_S)
    assert sorted(fan) == sorted(set(pids))
    assert {svc2.get_weights.route().get(timeout=GET_S) for _ in range(4)} == {7}
    m = svc2.metrics()
    assert m.name == "echo" and m.healthy_replicas == 2
    assert m.requests == 6 + 2 + 4 and m.errors == 0 and m.in_flight == 0 and m.queued == 0
    assert [r.requests for r in m.replicas] == [6, 6]
    assert m.p50_ms > 0 and m.p99_ms >= m.p50_ms


def test_endpoint_errors_reach_the_caller_and_count(svc2):
    with pytest.raises(ValueError, match="bad input"):
        svc2.boom.route("bad input").get(timeout=GET_S)
    with pytest.raises(ActorError):
        svc2.boom.route("again").get(timeout=GET_S)
    assert svc2.metrics().errors == 2
    assert svc2.hello.route(1).get(timeout=GET_S)[2] == 1, "the replica lives on"


def test_misuse_gets_clear_errors_at_once(svc2):
    with pytest.raises(AttributeError, match="no endpoint 'nope'.*hello"):
        svc2.nope.route()
    with pytest.raises(TypeError, match="bad arguments for endpoint 'hello'"):
        svc2.hello.route(1, 2, 3)
    with pytest.raises(TypeError, match="bad arguments"):
        svc2.hello.fanout()
    with pytest.raises(UnknownSession, match="'ghost' is not open"):
        svc2.hello.route_session("ghost", 1)
    s = svc2.session()
    assert svc2.hello.route_session(s.id, 1).get(timeout=GET_S)[2] == 1
    s.close()
    with pytest.raises(UnknownSession):
        svc2.hello.route_session(s.id, 1)
    with pytest.raises(ValueError, match="num_replicas"):
        svc2.scale(-1)


def test_bad_construction_is_refused_before_any_proc_starts():
    with pytest.raises(ValueError, match="Actor subclass"):
        Service(1, 1, dict)
    with pytest.raises(TypeError, match=r"bad arguments for Echo.__init__"):
        Service(1, 1, Echo, 1, 2, 3)
    with pytest.raises(ValueError, match="max_concurrency"):
        Service(1, 1, Echo, max_concurrency=0)
    with pytest.raises(ValueError, match="not endpoints of Echo"):
        Service(1, 1, Echo, idempotent=["helo"])
    with pytest.raises(ValueError, match="unknown router 'fastest'"):
        Service(1, 1, Echo, router="fastest")
    with pytest.raises(ValueError, match=r"procs_per_replica\['gpus'\] must be an int >= 1"):
        Service({"gpus": 0}, 1, Echo)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_conurrency'"):
        Service(1, 1, Echo, max_conurrency=4)


def test_sessions_stick_to_one_replica(svc2):
    with svc2.session() as s:
        pids = {svc2.hello.route(i).get(timeout=GET_S)[1] for i in range(6)}
        assert len(pids) == 1
        assert svc2.hello.route_session(s.id, 0).get(timeout=GET_S)[1] in pids
    with pytest.raises(UnknownSession):
        svc2.hello.route_session(s.id, 0)
    # A chosen id (e.g. from an HTTP header) can be opened, joined and used explicitly.
    a = svc2.session("conversation-1")
    first = svc2.hello.route_session("conversation-1", 0).get(timeout=GET_S)[1]
    with svc2.session("conversation-1"):  # joining does not close it at exit
        assert svc2.hello.route(1).get(timeout=GET_S)[1] == first
    assert svc2.hello.route_session("conversation-1", 2).get(timeout=GET_S)[1] == first
    a.close()


def test_session_context_follows_asyncio_tasks(svc2):
    async def main() -> set[int]:
        with svc2.session():
            got = await asyncio.gather(*(svc2.hello.route(i) for i in range(4)))
        return {g[1] for g in got}

    assert len(asyncio.run(main())) == 1


def test_used_after_stop_fails_at_once():
    svc = Service(1, 1, Echo)
    svc.ready().get(timeout=60)
    assert svc.hello.route(1).get(timeout=GET_S)[2] == 1
    svc.stop().get(timeout=60)
    with pytest.raises(ServiceStopped, match="was stopped"):
        svc.hello.route(1)
    with pytest.raises(ServiceStopped):
        svc.hello.fanout(1)
    with pytest.raises(ServiceStopped):
        svc.session()
    with pytest.raises(ServiceStopped):
        svc.scale(2)
    assert svc.stop().get(timeout=5) is None, "stop is idempotent"


def test_overload_is_refused_at_once_and_queues_drain(tmp_path):
    flag = tmp_path / "open"
    svc = Service(1, 2, FileGate, str(flag), max_concurrency=1, max_queue=2, router="least_loaded")
    try:
        svc.ready().get(timeout=60)
        admitted = [svc.wait.route(i) for i in range(6)]  # 2 replicas x (1 running + 2 queued)
        assert svc.capacity() == 6
        m = svc.metrics()
        assert (m.in_flight, m.queued) == (2, 4)
        assert [(r.in_flight, r.queued) for r in m.replicas] == [(1, 2), (1, 2)], "least-loaded spreads the load"
        with pytest.raises(ServiceOverloaded, match="every replica has 1 requests in flight and 2 queued"):
            svc.wait.route(99)
        assert svc.metrics().overloaded == 1
        flag.write_text("go")
        assert [f.get(timeout=GET_S) for f in admitted] == list(range(6))
        assert svc.metrics().queued == 0
    finally:
        flag.write_text("go")
        svc.stop().get(timeout=60)


def test_stop_fails_queued_requests_and_frees_procs(tmp_path):
    flag = tmp_path / "open"
    svc = Service(1, 1, FileGate, str(flag), max_concurrency=1, max_queue=5)
    svc.ready().get(timeout=60)
    pid = svc.replicas()[0].mesh.pid.call_one().get(timeout=GET_S)
    running = svc.wait.route(0)
    queued = [svc.wait.route(i) for i in range(1, 4)]
    wait_for(lambda: svc.metrics().in_flight == 1)
    stopping = svc.stop(drain_timeout_s=0.5)
    for f in queued:
        with pytest.raises(ServiceStopped, match="before this queued request ran"):
            f.get(timeout=GET_S)
    stopping.get(timeout=60)
    with pytest.raises(Exception, match="may or may not have run"):
        running.get(timeout=GET_S)
    wait_for(lambda: not _alive(pid), timeout=15)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_scale_up_and_down_drains_before_stopping(tmp_path):
    flag = tmp_path / "open"
    svc = Service(1, 1, FileGate, str(flag), max_concurrency=2, max_queue=10)
    try:
        svc.ready().get(timeout=60)
        svc.scale(3).get(timeout=60)
        assert [r.state for r in svc.replicas()] == ["healthy"] * 3
        pids = {r.slot: r.mesh.pid.call_one().get(timeout=GET_S) for r in svc.replicas()}
        in_flight = [svc.wait.route(i) for i in range(6)]  # two on each replica
        wait_for(lambda: svc.metrics().in_flight == 6)
        shrink = svc.scale(1)
        assert [r.state for r in svc.replicas()] == ["healthy", "draining", "draining"]
        assert svc.capacity() == 12, "replicas draining away do not count"
        assert not shrink.done(), "draining replicas wait for their requests in flight"
        flag.write_text("go")
        assert [f.get(timeout=GET_S) for f in in_flight] == list(range(6)), "drained requests completed"
        shrink.get(timeout=60)
        assert [r.slot for r in svc.replicas()] == [0]
        wait_for(lambda: not _alive(pids[1]) and not _alive(pids[2]), timeout=15)
        assert svc.wait.route(7).get(timeout=GET_S) == 7
    finally:
        flag.write_text("go")
        svc.stop().get(timeout=60)


def test_a_new_replica_takes_the_backlog_queued_elsewhere_but_not_a_sessions(tmp_path):
    flag = tmp_path / "open"
    svc = Service(1, 1, FileGate, str(flag), max_concurrency=1, max_queue=8)
    try:
        svc.ready().get(timeout=60)
        with svc.session():
            bound = [svc.wait.route(i) for i in range(2)]  # bound to replica 0 by the session
        free = [svc.wait.route(i) for i in range(2, 4)]
        wait_for(lambda: svc.metrics().queued == 3)
        svc.scale(3).get(timeout=60)
        # each new replica took one request that may run anywhere; the session's stays on replica 0
        wait_for(lambda: [(r.in_flight, r.queued) for r in svc.metrics().replicas] == [(1, 1), (1, 0), (1, 0)])
        flag.write_text("go")
        assert [f.get(timeout=GET_S) for f in bound + free] == [0, 1, 2, 3]
    finally:
        flag.write_text("go")
        svc.stop().get(timeout=60)


def test_multi_proc_replica_rank0_by_default_or_all_members():
    svc = Service({"gpus": 2}, 2, Echo, name="tp", all_members=["set_weights"])
    try:
        svc.ready().get(timeout=60)
        assert [svc.rank.route().get(timeout=GET_S) for _ in range(4)] == [0, 0, 0, 0]
        assert len(svc.replicas()[0].mesh) == 2
        pids = svc.set_weights.fanout(5).get(timeout=GET_S)  # to every member; rank 0's pid returned
        per_replica = [r.mesh.get_weights.call().get(timeout=GET_S).values() for r in svc.replicas()]
        assert per_replica == [[5, 5], [5, 5]], "all_members endpoints reach every rank"
        rank0 = [r.mesh.pid.call().get(timeout=GET_S).values()[0] for r in svc.replicas()]
        assert sorted(pids) == sorted(rank0)
    finally:
        svc.stop().get(timeout=60)


def test_init_failure_fails_ready_with_the_cause():
    svc = Service(1, 1, BadInit)
    try:
        with pytest.raises(ServiceError, match="replica 0 of service BadInit failed to start") as info:
            svc.ready().get(timeout=60)
        assert "no model file" in str(info.value.__cause__)
        with pytest.raises(Exception, match="no replica that can take requests"):
            svc.ping.route()
    finally:
        svc.stop().get(timeout=60)


def test_decorator_defaults_and_overrides():
    svc = Service.deploy(Marked, num_replicas=1)
    try:
        svc.ready().get(timeout=60)
        assert len(svc.replicas()) == 1 and svc._core.spec.max_queue == 3
        assert isinstance(svc._core.router, RoundRobin)
    finally:
        svc.stop().get(timeout=60)


class _Last(Router):
    def pick(self, replicas, endpoint):
        return replicas[-1]


def test_custom_router_and_concurrent_callers():
    svc = Service(1, 2, Echo, router=_Last())
    errors: list[BaseException] = []
    seen: Counter[int] = Counter()
    lock = threading.Lock()

    def caller(k: int) -> None:
        try:
            for i in range(20):
                pid = svc.hello.route(k * 100 + i).get(timeout=GET_S)[1]
                with lock:
                    seen[pid] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        svc.ready().get(timeout=60)
        threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(GET_S)
        assert not errors and sum(seen.values()) == 80
        assert len(seen) == 1, "the custom router always picked the last replica"
    finally:
        svc.stop().get(timeout=60)


def test_asyncio_usage_end_to_end():
    async def main() -> list[int]:
        async with Service(1, 2, Echo, "a") as svc:
            await svc.ready()
            got = await asyncio.gather(*(svc.hello.route(i) for i in range(5)))
            await svc.set_weights.fanout(3)
            return [g[2] for g in got] + [await svc.get_weights.route()]

    assert asyncio.run(main()) == [0, 1, 2, 3, 4, 3]


def test_streaming_through_a_port_argument(svc2):
    port, receiver = Channel.open()
    assert svc2.stream.route(5, port).get(timeout=GET_S) == 5
    assert [receiver.recv().get(timeout=GET_S) for _ in range(5)] == [0, 1, 2, 3, 4]
    receiver.close()


def test_requests_before_ready_queue_on_starting_replicas(tmp_path):
    gate = tmp_path / "init-may-finish"
    svc = Service(1, 1, SlowInit, str(gate), max_queue=2)
    try:
        early = [svc.hello.route(i) for i in range(2)]  # queued while the replica starts
        with pytest.raises(ServiceOverloaded, match="no replica up yet"):
            svc.hello.route(9)
        assert not svc.ready().done()
        gate.write_text("go")
        svc.ready().get(timeout=60)
        assert [f.get(timeout=GET_S) for f in early] == [0, 1]
    finally:
        gate.write_text("go")
        svc.stop().get(timeout=60)


def test_scaling_down_before_start_and_stopping_mid_scale_end_every_wait(tmp_path):
    gate = tmp_path / "init-may-finish"
    svc = Service(1, 3, SlowInit, str(gate))
    try:
        svc.scale(1)  # two of the three are still starting: they are dropped
        assert len(svc.replicas()) == 1
        gate.write_text("go")
        svc.ready().get(timeout=60)
        grow = svc.scale(2)
    finally:
        gate.write_text("go")
        svc.stop().get(timeout=60)
    grow.exception(timeout=10)  # done (either way) once the service is stopped: nothing waits forever
