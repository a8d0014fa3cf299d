"""One behaviour suite, run over both transports and both kinds of actor.

The guarantees a user relies on (every adverb, per-sender order, errors that
reach the caller and leave the actor serving, payloads intact at every size,
ports, a dead proc failing calls at once) are written once here and run:

- with sync and with async actors: the ``actor`` fixture is parametrized
  (same endpoints, ``def`` or ``async def``);
- over Unix sockets (this process's default) and over TCP on loopback:
  ``test_the_suite_over_tcp`` runs this same file in a fresh controller with
  ``ACTORMESH_DEFAULT_TRANSPORT=tcp`` (the transport is fixed when a
  controller's runtime starts, so it cannot change inside this process).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import module_procs

from actormesh.actor import Actor, ActorError, Channel, SupervisionError, current_rank, endpoint
from actormesh.config import get_config
from actormesh.runtime import current_runtime

T = 30  # bound of every wait


class SyncWorker(Actor):
    def __init__(self, start: int = 0) -> None:
        self.n = start
        self.seen: list[int] = []

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n

    @endpoint
    def value(self) -> int:
        return self.n

    @endpoint
    def record(self, i: int) -> None:
        self.seen.append(i)

    @endpoint
    def recorded(self) -> list[int]:
        return self.seen

    @endpoint
    def echo(self, x: Any) -> Any:
        return x

    @endpoint
    def fail(self, message: str) -> None:
        raise ValueError(message)

    @endpoint
    def rank(self) -> int:
        return current_rank().rank

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def count_to(self, port: Any, n: int) -> None:
        for i in range(n):
            port.send(i)


class AsyncWorker(Actor):
    def __init__(self, start: int = 0) -> None:
        self.n = start
        self.seen: list[int] = []

    @endpoint
    async def incr(self, by: int = 1) -> int:
        await asyncio.sleep(0)  # a real suspension point: the next message must still wait for this one
        self.n += by
        return self.n

    @endpoint
    async def value(self) -> int:
        return self.n

    @endpoint
    async def record(self, i: int) -> None:
        await asyncio.sleep(0)
        self.seen.append(i)

    @endpoint
    async def recorded(self) -> list[int]:
        return self.seen

    @endpoint
    async def echo(self, x: Any) -> Any:
        return x

    @endpoint
    async def fail(self, message: str) -> None:
        raise ValueError(message)

    @endpoint
    async def rank(self) -> int:
        return current_rank().rank

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def count_to(self, port: Any, n: int) -> None:
        for i in range(n):
            port.send(i)


@pytest.fixture(scope="module")
def procs() -> Iterator[Any]:
    yield from module_procs({"gpus": 2})


_names = itertools.count()


@pytest.fixture(params=[SyncWorker, AsyncWorker], ids=["sync", "async"])
def actor(request: pytest.FixtureRequest, procs: Any) -> Iterator[Any]:
    mesh = procs.spawn(f"worker{next(_names)}", request.param, 10)
    yield mesh
    mesh.stop().get(timeout=T)


def test_every_adverb(actor: Any) -> None:
    one = actor.slice(gpus=0)
    assert one.incr.call_one(5).get(timeout=T) == 15
    values = actor.value.call().get(timeout=T)
    assert sorted(v for _, v in values.items()) == [10, 15]
    assert sorted(actor.rank.call().get(timeout=T).values()) == [0, 1]
    actor.incr.broadcast(1)
    assert sorted(actor.value.call().get(timeout=T).values()) == [11, 16]  # a broadcast is delivered before what follows it
    assert actor.value.choose().get(timeout=T) in (11, 16)
    streamed = sorted(f.get(timeout=T) for f in actor.value.stream())
    assert streamed == [11, 16]


def test_messages_from_one_sender_arrive_in_order(actor: Any) -> None:
    one = actor.slice(gpus=1)
    for i in range(300):
        one.record.broadcast(i)
    futures = [one.incr.call_one(1) for _ in range(50)]
    assert one.recorded.call_one().get(timeout=T) == list(range(300))
    assert [f.get(timeout=T) for f in futures] == list(range(11, 61))


def test_a_burst_goes_in_batches_and_keeps_its_order(actor: Any) -> None:
    """A busy connection carries small calls and replies in batches (runtime/_routes.py):
    order holds inside them and around the large calls that cannot join one."""
    one = actor.slice(gpus=0)
    rt = current_runtime()
    batched = rt.messages_batched()
    big = bytes(64 << 10)
    futures = []
    for i in range(2000):
        futures.append(one.incr.call_one(1))
        if i % 400 == 200:
            futures.append(one.echo.call_one(big))
    got = [f.get(timeout=T) for f in futures]
    assert [g for g in got if type(g) is int] == list(range(11, 2011))
    assert [len(g) for g in got if type(g) is bytes] == [len(big)] * 5
    assert rt.messages_batched() > batched


def test_callers_on_several_threads_each_keep_their_order(actor: Any) -> None:
    """Threads of one process share the route and its batches: nothing is lost, and each
    thread's calls arrive in the order it made them."""
    import threading

    one = actor.slice(gpus=1)
    n, per = 4, 500
    futures: list[list[Any]] = [[] for _ in range(n)]

    def caller(t: int) -> None:
        futures[t] = [one.record.call_one(t * per + i) for i in range(per)]

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=T)
    assert not any(th.is_alive() for th in threads)
    for fs in futures:
        for f in fs:
            f.get(timeout=T)
    seen = one.recorded.call_one().get(timeout=T)
    assert sorted(seen) == list(range(n * per))
    for t in range(n):
        assert [i for i in seen if i // per == t] == list(range(t * per, (t + 1) * per))


def test_errors_reach_the_caller_and_the_actor_serves_on(actor: Any) -> None:
    one = actor.slice(gpus=0)
    with pytest.raises(ActorError, match="no such thing") as info:
        one.fail.call_one("no such thing").get(timeout=T)
    assert isinstance(info.value.exception, ValueError)
    assert one.incr.call_one(1).get(timeout=T) == 11
    with pytest.raises(TypeError, match="incr"):
        one.incr.call_one(1, 2, 3)  # wrong arguments fail at the caller, before anything is sent
    assert one.value.call_one().get(timeout=T) == 11


@pytest.mark.parametrize("size", [0, 1, 255, 64 << 10, (1 << 20) + 7, 8 << 20])
def test_payloads_arrive_intact(actor: Any, size: int) -> None:
    one = actor.slice(gpus=1)
    payload = os.urandom(size)
    assert one.echo.call_one(payload).get(timeout=T) == payload
    mixed = {"bytes": payload, "array": bytearray(payload[: size // 2]), "list": list(range(100)), "text": "é" * 7}
    assert one.echo.call_one(mixed).get(timeout=T) == mixed


def test_tensors_arrive_intact(actor: Any) -> None:
    torch = pytest.importorskip("torch")
    one = actor.slice(gpus=0)
    for t in (torch.arange(10.0), torch.randn(513, 1025), torch.zeros(0, 3), torch.randn(64, 64)[:, ::2]):
        back = one.echo.call_one(t).get(timeout=T)
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_a_port_streams_back_in_order(actor: Any) -> None:
    one = actor.slice(gpus=1)
    port, receiver = Channel.open()
    one.count_to.call_one(port, 200).get(timeout=T)
    assert [receiver.recv().get(timeout=T) for _ in range(200)] == list(range(200))


def test_a_killed_proc_fails_calls_at_once(spawn_procs: Any, faults: Any) -> None:
    for cls in (SyncWorker, AsyncWorker):
        pm = spawn_procs(per_host={"gpus": 1})
        w = pm.spawn("doomed", cls)
        pid = w.pid.call_one().get(timeout=T)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(SupervisionError):
            w.incr.call_one(1).get(timeout=T)  # fails through supervision, long before the deadline


def test_the_transport_is_the_one_asked_for(procs: Any) -> None:
    want = os.environ.get("BEHAVIOUR_TRANSPORT", get_config().default_transport)
    assert get_config().default_transport == want
    assert current_runtime().address.startswith(f"{want}:")


@pytest.mark.timeout(300)
def test_the_suite_over_tcp() -> None:
    if get_config().default_transport == "tcp":
        pytest.skip("this run is the TCP one")
    env = dict(os.environ, ACTORMESH_DEFAULT_TRANSPORT="tcp", ACTORMESH_BIND_HOST="127.0.0.1", BEHAVIOUR_TRANSPORT="tcp")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider", __file__, "-k", "not over_tcp"],
        cwd=Path(__file__).parent.parent, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, f"the suite failed over TCP:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert " passed" in done.stdout and " skipped" not in done.stdout, done.stdout[-2000:]
