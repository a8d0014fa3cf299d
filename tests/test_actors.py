"""Actors and endpoints with real processes: defining, spawning, checking,
execution model (one message at a time, concurrent endpoints, FIFO), code and
data that travel to workers (local classes, lambdas, tensors, arrays), and
``actormesh.config``.

Semantics: MONARCH_API.md §1.1, §2.1, §1.14.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from actormesh.actor import (
    Actor,
    ActorError,
    Point,
    concurrent_endpoint,
    context,
    endpoint,
    this_host,
    this_proc,
)

T = 15  # every .get() is bounded by this many seconds


@pytest.fixture(autouse=True)
def _no_unhandled_faults(faults):  # type: ignore[no-untyped-def]
    """Nothing in these tests should reach ``unhandled_fault_hook``."""
    yield
    assert faults.failures == [], f"unexpected unhandled supervision events: {faults.failures}"


# --------------------------------------------------------------------------- actors


class Counter(Actor):
    def __init__(self, start: int, *, step: int = 1) -> None:
        self.n = start
        self.step = step

    @endpoint
    def incr(self) -> int:
        self.n += self.step
        return self.n

    @endpoint
    def value(self) -> int:
        return self.n

    @endpoint
    def add(self, a: int, b: int = 0) -> int:
        self.n += a + b
        return self.n

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def rank(self) -> dict[str, int]:
        return dict(context().actor_instance.rank)

    @endpoint
    def fail(self, msg: str) -> None:
        raise ValueError(msg)

    def helper(self) -> int:  # not an endpoint
        return 42


class AsyncCounter(Actor):
    def __init__(self, start: int = 0) -> None:
        self.n = start

    @endpoint
    async def incr(self, by: int = 1) -> int:
        await asyncio.sleep(0)
        self.n += by
        return self.n

    @endpoint
    async def loop_running(self) -> bool:
        return asyncio.get_running_loop().is_running()


class EnvReader(Actor):
    def __init__(self) -> None:
        self.seen = os.environ.get("ACTORMESH_TEST_BOOT")
        self.seen_async = os.environ.get("ACTORMESH_TEST_ABOOT")

    @endpoint
    def seen_at_init(self) -> tuple[str | None, str | None]:
        return self.seen, self.seen_async


class Recorder(Actor):
    """Collects whatever it is told, in arrival order."""

    def __init__(self) -> None:
        self.items: list[object] = []

    @endpoint
    def push(self, x: object) -> None:
        self.items.append(x)

    @endpoint
    def items_so_far(self) -> list[object]:
        return list(self.items)


class Serial(Actor):
    """Async endpoints that yield inside: they must still never overlap."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    @endpoint
    async def work(self, i: int) -> int:
        self.events.append(("enter", i))
        for _ in range(5):
            await asyncio.sleep(0.002)
        self.events.append(("exit", i))
        return i

    @endpoint
    async def log(self) -> list[tuple[str, int]]:
        return list(self.events)


class Handshake(Actor):
    """Two concurrent calls that can only both finish if they overlap."""

    def __init__(self) -> None:
        self.arrived = {0: asyncio.Event(), 1: asyncio.Event()}

    @concurrent_endpoint
    async def meet(self, me: int) -> str:
        self.arrived[me].set()
        try:
            await asyncio.wait_for(self.arrived[1 - me].wait(), timeout=8)
        except asyncio.TimeoutError:
            return f"{me}: peer never arrived (calls did not overlap)"
        return f"{me}: met"


class Echo(Actor):
    @endpoint
    def echo(self, x: object) -> object:
        return x

    @endpoint
    def apply(self, fn, x):  # type: ignore[no-untyped-def]
        return fn(x)

    @endpoint
    def describe_tensor(self, t):  # type: ignore[no-untyped-def]
        return str(t.dtype), tuple(t.shape), t.is_contiguous()


# --------------------------------------------------------------------------- basics


def test_counter_sync_endpoints_with_init_args(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    counters = procs.spawn("counters", Counter, 10, step=5)
    vm = counters.incr.call().get(timeout=T)
    assert vm.values() == [15, 15]
    assert counters.incr.call().get(timeout=T).values() == [20, 20]
    assert counters.add.call(1, b=2).get(timeout=T).values() == [23, 23]
    assert counters.slice(gpus=1).value.call_one().get(timeout=T) == 23


def test_async_endpoints_run_on_an_event_loop(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    counters = procs.spawn("acounters", AsyncCounter, 3)
    assert counters.incr.call(by=4).get(timeout=T).values() == [7, 7]
    assert counters.loop_running.call().get(timeout=T).values() == [True, True]


def test_actors_run_in_separate_worker_processes(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 4})
    counters = procs.spawn("counters", Counter, 0)
    pids = counters.pid.call().get(timeout=T).values()
    assert len(set(pids)) == 4
    assert os.getpid() not in pids
    assert counters.rank.call().get(timeout=T).values() == [{"gpus": i} for i in range(4)]


def test_two_dimensional_proc_mesh(spawn_procs):
    procs = spawn_procs(per_host={"replica": 2, "gpus": 2})
    assert dict(procs.extent) == {"replica": 2, "gpus": 2}
    assert procs.size() == 4
    counters = procs.spawn("counters", Counter, 0)
    vm = counters.rank.call().get(timeout=T)
    assert dict(vm.extent) == {"replica": 2, "gpus": 2}
    assert vm.item(replica=1, gpus=0) == {"replica": 1, "gpus": 0}
    assert [p for p, _ in vm.items()] == [Point(i, vm.extent) for i in range(4)]
    assert len(set(counters.pid.call().get(timeout=T).values())) == 4


def test_this_proc_spawn_runs_in_the_controller_process():
    local = this_proc().spawn("local_counter", Counter, 7)
    try:
        assert local.pid.call_one().get(timeout=T) == os.getpid()
        assert local.incr.call_one().get(timeout=T) == 8
        assert local.incr.call().get(timeout=T).values() == [9]
    finally:
        local.stop().get(timeout=T)


def test_this_proc_async_actor_runs_in_controller_process():
    local = this_proc().spawn("local_async", AsyncCounter, 1)
    try:
        assert local.incr.call_one(by=2).get(timeout=T) == 3
    finally:
        local.stop().get(timeout=T)


def test_remote_exception_is_actor_error_matching_original_type_and_actor_survives(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    c = procs.spawn("c", Counter, 0)
    with pytest.raises(ValueError, match="boom-123") as info:
        c.fail.call_one("boom-123").get(timeout=T)
    assert isinstance(info.value, ActorError)
    assert isinstance(info.value.exception, ValueError)
    # the actor keeps serving after an endpoint raised
    assert c.incr.call_one().get(timeout=T) == 1


class TwoArgError(Exception):
    """An exception whose constructor does not take its message (a common pattern)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code={code} detail={detail}")
        self.code = code
        self.detail = detail


class Awkward(Actor):
    @endpoint
    def unpicklable_result(self) -> object:
        return threading.Lock()

    @endpoint
    def raise_two_arg(self) -> None:
        raise TwoArgError(7, "disk full")

    @endpoint
    def ok(self) -> str:
        return "ok"


def test_unpicklable_result_is_actor_error_and_actor_survives(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    a = procs.spawn("a", Awkward)
    with pytest.raises(ActorError) as info:
        a.unpicklable_result.call_one().get(timeout=T)
    assert isinstance(info.value, TypeError)
    assert a.ok.call_one().get(timeout=T) == "ok"


def test_exception_with_custom_constructor_reaches_caller_as_actor_error(spawn_procs):
    """Whatever the exception class, the caller gets an ActorError carrying the remote error text."""
    procs = spawn_procs(per_host={"gpus": 1})
    a = procs.spawn("a", Awkward)
    with pytest.raises(ActorError) as info:
        a.raise_two_arg.call_one().get(timeout=T)
    text = str(info.value)
    assert "TwoArgError" in text and "disk full" in text
    assert a.ok.call_one().get(timeout=T) == "ok"


# --------------------------------------------------------------------------- bootstrap


def _sync_boot() -> None:
    os.environ["ACTORMESH_TEST_BOOT"] = f"boot-{os.getpid()}"


async def _async_boot() -> None:
    await asyncio.sleep(0)
    os.environ["ACTORMESH_TEST_ABOOT"] = "async-boot"


def _failing_boot() -> None:
    raise RuntimeError("bootstrap exploded on purpose")


def test_bootstrap_runs_on_every_proc_before_any_actor(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2}, bootstrap=_sync_boot)
    readers = procs.spawn("readers", EnvReader)
    seen = readers.seen_at_init.call().get(timeout=T).values()
    pids = procs.spawn("pids", Counter, 0).pid.call().get(timeout=T).values()
    assert [s for s, _ in seen] == [f"boot-{pid}" for pid in pids]
    assert os.environ.get("ACTORMESH_TEST_BOOT") is None  # ran in the workers, not here


def test_async_bootstrap_is_awaited(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2}, bootstrap=_async_boot)
    readers = procs.spawn("readers", EnvReader)
    assert [a for _, a in readers.seen_at_init.call().get(timeout=T).values()] == ["async-boot"] * 2


def test_bootstrap_closure_defined_in_test_is_shipped_by_value(spawn_procs):
    token = f"closure-{os.urandom(4).hex()}"

    def boot() -> None:
        os.environ["ACTORMESH_TEST_BOOT"] = token

    procs = spawn_procs(per_host={"gpus": 1}, bootstrap=boot)
    readers = procs.spawn("readers", EnvReader)
    assert readers.seen_at_init.call_one().get(timeout=T)[0] == token


def test_bootstrap_closure_capturing_a_large_array(spawn_procs):
    """A bootstrap closure may capture any picklable value, big buffers included."""
    data = np.arange(64 * 1024, dtype=np.int64)  # 512 KiB: travels out of band

    def boot() -> None:
        os.environ["ACTORMESH_TEST_BOOT"] = str(int(data.sum()))

    procs = spawn_procs(per_host={"gpus": 1}, bootstrap=boot)
    procs.initialized.get(timeout=T)
    readers = procs.spawn("readers", EnvReader)
    assert readers.seen_at_init.call_one().get(timeout=T)[0] == str(int(data.sum()))


def test_failing_bootstrap_gives_a_clear_error_not_a_hang(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2}, bootstrap=_failing_boot)
    with pytest.raises(Exception, match="bootstrap exploded on purpose") as info:
        procs.initialized.get(timeout=T)
    assert not isinstance(info.value, TimeoutError)
    # Spawning and calling on such procs fails too, rather than waiting forever.
    with pytest.raises(Exception) as call_info:
        procs.spawn("c", Counter, 0).value.call().get(timeout=T)
    assert not isinstance(call_info.value, TimeoutError)


def test_spawn_procs_without_per_host_is_one_proc(spawn_procs):
    procs = spawn_procs()
    assert procs.size() == 1 and dict(procs.extent) == {}
    c = procs.spawn("c", Counter, 1)
    assert c.incr.call_one().get(timeout=T) == 2
    assert c.pid.call_one().get(timeout=T) != os.getpid()


@pytest.mark.parametrize("per_host", [{"gpus": 0}, {"gpus": -1}, {"gpus": 1.5}, {"gpus": True}])
def test_spawn_procs_rejects_bad_sizes(per_host):
    with pytest.raises((ValueError, TypeError)):
        this_host().spawn_procs(per_host=per_host)


def test_bootstrap_must_be_callable():
    with pytest.raises(TypeError):
        this_host().spawn_procs(per_host={"gpus": 1}, bootstrap=42)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- checks at the call site


def test_spawn_checks_init_arguments_at_call_site(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    with pytest.raises(TypeError):
        procs.spawn("c", Counter)  # missing start
    with pytest.raises(TypeError):
        procs.spawn("c", Counter, 1, 2)  # step is keyword-only
    with pytest.raises(TypeError):
        procs.spawn("c", Counter, 1, nope=3)
    with pytest.raises(TypeError):
        procs.spawn("e", Echo, 1)  # no __init__: takes no arguments


def test_endpoint_arguments_checked_at_call_site_for_every_adverb(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    c = procs.spawn("c", Counter, 0)
    with pytest.raises(TypeError, match="missing a required argument: 'a'"):
        c.add.call()
    with pytest.raises(TypeError):
        c.add.call(1, 2, 3)
    with pytest.raises(TypeError):
        c.add.broadcast(1, c=3)
    with pytest.raises(TypeError):
        c.slice(gpus=0).add.call_one()
    with pytest.raises(TypeError):
        c.add.choose(x=1)
    with pytest.raises(TypeError):
        c.add.stream()
    with pytest.raises(TypeError):
        c.value.call(1)
    # nothing was delivered by the rejected calls
    assert c.value.call().get(timeout=T).values() == [0, 0]


def test_unpicklable_argument_is_type_error_at_call_site(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    e = procs.spawn("e", Echo)
    with pytest.raises(TypeError):
        e.echo.call_one(threading.Lock())
    assert e.echo.call_one(5).get(timeout=T) == 5


def test_spawning_a_non_actor_class_is_value_error(spawn_procs):
    class NotAnActor:
        @endpoint
        def x(self) -> int:
            return 1

    procs = spawn_procs(per_host={"gpus": 1})
    with pytest.raises(ValueError, match="must subclass"):
        procs.spawn("bad", NotAnActor)
    with pytest.raises(ValueError):
        procs.spawn("bad", object)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        this_proc().spawn("bad", NotAnActor)


@pytest.mark.parametrize("name", ["stop", "slice", "initialized", "rename", "size"])
def test_endpoint_name_colliding_with_mesh_attribute_is_value_error(spawn_procs, name):
    def method(self):  # type: ignore[no-untyped-def]
        return 1

    method.__name__ = name
    Bad = type(f"Bad_{name}", (Actor,), {name: endpoint(method)})
    procs = spawn_procs(per_host={"gpus": 1})
    with pytest.raises(ValueError, match="collides with an endpoint name") as info:
        procs.spawn("bad", Bad)
    assert name in str(info.value)


def test_class_mixing_sync_and_async_endpoints_is_value_error(spawn_procs):
    class Mixed(Actor):
        @endpoint
        def a(self) -> int:
            return 1

        @endpoint
        async def b(self) -> int:
            return 2

    procs = spawn_procs(per_host={"gpus": 1})
    with pytest.raises(ValueError, match="sync and async"):
        procs.spawn("mixed", Mixed)
    with pytest.raises(ValueError):
        this_proc().spawn("mixed", Mixed)


def test_concurrent_endpoint_requires_async_def():
    with pytest.raises(TypeError):

        class Bad(Actor):
            @concurrent_endpoint
            def f(self) -> None:  # sync: refused
                pass

    with pytest.raises(TypeError):

        class Stacked(Actor):
            @concurrent_endpoint
            @endpoint
            async def f(self) -> None:
                pass


def test_plain_method_on_mesh_is_not_an_endpoint(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    c = procs.spawn("c", Counter, 0)
    with pytest.raises(RuntimeError, match="not annotated as an endpoint"):
        c.helper.call()
    with pytest.raises(AttributeError):
        c.no_such_endpoint


def test_duplicate_actor_names_on_one_proc_mesh_are_independent(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    a = procs.spawn("same", Counter, 0)
    b = procs.spawn("same", Counter, 100)
    assert a.incr.call_one().get(timeout=T) == 1
    assert b.incr.call_one().get(timeout=T) == 101
    assert a.value.call_one().get(timeout=T) == 1


class Base(Actor):
    def __init__(self) -> None:
        self.init_rank = dict(context().actor_instance.rank)

    @endpoint
    def who(self) -> str:
        return "base"

    @endpoint
    def init_rank_seen(self) -> dict[str, int]:
        return self.init_rank

    @endpoint(explicit_response_port=True)
    def count_to(self, port, n: int) -> None:  # type: ignore[no-untyped-def]
        for i in range(n):
            port.send(i)


class Derived(Base):
    @endpoint
    def who(self) -> str:
        return "derived"

    @endpoint(instrument=False)
    def extra(self, x: int = 1) -> int:
        return x * 2


def test_inherited_and_overridden_endpoints_and_endpoint_options(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    d = procs.spawn("d", Derived)
    assert d.who.call().get(timeout=T).values() == ["derived", "derived"]
    assert d.extra.call(x=4).get(timeout=T).values() == [8, 8]
    assert d.extra.call().get(timeout=T).values() == [2, 2]
    # context() works in __init__ and gives the spawn rank
    assert d.init_rank_seen.call().get(timeout=T).values() == [{"gpus": 0}, {"gpus": 1}]
    # explicit response port: call_one gets the first value sent
    assert d.slice(gpus=1).count_to.call_one(3).get(timeout=T) == 0
    with pytest.raises(TypeError):
        d.count_to.call()  # n missing (the port is not the caller's to pass)


# --------------------------------------------------------------------------- execution model


def test_async_endpoints_are_serialized_per_actor(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    s = procs.spawn("serial", Serial)
    futs = [s.work.call_one(i) for i in range(4)]
    assert [f.get(timeout=T) for f in futs] == [0, 1, 2, 3]
    events = s.log.call_one().get(timeout=T)
    expected = [e for i in range(4) for e in (("enter", i), ("exit", i))]
    assert events == expected


class SyncSerial(Actor):
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.busy = False
        self.overlaps = 0

    @endpoint
    def work(self, who: str) -> None:
        if self.busy:
            self.overlaps += 1
        self.busy = True
        self.events.append(("enter", who))
        threading.Event().wait(0.001)  # widen any overlap window (not used for synchronisation)
        self.events.append(("exit", who))
        self.busy = False

    @endpoint
    def report(self) -> tuple[int, list[tuple[str, str]]]:
        return self.overlaps, list(self.events)


class Sender(Actor):
    @endpoint
    def hammer(self, target, who: str, n: int) -> None:  # type: ignore[no-untyped-def]
        futs = [target.work.call_one(who) for _ in range(n)]
        for f in futs:
            f.get(timeout=T)


def test_sync_actor_handles_one_message_at_a_time_across_senders(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 3})
    target = procs.slice(gpus=0).spawn("target", SyncSerial)
    senders = procs.slice(gpus=slice(1, 3)).spawn("senders", Sender)
    a = senders.slice(gpus=0).hammer.call_one(target, "a", 30)
    b = senders.slice(gpus=1).hammer.call_one(target, "b", 30)
    mine = [target.work.call_one("c") for _ in range(30)]
    a.get(timeout=T)
    b.get(timeout=T)
    for f in mine:
        f.get(timeout=T)
    overlaps, events = target.report.call_one().get(timeout=T)
    assert overlaps == 0
    assert len(events) == 180
    for i in range(0, 180, 2):  # every enter is immediately followed by its own exit
        assert events[i][0] == "enter" and events[i + 1] == ("exit", events[i][1])
    # per-sender FIFO holds even though senders interleave
    for who in "abc":
        assert [e for e in events if e[1] == who] == [("enter", who), ("exit", who)] * 30


def test_concurrent_endpoint_calls_overlap():
    """Each call waits for the other to have started: only possible if they overlap."""
    local = this_proc().spawn("handshake", Handshake)
    try:
        f0 = local.meet.call_one(0)
        f1 = local.meet.call_one(1)
        assert (f0.get(timeout=T), f1.get(timeout=T)) == ("0: met", "1: met")
    finally:
        local.stop().get(timeout=T)


def test_concurrent_endpoint_calls_overlap_in_a_worker(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    h = procs.spawn("handshake", Handshake)
    f0 = h.meet.call_one(0)
    f1 = h.meet.call_one(1)
    assert (f0.get(timeout=T), f1.get(timeout=T)) == ("0: met", "1: met")


def test_messages_from_one_sender_arrive_in_send_order(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    r = procs.spawn("recorder", Recorder)
    for i in range(200):
        r.push.broadcast(i)
    got = r.items_so_far.call().get(timeout=T).values()
    assert got == [list(range(200))] * 2


def test_mixed_adverbs_keep_send_order(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    r = procs.spawn("recorder", Recorder)
    r.push.broadcast("b0")
    f = r.slice(gpus=1).push.call_one("c1")
    r.push.broadcast("b2")
    r.slice(gpus=0).push.broadcast("b3")
    r.push.call("c4")  # not waited for: the next call still sees it
    got = r.items_so_far.call().get(timeout=T)
    f.get(timeout=T)
    assert got.item(gpus=0) == ["b0", "b2", "b3", "c4"]
    assert got.item(gpus=1) == ["b0", "c1", "b2", "c4"]


# --------------------------------------------------------------------------- code that travels


def test_class_defined_inside_a_test_function_works_in_workers(spawn_procs):
    offset = 1000

    class Local(Actor):
        def __init__(self, base: int) -> None:
            self.base = base

        @endpoint
        def compute(self, x: int) -> int:
            return self.base + x + offset

        @endpoint
        def where(self) -> int:
            return os.getpid()

    procs = spawn_procs(per_host={"gpus": 2})
    m = procs.spawn("local", Local, 5)
    assert m.compute.call(1).get(timeout=T).values() == [1006, 1006]
    assert os.getpid() not in m.where.call().get(timeout=T).values()


def test_lambda_and_local_function_arguments(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    e = procs.spawn("echo", Echo)
    k = 3
    assert e.apply.call(lambda x: x * k, 7).get(timeout=T).values() == [21, 21]

    def shout(s: str) -> str:
        return s.upper() + "!"

    assert e.slice(gpus=0).apply.call_one(shout, "hi").get(timeout=T) == "HI!"
    # a lambda can also come back as a result
    fn = e.slice(gpus=1).echo.call_one(lambda y: y + k).get(timeout=T)
    assert fn(1) == 4


def test_module_level_function_and_class_instances_roundtrip(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    e = procs.spawn("echo", Echo)
    assert e.apply.call_one(_double, 21).get(timeout=T) == 42
    p = e.echo.call_one(_Pair(1, "x")).get(timeout=T)
    assert isinstance(p, _Pair) and (p.a, p.b) == (1, "x")


def _double(x: int) -> int:
    return 2 * x


class _Pair:
    def __init__(self, a: object, b: object) -> None:
        self.a, self.b = a, b


# --------------------------------------------------------------------------- tensors and arrays


def _assert_same_tensor(a, b):  # type: ignore[no-untyped-def]
    import torch

    assert isinstance(b, torch.Tensor)
    assert b.dtype == a.dtype
    assert tuple(b.shape) == tuple(a.shape)
    assert torch.equal(a, b)


def test_tensors_roundtrip_exactly(spawn_procs):
    import torch

    procs = spawn_procs(per_host={"gpus": 1})
    e = procs.spawn("echo", Echo)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=g)
    cases = {
        "float32": base,
        "int64": torch.arange(1000, dtype=torch.int64).reshape(10, 100),
        "bfloat16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "float16": torch.randn(5, generator=g).half(),
        "bool": torch.tensor([True, False, True]),
        "non_contiguous": base.t()[::2],
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "uint8_big": torch.randint(0, 255, (4 * 1024 * 1024,), dtype=torch.uint8, generator=g),
    }
    assert not cases["non_contiguous"].is_contiguous()
    back = e.echo.call_one(cases).get(timeout=T)
    assert set(back) == set(cases)
    for name, t in cases.items():
        _assert_same_tensor(t, back[name])
    # the actor sees the same dtype/shape
    assert e.describe_tensor.call_one(cases["bfloat16"]).get(timeout=T) == ("torch.bfloat16", (33, 17), True)
    assert e.describe_tensor.call_one(cases["non_contiguous"]).get(timeout=T)[:2] == ("torch.float32", (24, 64))
    # results are independent copies: mutating what came back does not touch the original
    back["float32"].add_(1)
    assert not torch.equal(back["float32"], base)
    # autograd flags and Parameters survive the trip
    t = torch.ones(3, requires_grad=True)
    p = torch.nn.Parameter(torch.zeros(2, 2))
    bt, bp = e.echo.call_one((t, p)).get(timeout=T)
    assert bt.requires_grad and torch.equal(bt.detach(), t.detach())
    assert isinstance(bp, torch.nn.Parameter) and torch.equal(bp.detach(), p.detach())


def test_numpy_arrays_roundtrip_exactly(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    e = procs.spawn("echo", Echo)
    rng = np.random.default_rng(0)
    cases = [
        rng.standard_normal((4, 5)).astype(np.float32),
        np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2],  # non-contiguous
        np.zeros((0, 7), dtype=np.float64),
        np.array(["a", "bc"]),
        rng.integers(0, 2**31, size=(1024, 1024), dtype=np.int32),  # 4 MiB
        np.asfortranarray(rng.standard_normal((3, 4))),
    ]
    back = e.echo.call_one(cases).get(timeout=T)
    for a, b in zip(cases, back):
        assert isinstance(b, np.ndarray)
        assert b.dtype == a.dtype and b.shape == a.shape
        np.testing.assert_array_equal(a, b)
    # a 4 MiB array as a plain result from every member
    procs2 = spawn_procs(per_host={"gpus": 2})
    e2 = procs2.spawn("echo", Echo)
    big = cases[4]
    for got in e2.echo.call(big).get(timeout=T).values():
        np.testing.assert_array_equal(got, big)


class Keeper(Actor):
    """Keeps what it is sent; mutates arguments in place when asked."""

    def __init__(self) -> None:
        self.kept: object = None

    @endpoint
    def add_one_in_place(self, x):  # type: ignore[no-untyped-def]
        x += 1
        return x

    @endpoint
    def keep(self, x: object) -> None:
        self.kept = x

    @endpoint
    def kept_value(self) -> object:
        return self.kept

    @endpoint
    def echo(self, x: object) -> object:
        return x


def _value_semantics(mesh) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """What the caller and the actor see after each side mutates what it sent or got."""
    import torch

    seen: dict[str, float] = {}
    # 1. an endpoint mutating its argument does not touch the caller's object
    arr = np.zeros(1 << 20, dtype=np.uint8)  # large: goes out of band
    seen["actor's result"] = float(mesh.add_one_in_place.call_one(arr).get(timeout=T).max())
    seen["caller's array"] = float(arr.max())
    t = torch.zeros(1 << 18)
    mesh.add_one_in_place.call_one(t).get(timeout=T)
    seen["caller's tensor"] = float(t.abs().sum())
    # 2. the caller mutating an object after sending it does not change what the actor kept
    t = torch.zeros(1 << 18)
    mesh.keep.call_one(t).get(timeout=T)
    t += 5
    seen["kept after the caller's change"] = float(mesh.kept_value.call_one().get(timeout=T).abs().sum())
    # 3. the caller mutating a result does not change the actor's state
    got = mesh.kept_value.call_one().get(timeout=T)
    got += 100
    seen["kept after a change to its result"] = float(mesh.kept_value.call_one().get(timeout=T).abs().sum())
    return seen


#: Copies everywhere: only the actor's own result shows its in-place change.
_NO_ALIASES = {"actor's result": 1.0, "caller's array": 0.0, "caller's tensor": 0.0,
               "kept after the caller's change": 0.0, "kept after a change to its result": 0.0}


def test_same_process_actor_sees_copies_not_aliases():
    """Arguments and results are serialised even for actors in this process (Monarch §1.1)."""
    local = this_proc().spawn("keeper", Keeper)
    try:
        assert _value_semantics(local) == _NO_ALIASES
    finally:
        local.stop().get(timeout=T)


def test_remote_actor_sees_copies_not_aliases(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    assert _value_semantics(procs.spawn("keeper", Keeper)) == _NO_ALIASES


def test_arguments_are_captured_when_the_call_is_made_same_process():
    """Mutating a buffer right after ``call()`` returns must not change what was sent."""
    local = this_proc().spawn("keeper", Keeper)
    try:
        big = np.zeros(8 << 20, dtype=np.uint8)
        fut = local.echo.call_one(big)
        big[:] = 7  # the caller reuses its buffer at once
        assert int(fut.get(timeout=T).max()) == 0, "same-process actor saw a mutation made after call() returned"
    finally:
        local.stop().get(timeout=T)


def test_arguments_are_captured_when_the_call_is_made_remote(spawn_procs):
    """Same for worker processes: the bytes sent are those at call time."""
    procs = spawn_procs(per_host={"gpus": 2})
    remote = procs.spawn("keeper", Keeper)
    for _ in range(4):
        big = np.zeros(32 << 20, dtype=np.uint8)
        fut = remote.echo.call(big)
        big[:] = 7  # the caller reuses its buffer at once
        for got in fut.get(timeout=T).values():
            assert int(got.max()) == 0, "remote actor saw a mutation made after call() returned"


def test_large_tensor_and_array_bytes_travel_out_of_band():
    import torch

    from actormesh.transport import dumps

    arr = np.ones(4 * 1024 * 1024, dtype=np.uint8)
    t = torch.ones(1024 * 1024, dtype=torch.float32)  # 4 MiB
    for obj in (arr, t, {"x": t, "y": arr}, ((t,), 3)):
        segments = dumps(obj)
        assert len(memoryview(segments[0]).cast("B")) < 1024, type(obj)
        total = sum(memoryview(s).nbytes for s in segments)
        assert total >= 4 * 1024 * 1024


# --------------------------------------------------------------------------- config


def test_configure_rejects_unknown_keys_and_wrong_types():
    from actormesh import config

    before = config.get_config()
    with pytest.raises(ValueError):
        config.configure(no_such_key=1)
    with pytest.raises((TypeError, ValueError)):
        config.configure(stop_timeout="not a duration")
    with pytest.raises((TypeError, ValueError)):
        config.configure(use_uvloop="yes please")
    with pytest.raises((TypeError, ValueError)):
        config.configure(default_transport="carrier-pigeon")
    with pytest.raises((TypeError, ValueError)):
        config.configure(codec_max_frame_length=[1])
    with pytest.raises((TypeError, ValueError)):
        with config.configured(cleanup_timeout=-1):
            pass
    assert config.get_config() == before  # rejected settings changed nothing


def test_configured_applies_and_restores():
    from actormesh import config

    before = config.get_config()
    with config.configured(stop_timeout="1m 30s", cleanup_timeout=0.5) as cfg:
        assert cfg.stop_timeout == 90.0
        assert config.get_config().stop_timeout == 90.0
        assert config.get_config().cleanup_timeout == 0.5
        assert config.get_global_config()["stop_timeout"] == 90.0
        with config.configured(stop_timeout="500ms"):
            assert config.get_config().stop_timeout == 0.5
            assert config.get_config().cleanup_timeout == 0.5
        assert config.get_config().stop_timeout == 90.0
    assert config.get_config() == before


def test_configured_restores_on_exception():
    from actormesh import config

    before = config.get_config()
    with pytest.raises(KeyError):
        with config.configured(connect_timeout=2):
            assert config.get_config().connect_timeout == 2.0
            raise KeyError("x")
    assert config.get_config() == before


def test_configure_persists_until_cleared():
    from actormesh import config

    before = config.get_config()
    try:
        config.configure(message_delivery_timeout="2s")
        assert config.get_config().message_delivery_timeout == 2.0
    finally:
        config.clear_runtime_config()
    assert config.get_config() == before


class ConfigReader(Actor):
    @endpoint
    def settings(self) -> tuple[float, float]:
        from actormesh.config import get_config

        cfg = get_config()
        return cfg.cleanup_timeout, cfg.message_delivery_timeout


def test_configuration_is_pushed_to_spawned_procs(spawn_procs):
    from actormesh import config

    with config.configured(cleanup_timeout=1.5, message_delivery_timeout="2m"):
        procs = spawn_procs(per_host={"gpus": 1})
    plain = spawn_procs()
    assert procs.spawn("r", ConfigReader).settings.call_one().get(timeout=T) == (1.5, 120.0)
    expected = (config.get_config().cleanup_timeout, config.get_config().message_delivery_timeout)
    assert plain.spawn("r", ConfigReader).settings.call_one().get(timeout=T) == expected


def _config_in_subprocess(env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORMESH_")}
    env.update(env_extra)
    code = (
        "import json, dataclasses\n"
        "from actormesh.config import get_config\n"
        "print(json.dumps(dataclasses.asdict(get_config())))\n"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)


def test_env_variables_override_defaults():
    proc = _config_in_subprocess(
        {"ACTORMESH_STOP_TIMEOUT": "45s", "ACTORMESH_DEFAULT_TRANSPORT": "tcp", "ACTORMESH_USE_UVLOOP": "false", "ACTORMESH_CODEC_MAX_FRAME_LENGTH": "1048576"}
    )
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)
    assert cfg["stop_timeout"] == 45.0
    assert cfg["default_transport"] == "tcp"
    assert cfg["use_uvloop"] is False
    assert cfg["codec_max_frame_length"] == 1048576
    assert math.isclose(cfg["cleanup_timeout"], 3.0)  # untouched keys keep their defaults


def test_bad_env_variable_is_reported():
    proc = _config_in_subprocess({"ACTORMESH_STOP_TIMEOUT": "forever"})
    assert proc.returncode != 0
    assert "stop_timeout" in proc.stderr
