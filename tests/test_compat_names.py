"""Monarch 0.7.0 names of ``monarch.actor`` that actormesh adds for compatibility:
Uid, ProcId, ChannelTransport (+ enable_transport), returns_future."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import pickle
import subprocess
import sys
import threading
import warnings

import pytest

import actormesh.actor as am
from actormesh.actor import ChannelTransport, Future, ProcId, Uid, enable_transport, returns_future

# monarch.actor.__all__ in torchmonarch 0.7.0, less the tools issue's debug_controller;
# see docs/compat.md (get_meter, span, traced: tests/test_telemetry.py).
MONARCH_ACTOR_NAMES = """Accumulator Actor ActorError current_actor_name as_endpoint current_rank current_size
concurrent_endpoint endpoint Future Point ProcMesh ProcId Channel send shutdown_context ValueMesh
get_or_spawn_controller this_host this_proc default_bootstrap_cmd HostMesh context Port PortReceiver Endpoint
Extent run_worker_loop_forever attach_to_workers enable_transport Context ChannelTransport unhandled_fault_hook
MeshFailure config Uid returns_future get_meter span traced start_worker_loop_forever run_worker_loop_until_shutdown attach""".split()


def test_monarch_actor_names_exist_and_are_exported() -> None:
    missing = [n for n in MONARCH_ACTOR_NAMES if not hasattr(am, n)]
    assert missing == []
    assert set(MONARCH_ACTOR_NAMES) <= set(am.__all__)


# -- Uid / ProcId ---------------------------------------------------------------------------


def test_uid_forms_match_monarch() -> None:
    u = Uid.instance_from_value(12, "service")
    assert str(u) == "service<d>"  # base58, Flickr alphabet, as Monarch writes it
    assert (u.label, u.is_instance, u.is_singleton, u.instance_value) == ("service", True, False, 12)
    s = Uid.from_string("service")
    assert (s.is_singleton, s.is_instance, s.label, s.instance_value) == (True, False, "service", None)
    assert Uid.from_string("service<2>").instance_value == 1
    anon = Uid.anonymous()
    assert anon.label is None and str(anon).startswith("<") and anon != Uid.anonymous()
    assert Uid.instance("x").label == "x"
    assert Uid.from_string(str(u)) == u and hash(Uid.from_string(str(u))) == hash(u)
    assert pickle.loads(pickle.dumps(u)) == u


def test_proc_id_round_trips() -> None:
    first = ProcId(Uid.instance_from_value(12, "service"))
    second = ProcId(Uid.instance_from_value(13, "service"))
    assert first != second and first.label == "service" and first.uid.is_instance
    assert ProcId.from_string(str(first)) == first
    assert pickle.loads(pickle.dumps(first)) == first
    assert str(ProcId.from_string("service<2>")) == "service<2>"


@pytest.mark.parametrize("text", ["", "a<", "<>", "a b", "a<0>", "x<" + "z" * 20 + ">"])
def test_bad_uid_strings_raise_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="invalid uid"):
        Uid.from_string(text)


def test_uid_and_proc_id_argument_checks() -> None:
    with pytest.raises(TypeError, match="Uid.anonymous"):
        Uid("a", 1)
    with pytest.raises(TypeError, match="needs a Uid"):
        ProcId("service")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
        Uid.instance_from_value(-1)
    with pytest.raises(ValueError, match="label"):
        Uid.instance("has space")
    with pytest.raises(TypeError, match="needs a str"):
        Uid.from_string(3)  # type: ignore[arg-type]


# -- ChannelTransport / enable_transport -------------------------------------------------------


@pytest.mark.parametrize(
    ("transport", "error", "match"),
    [
        (ChannelTransport.Local, ValueError, "in-process"),
        (ChannelTransport.MetaTlsWithHostname, ValueError, "Meta-internal"),
        ("metatls", ValueError, "Meta-internal"),
        ("tcp://127.0.0.1:8080", ValueError, "bind_host"),
        ("carrier-pigeon", ValueError, "unknown transport"),
        (3, TypeError, "ChannelTransport or a string"),
    ],
)
def test_enable_transport_refuses_what_actormesh_cannot_run(transport: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        enable_transport(transport)


_TRANSPORT = """
import sys
from actormesh.actor import ChannelTransport, enable_transport, this_host, this_proc
enable_transport(getattr(ChannelTransport, sys.argv[1]))
enable_transport(getattr(ChannelTransport, sys.argv[1]))   # the same again: a no-op
procs = this_host().spawn_procs(per_host={"g": 1})
procs.initialized.get(timeout=60)
print(procs._addresses[0].split(":")[0])
try:
    enable_transport("unix" if sys.argv[1] != "Unix" else "tcp")
except RuntimeError as exc:
    print("refused")
procs.stop().get(timeout=30)
"""


@pytest.mark.parametrize(("member", "scheme"), [("TcpWithHostname", "tcp"), ("Unix", "unix")])
def test_enable_transport_accepts_the_enum(member: str, scheme: str) -> None:
    out = subprocess.run([sys.executable, "-c", _TRANSPORT, member], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [scheme, "refused"]


# -- returns_future ----------------------------------------------------------------------------


def test_returns_future_needs_an_async_function() -> None:
    with pytest.raises(TypeError, match="async function"):
        returns_future(lambda: 1)  # type: ignore[arg-type]


def test_calling_does_not_start_the_body_and_get_runs_it_on_the_calling_thread() -> None:
    ran: list[int] = []

    @returns_future
    async def body(x: int) -> int:
        ran.append(threading.get_ident())
        await asyncio.sleep(0)
        return x + 1

    fut = body(1)
    assert isinstance(fut, Future) and not fut.done() and ran == []
    assert fut.get(timeout=10) == 2
    assert ran == [threading.get_ident()]
    assert fut.get() == 2 and ran == [threading.get_ident()]  # cached, ran once


def test_the_body_sees_the_callers_context_variables_from_call_time() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    @returns_future
    async def read() -> str:
        value = var.get()
        var.set("changed inside")
        return value

    token = var.set("at call")
    fut = read()
    var.reset(token)
    assert fut.get(timeout=10) == "at call"
    assert var.get() == "unset"  # the body's write did not leak back


def test_await_runs_the_body_on_the_awaiting_loop_and_cancelling_one_observer_spares_it() -> None:
    release = asyncio.Event

    async def main() -> tuple[int, int]:
        gate = release()
        loops: list[asyncio.AbstractEventLoop] = []

        @returns_future
        async def body() -> int:
            loops.append(asyncio.get_running_loop())
            await gate.wait()
            return 7

        fut = body()
        first = asyncio.ensure_future(fut.as_asyncio())
        second = asyncio.ensure_future(fut.as_asyncio())
        await asyncio.sleep(0)
        first.cancel()
        gate.set()
        value = await second
        assert loops == [asyncio.get_running_loop()]
        return value, await fut

    assert asyncio.run(main()) == (7, 7)


def test_get_timeout_cancels_the_body_and_every_observer_sees_timeout_error() -> None:
    cancelled = threading.Event()

    @returns_future
    async def slow() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    fut = slow()
    with pytest.raises(TimeoutError, match="cancelled"):
        fut.get(timeout=0.05)
    assert cancelled.is_set()
    with pytest.raises(TimeoutError):
        fut.get(timeout=1)
    with pytest.raises(ValueError, match="timeout"):
        slow().get(timeout=-1)


def test_get_inside_a_running_loop_runs_the_body_on_a_helper_thread() -> None:
    threads: list[int] = []

    @returns_future
    async def body() -> str:
        threads.append(threading.get_ident())
        return "ok"

    async def main() -> str:
        return body().get(timeout=10)

    assert asyncio.run(main()) == "ok"
    assert threads and threads[0] != threading.get_ident()


def test_get_on_the_thread_whose_loop_runs_the_body_raises_instead_of_hanging() -> None:
    async def main() -> None:
        gate = asyncio.Event()

        @returns_future
        async def body() -> int:
            await gate.wait()
            return 1

        fut = body()
        waiter = asyncio.ensure_future(fut.as_asyncio())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="use `await fut`"):
            fut.get(timeout=5)
        gate.set()
        assert await waiter == 1

    asyncio.run(main())


def test_an_unobserved_future_closes_its_body_unstarted() -> None:
    ran: list[bool] = []

    @returns_future
    async def body() -> None:
        ran.append(True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fut = body()
        del fut
        gc.collect()
    assert ran == []
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []  # closed, not leaked


def test_errors_of_the_body_reach_every_observer() -> None:
    @returns_future
    async def boom() -> None:
        raise KeyError("k")

    fut = boom()
    with pytest.raises(KeyError):
        fut.get(timeout=10)
    assert isinstance(fut.exception(), KeyError)


def test_the_body_can_await_actor_calls() -> None:
    from actormesh.actor import Actor, endpoint, this_proc

    class Add(Actor):
        @endpoint
        def add(self, a: int, b: int) -> int:
            return a + b

    adder = this_proc().spawn("adder", Add)

    @returns_future
    async def total() -> int:
        return await adder.add.call_one(1, 2) + await adder.add.call_one(3, 4)

    assert total().get(timeout=30) == 10
    adder.stop().get(timeout=10)
