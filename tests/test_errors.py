"""Errors with real processes: remote exceptions, serialization failures,
actors that die (broadcast errors, ``__init__``, process exit, SIGKILL), and
supervision by an actor that owns the failed mesh.

Semantics: MONARCH_API.md §1.1 (errors, serialization), §1.7 (scenario table),
DESIGN.md §5.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import psutil
import pytest

from actormesh.actor import (
    Actor,
    ActorError,
    MeshFailure,
    SupervisionError,
    context,
    endpoint,
    this_host,
)

from conftest import wait_for

T = 20  # bound of every .get(); failures must arrive well before it
FAST = 8  # a failure must reach the caller within this many seconds


# --------------------------------------------------------------------------- helpers


class CustomError(Exception):
    """A user exception class defined in the test module."""


class TwoArgError(Exception):
    """An exception whose __init__ does not take its own ``args`` back."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code={code}: {detail}")
        self.code = code


class UnpicklableError(Exception):
    """An exception that cannot be pickled (it holds a lock)."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.lock = threading.Lock()


def deep_helper_raising_value_error(msg: str) -> None:
    raise ValueError(msg)


def deep_helper_raising_key_error(key: str) -> None:
    raise KeyError(key)


def deep_helper_raising_custom_error(msg: str) -> None:
    raise CustomError(msg)


def explode_inside_init() -> None:
    raise RuntimeError("init went wrong on purpose")


def explode_inside_broadcast(msg: str) -> None:
    raise ValueError(msg)


class Worker(Actor):
    def __init__(self) -> None:
        self.n = 0
        self.calls = 0
        self.release = threading.Event()

    @endpoint
    def incr(self) -> int:
        self.n += 1
        return self.n

    @endpoint
    def value(self) -> int:
        return self.n

    @endpoint
    def record(self, x: Any = None, **kw: Any) -> int:
        self.calls += 1
        return self.calls

    @endpoint
    def calls_seen(self) -> int:
        return self.calls

    @endpoint
    def raise_value(self, msg: str) -> None:
        deep_helper_raising_value_error(msg)

    @endpoint
    def raise_key(self, key: str) -> None:
        deep_helper_raising_key_error(key)

    @endpoint
    def raise_custom(self, msg: str) -> None:
        deep_helper_raising_custom_error(msg)

    @endpoint
    def raise_two_arg(self) -> None:
        raise TwoArgError(7, "odd constructor")

    @endpoint
    def raise_unpicklable(self) -> None:
        raise UnpicklableError("holds a lock")

    @endpoint
    def boom(self, msg: str) -> None:
        explode_inside_broadcast(msg)

    @endpoint
    def return_lock(self) -> Any:
        return threading.Lock()

    @endpoint
    def return_generator(self) -> Any:
        return (i for i in range(3))

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def exit_now(self, code: int) -> None:
        os._exit(code)

    @endpoint
    def block(self) -> str:
        # Held until the test kills the process (bounded so a broken runtime
        # cannot leave a thread behind forever).
        self.release.wait(60)
        return "released"

    @endpoint
    def system_exit(self) -> None:
        raise SystemExit(5)


class AsyncWorker(Actor):
    def __init__(self) -> None:
        self.n = 0

    @endpoint
    async def incr(self) -> int:
        self.n += 1
        return self.n

    @endpoint
    async def raise_value(self, msg: str) -> None:
        deep_helper_raising_value_error(msg)

    @endpoint
    async def boom(self, msg: str) -> None:
        explode_inside_broadcast(msg)

    @endpoint
    async def pid(self) -> int:
        return os.getpid()


class BadInit(Actor):
    def __init__(self) -> None:
        explode_inside_init()

    @endpoint
    def ping(self) -> str:
        return "pong"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    try:
        return fn(), time.monotonic() - t0
    except BaseException as exc:  # noqa: BLE001 - the caller inspects it
        return exc, time.monotonic() - t0


# --------------------------------------------------------------------------- endpoint exceptions (with a reply)


def test_exception_via_call_one_is_actor_error_with_remote_traceback(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("w", Worker)
    assert w.incr.call_one().get(timeout=T) == 1
    with pytest.raises(ActorError) as ei:
        w.raise_value.call_one("bad value 42").get(timeout=T)
    err = ei.value
    text = str(err)
    assert "deep_helper_raising_value_error" in text, text
    assert "raise_value" in text
    assert "bad value 42" in text
    assert "Traceback" in text
    assert isinstance(err.exception, ValueError)
    # The actor lives on, state intact.
    assert w.incr.call_one().get(timeout=T) == 2
    assert w.value.call_one().get(timeout=T) == 2


def test_except_value_error_catches_remote_value_error(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("w", Worker)
    try:
        w.raise_value.call_one("catch me").get(timeout=T)
    except ValueError as exc:
        assert isinstance(exc, ActorError)
        assert "catch me" in str(exc)
    else:
        pytest.fail("remote ValueError did not raise")


def test_except_key_error_catches_remote_key_error(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("w", Worker)
    with pytest.raises(KeyError) as ei:
        w.raise_key.call_one("missing-key").get(timeout=T)
    assert isinstance(ei.value, ActorError)
    assert "deep_helper_raising_key_error" in str(ei.value)
    assert "missing-key" in str(ei.value)
    assert w.incr.call_one().get(timeout=T) == 1


def test_except_custom_error_class_from_test_module(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("w", Worker)
    with pytest.raises(CustomError) as ei:
        w.raise_custom.call_one("custom trouble").get(timeout=T)
    err = ei.value
    assert isinstance(err, ActorError)
    assert isinstance(err.exception, CustomError)
    assert "deep_helper_raising_custom_error" in str(err)
    assert "custom trouble" in str(err)
    assert w.incr.call_one().get(timeout=T) == 1


def test_exception_via_call_on_every_rank(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", Worker)
    assert w.incr.call().get(timeout=T).values() == [1, 1]
    with pytest.raises(ValueError) as ei:
        w.raise_value.call("from call").get(timeout=T)
    assert isinstance(ei.value, ActorError)
    assert "deep_helper_raising_value_error" in str(ei.value)
    assert w.incr.call().get(timeout=T).values() == [2, 2]


def test_exception_via_choose(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", Worker)
    for _ in range(3):
        with pytest.raises(ValueError) as ei:
            w.raise_value.choose("from choose").get(timeout=T)
        assert isinstance(ei.value, ActorError)
        assert "deep_helper_raising_value_error" in str(ei.value)
    assert sum(w.value.call().get(timeout=T).values()) == 0
    assert w.incr.call().get(timeout=T).values() == [1, 1]


def test_exception_via_stream_surfaces_per_future(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", Worker)
    futures = list(w.raise_key.stream("streamed"))
    assert len(futures) == 2
    for fut in futures:
        with pytest.raises(KeyError) as ei:
            fut.get(timeout=T)
        assert isinstance(ei.value, ActorError)
        assert "deep_helper_raising_key_error" in str(ei.value)
    assert w.incr.call().get(timeout=T).values() == [1, 1]


def test_async_endpoint_exception_is_actor_error_and_actor_lives(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("aw", AsyncWorker)
    assert w.incr.call_one().get(timeout=T) == 1
    with pytest.raises(ValueError) as ei:
        w.raise_value.call_one("async bad").get(timeout=T)
    assert isinstance(ei.value, ActorError)
    assert "deep_helper_raising_value_error" in str(ei.value)
    assert w.incr.call_one().get(timeout=T) == 2


def test_exception_with_unusual_constructor_still_reaches_caller_as_actor_error(spawn_procs):
    """Pickle rebuilds exceptions as ``cls(*args)``; a class whose ``__init__``
    takes other arguments must not turn into a confusing caller-side TypeError."""
    procs = spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("w", Worker)
    exc, took = _timed(lambda: w.raise_two_arg.call_one().get(timeout=T))
    assert isinstance(exc, ActorError), f"expected ActorError, got {type(exc).__mro__}: {exc}"
    assert "TwoArgError" in str(exc)
    assert "odd constructor" in str(exc)
    assert took < FAST
    assert w.incr.call_one().get(timeout=T) == 1


def test_unpicklable_exception_still_reaches_caller_as_actor_error(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("w", Worker)
    exc, took = _timed(lambda: w.raise_unpicklable.call_one().get(timeout=T))
    assert isinstance(exc, ActorError), f"expected ActorError, got {exc!r}"
    assert "UnpicklableError" in str(exc)
    assert "holds a lock" in str(exc)
    assert took < FAST
    assert w.incr.call_one().get(timeout=T) == 1


class Relay(Actor):
    """Calls another actor and lets its error escape unhandled."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @endpoint
    def relay_value_error(self, msg: str) -> None:
        self.inner.raise_value.call_one(msg).get(timeout=T)

    @endpoint
    def relay_custom_error(self, msg: str) -> None:
        self.inner.raise_custom.call_one(msg).get(timeout=T)


def test_error_relayed_through_an_intermediate_actor_keeps_its_type(spawn_procs):
    """controller -> relay -> worker raises ValueError; the relay does not catch it.
    What reaches the controller is still an ActorError that ``except ValueError``
    catches, and its text names the innermost raising function."""
    procs = spawn_procs(per_host={"gpus": 2})
    inner = procs.slice(gpus=1).spawn("inner", Worker)
    relay = procs.slice(gpus=0).spawn("relay", Relay, inner)
    exc, took = _timed(lambda: relay.relay_value_error.call_one("relayed twice").get(timeout=T))
    assert isinstance(exc, ActorError), repr(exc)
    assert isinstance(exc, ValueError), f"relayed remote ValueError lost its type: {type(exc).__mro__}"
    assert "deep_helper_raising_value_error" in str(exc)
    assert "relay_value_error" in str(exc)
    assert "relayed twice" in str(exc)
    assert took < FAST
    with pytest.raises(CustomError):
        relay.relay_custom_error.call_one("custom relayed").get(timeout=T)
    assert inner.incr.call_one().get(timeout=T) == 1


# --------------------------------------------------------------------------- serialization


@pytest.mark.parametrize(
    "make_bad",
    [lambda: threading.Lock(), lambda: (i for i in range(3))],
    ids=["lock", "generator"],
)
def test_unpicklable_arguments_raise_type_error_at_call_site(spawn_procs, make_bad):
    procs = spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", Worker)
    assert w.record.call().get(timeout=T).values() == [1, 1]
    one = w.slice(gpus=0)
    # Raised synchronously by the adverb itself, not by .get().
    with pytest.raises(TypeError):
        one.record.call_one(make_bad())
    with pytest.raises(TypeError):
        w.record.call(make_bad())
    with pytest.raises(TypeError):
        w.record.choose(make_bad())
    with pytest.raises(TypeError):
        w.record.stream(make_bad())
    with pytest.raises(TypeError):
        w.record.broadcast(make_bad())
    with pytest.raises(TypeError):
        w.record.call(x=1, other=make_bad())
    # Nothing was sent: no rank saw any of these calls.
    assert w.calls_seen.call().get(timeout=T).values() == [1, 1]


def test_unpicklable_return_value_is_an_error_for_the_caller_and_actor_lives(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("w", Worker)
    assert w.incr.call_one().get(timeout=T) == 1
    for ep in (w.return_lock, w.return_generator):
        exc, took = _timed(lambda: ep.call_one().get(timeout=T))
        assert isinstance(exc, (ActorError, TypeError)), repr(exc)
        assert isinstance(exc, ActorError) and isinstance(exc, TypeError), type(exc).__mro__
        assert took < FAST
    with pytest.raises(TypeError):
        w.return_lock.call().get(timeout=T)
    assert w.incr.call_one().get(timeout=T) == 2


# --------------------------------------------------------------------------- actors that die


def test_broadcast_exception_fails_the_actor_and_notifies_owner(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", Worker)
    assert w.incr.call().get(timeout=T).values() == [1, 1]
    w.slice(gpus=0).boom.broadcast("broadcast went bad")
    # A call sent after the broadcast (same sender, in order) reaches a dead actor.
    exc, took = _timed(lambda: w.slice(gpus=0).incr.call_one().get(timeout=T))
    assert isinstance(exc, SupervisionError), repr(exc)
    assert "have failed" in str(exc)
    assert took < FAST

    failures = faults.wait(1)
    assert len(failures) == 1
    failure = failures[0]
    assert isinstance(failure, MeshFailure)
    report = failure.report()
    assert "broadcast went bad" in report
    assert "explode_inside_broadcast" in report
    assert failure.crashed_ranks == [0]
    assert failure.mesh_name.startswith("w")

    # Later calls fail at once and name the failure ...
    with pytest.raises(SupervisionError, match="have failed") as ei:
        w.incr.call().get(timeout=T)
    assert "broadcast went bad" in str(ei.value)
    with pytest.raises(SupervisionError, match="have failed"):
        w.slice(gpus=0).value.call_one().get(timeout=T)
    # ... while a slice excluding the failed rank keeps working.
    assert w.slice(gpus=1).incr.call_one().get(timeout=T) == 2
    assert w.slice(gpus=slice(1, 2)).value.call().get(timeout=T).values() == [2]
    assert len(faults.failures) == 1


def test_async_broadcast_exception_fails_the_actor(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("aw", AsyncWorker)
    assert w.incr.call_one().get(timeout=T) == 1
    w.boom.broadcast("async broadcast went bad")
    failures = faults.wait(1)
    assert "async broadcast went bad" in failures[0].report()
    with pytest.raises(SupervisionError, match="have failed"):
        w.incr.call_one().get(timeout=T)


def test_system_exit_in_endpoint_fails_the_actor(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("w", Worker)
    exc, took = _timed(lambda: w.system_exit.call_one().get(timeout=T))
    assert isinstance(exc, SupervisionError), repr(exc)
    assert took < FAST
    faults.wait(1)
    with pytest.raises(SupervisionError):
        w.incr.call_one().get(timeout=T)


def test_init_exception_fails_calls_with_init_traceback_and_notifies_owner(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 2})
    procs.initialized.get(timeout=T)  # time the failure's path, not the procs' start
    bad = procs.spawn("bad", BadInit)
    exc, took = _timed(lambda: bad.ping.call().get(timeout=T))
    assert isinstance(exc, SupervisionError), repr(exc)
    text = str(exc)
    assert "have failed" in text
    assert "__init__" in text
    assert "explode_inside_init" in text
    assert "init went wrong on purpose" in text
    assert took < FAST
    failures = faults.wait(2)
    assert sorted(r for f in failures for r in f.crashed_ranks) == [0, 1]
    assert all("init went wrong on purpose" in f.report() for f in failures)
    with pytest.raises(SupervisionError, match="explode_inside_init"):
        bad.slice(gpus=1).ping.call_one().get(timeout=T)
    # The procs themselves are fine: a new actor works there.
    w = procs.spawn("w", Worker)
    assert w.incr.call().get(timeout=T).values() == [1, 1]


def test_process_exit_fails_pending_and_later_calls(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", Worker)
    assert w.incr.call().get(timeout=T).values() == [1, 1]
    doomed = w.slice(gpus=0)
    t0 = time.monotonic()
    die = doomed.exit_now.call_one(3)
    pending = doomed.incr.call_one()  # queued behind exit_now: never runs
    pending_call = w.value.call()
    for fut in (die, pending, pending_call):
        with pytest.raises(SupervisionError) as ei:
            fut.get(timeout=T)
        assert "exited with non-zero code 3" in str(ei.value), str(ei.value)
        assert "have failed" in str(ei.value)
    assert time.monotonic() - t0 < FAST

    failures = faults.wait(1)
    assert any("exited with non-zero code 3" in f.report() for f in failures)
    exc, took = _timed(lambda: w.incr.call().get(timeout=T))
    assert isinstance(exc, SupervisionError) and "exited with non-zero code 3" in str(exc), repr(exc)
    assert took < 1.0
    assert w.slice(gpus=1).incr.call_one().get(timeout=T) == 2


def test_sigkilled_process_fails_pending_and_later_calls(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", Worker)
    pids = w.pid.call().get(timeout=T).values()
    victim = w.slice(gpus=1)
    blocked = victim.block.call_one()
    queued = victim.incr.call_one()
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    for fut in (blocked, queued):
        with pytest.raises(SupervisionError) as ei:
            fut.get(timeout=T)
        assert "Killed(sig=9)" in str(ei.value), str(ei.value)
    assert time.monotonic() - t0 < FAST
    failures = faults.wait(1)
    assert any("Killed(sig=9)" in f.report() for f in failures)
    with pytest.raises(SupervisionError, match=r"Killed\(sig=9\)"):
        victim.incr.call_one().get(timeout=T)
    with pytest.raises(SupervisionError, match=r"Killed\(sig=9\)"):
        w.incr.call().get(timeout=T)
    assert w.slice(gpus=0).incr.call_one().get(timeout=T) == 1


def test_sigkilled_async_actor_process_fails_calls(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("aw", AsyncWorker)
    pid = w.pid.call_one().get(timeout=T)
    os.kill(pid, signal.SIGKILL)
    exc, took = _timed(lambda: w.incr.call_one().get(timeout=T))
    assert isinstance(exc, SupervisionError) and "Killed(sig=9)" in str(exc), repr(exc)
    assert took < FAST
    faults.wait(1)


def test_spawning_on_a_proc_whose_process_died_fails_clearly(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    w = procs.spawn("w", Worker)
    pid = w.pid.call_one().get(timeout=T)
    os.kill(pid, signal.SIGKILL)
    faults.wait(1)
    exc, took = _timed(lambda: procs.spawn("again", Worker).incr.call_one().get(timeout=T))
    assert isinstance(exc, (SupervisionError, RuntimeError)), repr(exc)
    assert took < FAST


# --------------------------------------------------------------------------- supervision by an actor owner


class Child(Actor):
    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def boom(self, msg: str) -> None:
        explode_inside_broadcast(msg)

    @endpoint
    def exit_now(self, code: int) -> None:
        os._exit(code)


class Parent(Actor):
    def __init__(self, handle: bool) -> None:
        self.handle = handle
        self.failures: list[str] = []
        self.child: Any = None
        self.child_name = ""

    @endpoint
    def spawn_child(self, where: str) -> str:
        if where == "host":
            procs = this_host().spawn_procs(per_host={"gpus": 1})
        else:
            procs = context().actor_instance.proc
        self.child = procs.spawn("child", Child)
        self.child_name = self.child._name
        return self.child.ping.call_one().get(timeout=T)

    @endpoint
    def crash_child(self, msg: str) -> None:
        self.child.boom.broadcast(msg)

    @endpoint
    def kill_child_process(self) -> None:
        self.child.exit_now.broadcast(4)

    @endpoint
    def failures_seen(self) -> list[str]:
        return list(self.failures)

    @endpoint
    def alive(self) -> str:
        return "alive"

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.failures.append(f"{failure.mesh_name}|{failure.report()}")
        return self.handle


class AsyncParent(Actor):
    """Like Parent, with async endpoints and an async ``__supervise__``."""

    def __init__(self, handle: bool) -> None:
        self.handle = handle
        self.failures: list[str] = []
        self.child: Any = None

    @endpoint
    async def spawn_child(self, where: str) -> str:
        procs = this_host().spawn_procs(per_host={"gpus": 1}) if where == "host" else context().actor_instance.proc
        self.child = procs.spawn("child", Child)
        return await self.child.ping.call_one()

    @endpoint
    async def crash_child(self, msg: str) -> None:
        self.child.boom.broadcast(msg)

    @endpoint
    async def failures_seen(self) -> list[str]:
        return list(self.failures)

    @endpoint
    async def alive(self) -> str:
        return "alive"

    async def __supervise__(self, failure: MeshFailure) -> bool:
        self.failures.append(f"{failure.mesh_name}|{failure.report()}")
        return self.handle


def test_async_actor_owner_handles_child_failure(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    parent = procs.spawn("aparent", AsyncParent, True)
    assert parent.spawn_child.call_one("host").get(timeout=T) == "pong"
    parent.crash_child.call_one("async child broke").get(timeout=T)
    seen = wait_for(lambda: parent.failures_seen.call_one().get(timeout=T))
    assert len(seen) == 1 and "async child broke" in seen[0]
    assert parent.alive.call_one().get(timeout=T) == "alive"
    assert faults.failures == []


def test_async_actor_owner_not_handling_fails_and_reaches_controller(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    parent = procs.spawn("aparent", AsyncParent, False)
    assert parent.spawn_child.call_one("own_proc").get(timeout=T) == "pong"
    parent.crash_child.call_one("async child broke, unhandled").get(timeout=T)
    failures = faults.wait(1)
    assert failures[0].mesh_name.startswith("aparent")
    assert "async child broke, unhandled" in failures[0].report()
    with pytest.raises(SupervisionError, match="have failed"):
        parent.alive.call_one().get(timeout=T)


@pytest.mark.parametrize("where", ["host", "own_proc"])
def test_actor_owner_handles_child_failure_in_supervise(spawn_procs, faults, where):
    procs = spawn_procs(per_host={"gpus": 1})
    parent = procs.spawn("parent", Parent, True)
    assert parent.spawn_child.call_one(where).get(timeout=T) == "pong"
    parent.crash_child.call_one("child broke").get(timeout=T)
    seen = wait_for(lambda: parent.failures_seen.call_one().get(timeout=T))
    assert len(seen) == 1
    assert "child broke" in seen[0]
    assert seen[0].startswith("child")
    # Handled: the parent keeps working and the controller's hook is not called.
    assert parent.alive.call_one().get(timeout=T) == "alive"
    assert parent.failures_seen.call_one().get(timeout=T) == seen
    assert faults.failures == []


def test_actor_owner_sees_child_process_death(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    parent = procs.spawn("parent", Parent, True)
    assert parent.spawn_child.call_one("host").get(timeout=T) == "pong"
    parent.kill_child_process.call_one().get(timeout=T)
    seen = wait_for(lambda: parent.failures_seen.call_one().get(timeout=T))
    assert any("exited with non-zero code 4" in s for s in seen), seen
    assert parent.alive.call_one().get(timeout=T) == "alive"
    assert faults.failures == []


@pytest.mark.parametrize("where", ["host", "own_proc"])
def test_unhandled_child_failure_fails_the_parent_and_reaches_controller(spawn_procs, faults, where):
    procs = spawn_procs(per_host={"gpus": 1})
    parent = procs.spawn("parent", Parent, False)
    assert parent.spawn_child.call_one(where).get(timeout=T) == "pong"
    parent.crash_child.call_one("child broke, nobody handles it").get(timeout=T)
    failures = faults.wait(1)
    assert len(failures) == 1
    failure = failures[0]
    assert failure.mesh_name.startswith("parent")
    assert "child broke, nobody handles it" in failure.report()
    with pytest.raises(SupervisionError, match="have failed"):
        parent.alive.call_one().get(timeout=T)


# --------------------------------------------------------------------------- the default fault hook


UNHANDLED_CONTROLLER = textwrap.dedent(
    """
    import os, sys, time
    from actormesh.actor import Actor, endpoint, this_host

    class W(Actor):
        @endpoint
        def pid(self):
            return os.getpid()

        @endpoint
        def boom(self):
            raise ValueError("nobody handles this boom")

        @endpoint
        def slow(self):
            time.sleep(40)
            return "slow done"

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", W)
    print(" ".join(str(p) for p in w.pid.call().get(timeout=30).values()), flush=True)
    w.slice(gpus=0).boom.broadcast()
    # The main thread is busy waiting on a healthy actor, as controllers usually are.
    print(w.slice(gpus=1).slow.call_one().get(), flush=True)
    """
)


def test_default_fault_hook_ends_a_controller_blocked_in_get(tmp_path):
    """MONARCH_API.md §1.7.1: an unhandled failure at the root prints the report and
    ends the program (KeyboardInterrupt in the main thread), even while the main
    thread waits in ``Future.get()`` for something else."""
    script = tmp_path / "controller.py"
    script.write_text(UNHANDLED_CONTROLLER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        pids = [int(x) for x in line.split()]
        assert len(pids) == 2, line
        t0 = time.monotonic()
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("the controller was still running 15 s after an unhandled failure")
        took = time.monotonic() - t0
        assert proc.returncode != 0
        assert "slow done" not in out
        assert "Unhandled actormesh error" in err, err
        assert "nobody handles this boom" in err
        assert took < 10.0, f"controller took {took:.1f}s to end"
        for pid in pids:
            wait_for(lambda pid=pid: _gone(pid), timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def test_a_child_whose_connection_closed_fails_messages_with_its_exit_status_not_connection_lost():
    """Regression: messages sent between a child's socket closing and its exit status
    arriving failed with "connection lost" instead of the exit code (a race seen in CI)."""
    from actormesh.runtime import current_runtime

    rt = current_runtime()
    address = "unix:/nonexistent/child.sock"
    route = rt.expect_child(address)
    undelivered: list[str] = []

    class FakeConn:
        tag = address

    def scenario() -> None:
        route.conn = FakeConn()  # type: ignore[assignment]
        original = rt.undeliverable
        rt.undeliverable = lambda env, addr, reason: undelivered.append(reason)  # type: ignore[method-assign]
        try:
            rt._on_close(route.conn, None)  # the socket closes first...
            route.send(("probe",), [b"x"])  # ...a message is sent before the spawner saw the exit...
            assert route.dead is None and not undelivered
            rt.peer_gone(address, "the process exited with non-zero code 3", expected=True)  # ...then the status
        finally:
            rt.undeliverable = original  # type: ignore[method-assign]
            rt._routes.pop(address, None)

    done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def on_loop() -> None:
        try:
            done.set_result(scenario())
        except BaseException as exc:
            done.set_exception(exc)

    rt.loop.call_soon_threadsafe(on_loop)
    done.result(timeout=10)
    assert undelivered == ["the process exited with non-zero code 3"]
