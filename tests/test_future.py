"""``Future`` semantics (MONARCH_API.md §1.2) on real calls.

A pending future is made deterministically with a ``Gate`` actor that lives in
this process (``this_proc()``) and blocks on a ``threading.Event`` the test
sets; results from worker processes are checked too.
"""

from __future__ import annotations

import asyncio
import math
import threading
import warnings

import pytest

from actormesh.actor import Actor, ActorError, Future, endpoint, this_proc

T = 15


@pytest.fixture(autouse=True)
def _no_unhandled_faults(faults):  # type: ignore[no-untyped-def]
    """Nothing in these tests should reach ``unhandled_fault_hook``."""
    yield
    assert faults.failures == [], f"unexpected unhandled supervision events: {faults.failures}"

# Gate events by key; the Gate actor runs in this process, so it sees this dict.
_EVENTS: dict[str, threading.Event] = {}


class Gate(Actor):
    @endpoint
    def wait(self, key: str, value: object) -> object:
        if not _EVENTS[key].wait(10):
            raise RuntimeError(f"gate {key} never opened")
        if isinstance(value, BaseException):
            raise value
        return value


class Remote(Actor):
    @endpoint
    def square(self, x: int) -> int:
        return x * x

    @endpoint
    def boom(self) -> None:
        raise ZeroDivisionError("remote boom")


@pytest.fixture
def gate():
    """``(mesh, open)``: ``mesh.wait.call_one(key, v)`` returns ``v`` once ``open(key)`` is called."""
    mesh = this_proc().spawn("gate", Gate)
    keys: list[str] = []

    def new_key() -> str:
        key = f"k{len(_EVENTS)}-{id(keys)}"
        _EVENTS[key] = threading.Event()
        keys.append(key)
        return key

    yield mesh, new_key
    for k in keys:  # never leave the actor blocked
        _EVENTS[k].set()
    mesh.stop().get(timeout=T)


def test_future_is_not_user_constructible():
    with pytest.raises(TypeError):
        Future()


def test_get_returns_value_and_is_idempotent(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    r = procs.spawn("r", Remote)
    fut = r.square.call_one(7)
    assert fut.get(timeout=T) == 49
    assert fut.get(timeout=T) == 49
    assert fut.get() == 49
    assert fut.result(timeout=T) == 49
    assert fut.result() == 49
    assert fut.exception(timeout=T) is None


def test_exception_is_cached_and_reraised(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    r = procs.spawn("r", Remote)
    fut = r.boom.call_one()
    with pytest.raises(ZeroDivisionError, match="remote boom") as first:
        fut.get(timeout=T)
    with pytest.raises(ZeroDivisionError) as second:
        fut.get(timeout=T)
    assert first.value is second.value
    assert isinstance(first.value, ActorError)
    exc = fut.exception(timeout=T)
    assert exc is first.value
    with pytest.raises(ZeroDivisionError):
        fut.result(timeout=T)


def test_get_timeout_raises_and_does_not_cancel(gate):
    mesh, new_key = gate
    key = new_key()
    fut = mesh.wait.call_one(key, "late value")
    with pytest.raises(TimeoutError):
        fut.get(timeout=0.05)
    with pytest.raises(TimeoutError):
        fut.get(timeout=0)
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.01)
    with pytest.raises(TimeoutError):
        fut.exception(timeout=0.01)
    _EVENTS[key].set()
    assert fut.get(timeout=T) == "late value"
    assert fut.exception(timeout=T) is None


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, math.inf, -math.inf])
def test_invalid_timeouts_are_value_errors(gate, bad):
    mesh, new_key = gate
    key = new_key()
    fut = mesh.wait.call_one(key, 1)
    with pytest.raises(ValueError):
        fut.get(timeout=bad)
    _EVENTS[key].set()
    assert fut.get(timeout=T) == 1
    # also on a completed future
    with pytest.raises(ValueError):
        fut.get(timeout=bad)


def test_await_inside_asyncio(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    r = procs.spawn("r", Remote)

    async def main() -> tuple[object, ...]:
        fut = r.slice(gpus=0).square.call_one(5)
        first = await fut
        again = await fut  # non-consuming
        vm = await r.square.call(3)
        both = await asyncio.gather(r.slice(gpus=0).square.call_one(2), r.slice(gpus=1).square.call_one(4))
        with pytest.raises(ZeroDivisionError):
            await r.slice(gpus=1).boom.call_one()
        return first, again, vm.values(), both

    first, again, values, both = asyncio.run(asyncio.wait_for(main(), timeout=T))
    assert (first, again, values, list(both)) == (25, 25, [9, 9], [4, 16])


def test_await_pending_future_completes_when_value_arrives(gate):
    mesh, new_key = gate
    key = new_key()
    fut = mesh.wait.call_one(key, "awaited")

    async def main() -> object:
        waiter = asyncio.ensure_future(_await(fut))
        await asyncio.sleep(0)
        assert not waiter.done()
        # cancelling one observer does not cancel the operation
        other = asyncio.ensure_future(_await(fut))
        await asyncio.sleep(0)
        other.cancel()
        _EVENTS[key].set()
        return await asyncio.wait_for(waiter, timeout=T)

    assert asyncio.run(main()) == "awaited"
    assert fut.get(timeout=T) == "awaited"


async def _await(fut: Future) -> object:
    return await fut


def test_get_inside_running_loop_warns(gate):
    mesh, new_key = gate
    key = new_key()
    fut = mesh.wait.call_one(key, 11)

    async def main() -> object:
        with pytest.warns(UserWarning, match="event loop"):
            with pytest.raises(TimeoutError):
                fut.get(timeout=0.01)
        _EVENTS[key].set()
        return await fut

    assert asyncio.run(main()) == 11


def test_get_outside_loop_does_not_warn(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    r = procs.spawn("r", Remote)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert r.square.call_one(3).get(timeout=T) == 9


def test_await_without_running_loop_is_an_error(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    r = procs.spawn("r", Remote)
    fut = r.square.call_one(2)
    with pytest.raises((ValueError, RuntimeError)):
        fut.__await__().send(None)
    with pytest.raises(RuntimeError):
        fut.as_asyncio()
    assert fut.get(timeout=T) == 4  # not consumed


def test_many_threads_waiting_on_one_future(gate):
    mesh, new_key = gate
    key = new_key()
    fut = mesh.wait.call_one(key, "shared")
    results: list[object] = []
    lock = threading.Lock()

    def waiter() -> None:
        v = fut.get(timeout=T)
        with lock:
            results.append(v)

    threads = [threading.Thread(target=waiter) for _ in range(8)]
    for t in threads:
        t.start()
    _EVENTS[key].set()
    for t in threads:
        t.join(T)
    assert results == ["shared"] * 8


def test_exception_raised_by_gated_call(gate):
    mesh, new_key = gate
    key = new_key()
    fut = mesh.wait.call_one(key, KeyError("gated error"))
    with pytest.raises(TimeoutError):
        fut.exception(timeout=0.01)
    _EVENTS[key].set()
    exc = fut.exception(timeout=T)
    assert isinstance(exc, KeyError)
    assert "gated error" in str(exc)


def test_enable_transport_before_and_after_start():
    from actormesh.actor import enable_transport
    from actormesh.runtime import current_runtime

    rt = current_runtime()
    enable_transport("unix" if rt.transport == "unix" else "tcp")  # same: no-op
    with pytest.raises(RuntimeError, match="already runs"):
        enable_transport("tcp" if rt.transport == "unix" else "ipc")
    with pytest.raises(ValueError):
        enable_transport("carrier-pigeon")
