"""References that travel: actor meshes, slices and ports passed to other actors,
and ``get_or_spawn_controller`` singletons.

Semantics: MONARCH_API.md §1.1 (passing references), §1.5 (ports and channels),
§1.6 (get_or_spawn_controller).
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import uuid
from typing import Any

import pytest

from actormesh.actor import (
    Actor,
    ActorError,
    SupervisionError,
    Channel,
    Port,
    PortReceiver,
    context,
    endpoint,
    get_or_spawn_controller,
)

T = 20  # bound of every .get()


class Target(Actor):
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.n = 0

    @endpoint
    def whoami(self) -> tuple[str, dict[str, int], int]:
        return self.tag, dict(context().actor_instance.rank), os.getpid()

    @endpoint
    def incr(self) -> int:
        self.n += 1
        return self.n

    @endpoint
    def fail(self, msg: str) -> None:
        raise ValueError(msg)


class Holder(Actor):
    """Sync actor holding a mesh reference from ``__init__``."""

    def __init__(self, target: Any) -> None:
        self.target = target

    @endpoint
    def call_held(self) -> list[Any]:
        return self.target.whoami.call().get(timeout=T).values()

    @endpoint
    def call_given(self, other: Any) -> list[Any]:
        return other.whoami.call().get(timeout=T).values()

    @endpoint
    def call_one_given(self, other: Any) -> Any:
        return other.whoami.call_one().get(timeout=T)

    @endpoint
    def incr_given(self, other: Any) -> list[int]:
        return other.incr.call().get(timeout=T).values()

    @endpoint
    def try_stop(self, other: Any) -> None:
        other.stop()

    @endpoint
    def broadcast_to(self, other: Any, msg: str) -> None:
        other.fail.broadcast(msg)

    @endpoint
    def alive(self) -> str:
        return "alive"


class AsyncHolder(Actor):
    """Async actor awaiting calls on mesh references."""

    def __init__(self, target: Any) -> None:
        self.target = target

    @endpoint
    async def call_held(self) -> list[Any]:
        vm = await self.target.whoami.call()
        return vm.values()

    @endpoint
    async def call_given(self, other: Any) -> list[Any]:
        return (await other.whoami.call()).values()

    @endpoint
    async def call_one_given(self, other: Any) -> Any:
        return await other.whoami.call_one()


class Sender(Actor):
    def __init__(self) -> None:
        self.receiver: PortReceiver[Any] | None = None

    @endpoint
    def send_values(self, port: Port[Any], values: list[Any]) -> int:
        for v in values:
            port.send(v)
        return len(values)

    @endpoint
    def send_from_thread(self, port: Port[Any], n: int) -> None:
        def work() -> None:
            for i in range(n):
                port.send(("thread", i))

        t = threading.Thread(target=work)
        t.start()
        t.join(T)

    @endpoint
    def send_error(self, port: Port[Any], msg: str) -> None:
        port.exception(ValueError(msg))

    @endpoint
    def open_channel(self) -> Port[Any]:
        port, self.receiver = Channel.open()
        return port

    @endpoint
    def drain(self, n: int) -> list[Any]:
        assert self.receiver is not None
        return [self.receiver.recv().get(timeout=T) for _ in range(n)]


class Forwarder(Actor):
    """Passes a port on to another actor, then sends on it itself."""

    def __init__(self, sender: Any) -> None:
        self.sender = sender

    @endpoint
    def forward(self, port: Port[Any], value: Any) -> None:
        self.sender.send_values.call_one(port, [("via sender", value)]).get(timeout=T)
        port.send(("via forwarder", value))


class Spawner(Actor):
    """Spawns a mesh and hands the reference back to its caller."""

    @endpoint
    def make(self, tag: str) -> Any:
        self.made = context().actor_instance.proc.spawn("made", Target, tag)
        return self.made


class Registry(Actor):
    def __init__(self, label: str) -> None:
        self.label = label
        self.token = uuid.uuid4().hex

    @endpoint
    def info(self) -> tuple[str, str, int]:
        return self.label, self.token, os.getpid()


class BrokenRegistry(Actor):
    def __init__(self) -> None:
        raise RuntimeError("registry cannot start")

    @endpoint
    def info(self) -> str:
        return "never"


class Asker(Actor):
    @endpoint
    def lookup(self, name: str, label: str) -> tuple[str, str, int]:
        reg = get_or_spawn_controller(name, Registry, label).get(timeout=T)
        return reg.info.call_one().get(timeout=T)


# --------------------------------------------------------------------------- actor mesh references


@pytest.mark.parametrize("holder_cls", [Holder, AsyncHolder], ids=["sync", "async"])
def test_mesh_passed_to_init_and_to_endpoint_is_callable_there(spawn_procs, holder_cls):
    procs = spawn_procs(per_host={"gpus": 2})
    target = procs.spawn("target", Target, "t")
    expected = target.whoami.call().get(timeout=T).values()
    assert [v[1] for v in expected] == [{"gpus": 0}, {"gpus": 1}]

    holder_procs = spawn_procs(per_host={"gpus": 1})
    holder = holder_procs.spawn("holder", holder_cls, target)
    assert holder.call_held.call_one().get(timeout=T) == expected
    assert holder.call_given.call_one(target).get(timeout=T) == expected

    other = procs.spawn("other", Target, "o")
    got = holder.call_given.call_one(other).get(timeout=T)
    assert [v[0] for v in got] == ["o", "o"]
    assert [v[2] for v in got] == [v[2] for v in expected]


@pytest.mark.parametrize("holder_cls", [Holder, AsyncHolder], ids=["sync", "async"])
def test_slice_passed_to_an_actor_reaches_only_its_members(spawn_procs, holder_cls):
    procs = spawn_procs(per_host={"gpus": 3})
    target = procs.spawn("target", Target, "t")
    pids = [v[2] for v in target.whoami.call().get(timeout=T).values()]
    holder = spawn_procs(per_host={"gpus": 1}).spawn("holder", holder_cls, target)

    got = holder.call_given.call_one(target.slice(gpus=slice(1, 3))).get(timeout=T)
    assert [(v[1], v[2]) for v in got] == [({"gpus": 1}, pids[1]), ({"gpus": 2}, pids[2])]

    one = holder.call_one_given.call_one(target.slice(gpus=2)).get(timeout=T)
    assert one == ("t", {"gpus": 2}, pids[2])


def test_mesh_reference_shares_state_with_the_original(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    target = procs.spawn("target", Target, "t")
    holder = procs.spawn("holder", Holder, target)
    assert target.incr.call().get(timeout=T).values() == [1, 1]
    # Both holder ranks increment target rank 1 (in either order).
    assert sorted(holder.incr_given.call(target.slice(gpus=1)).get(timeout=T).values()) == [[2], [3]]
    assert target.incr.call().get(timeout=T).values() == [2, 4]


def test_mesh_reference_cannot_be_stopped_remotely(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 1})
    target = procs.spawn("target", Target, "t")
    holder = procs.spawn("holder", Holder, target)
    with pytest.raises(NotImplementedError):
        holder.try_stop.call_one(target).get(timeout=T)
    assert target.incr.call_one().get(timeout=T) == 1


def test_reference_to_a_stopped_mesh_fails_inside_the_holder(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    target = procs.spawn("target", Target, "t")
    holder = spawn_procs(per_host={"gpus": 1}).spawn("holder", Holder, target)
    assert holder.call_held.call_one().get(timeout=T)[0][0] == "t"
    target.stop().get(timeout=T)
    t0 = time.monotonic()
    with pytest.raises(SupervisionError, match="stopped"):
        holder.call_held.call_one().get(timeout=T)
    assert time.monotonic() - t0 < 5
    assert holder.alive.call_one().get(timeout=T) == "alive"
    assert faults.failures == []


def test_reference_to_a_killed_proc_fails_inside_the_holder(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    target = procs.spawn("target", Target, "t")
    holder = spawn_procs(per_host={"gpus": 1}).spawn("holder", Holder, target)
    pid = holder.call_held.call_one().get(timeout=T)[0][2]
    os.kill(pid, signal.SIGKILL)
    faults.wait(1)  # the owner (the test) hears of it
    t0 = time.monotonic()
    with pytest.raises(SupervisionError) as ei:
        holder.call_held.call_one().get(timeout=T)
    assert time.monotonic() - t0 < 5
    assert "Killed(sig=9)" in str(ei.value) or "lost connection" in str(ei.value) or "exited" in str(ei.value), str(ei.value)
    assert holder.alive.call_one().get(timeout=T) == "alive"


def test_failure_caused_through_a_reference_goes_to_the_owner_not_the_holder(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    target = procs.spawn("target", Target, "t")
    holder = spawn_procs(per_host={"gpus": 1}).spawn("holder", Holder, target)
    holder.broadcast_to.call_one(target, "failed via a reference").get(timeout=T)
    failures = faults.wait(1)
    assert "failed via a reference" in failures[0].report()
    assert failures[0].mesh_name.startswith("target")
    # The holder does not own the target: it is not failed by it.
    assert holder.alive.call_one().get(timeout=T) == "alive"
    with pytest.raises(SupervisionError, match="have failed"):
        target.incr.call_one().get(timeout=T)


def test_meshes_slices_and_ports_are_picklable(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    target = procs.spawn("target", Target, "t")
    for obj in (target, target.slice(gpus=1), procs, procs.slice(gpus=0)):
        copy = pickle.loads(pickle.dumps(obj))
        assert len(copy) == len(obj)
    ref = pickle.loads(pickle.dumps(target.slice(gpus=1)))
    assert ref.whoami.call_one().get(timeout=T)[1] == {"gpus": 1}
    port, receiver = Channel.open()
    port2 = pickle.loads(pickle.dumps(port))
    port2.send("via copy")
    assert receiver.recv().get(timeout=T) == "via copy"


# --------------------------------------------------------------------------- ports


def test_port_passed_to_actor_delivers_values_in_order(spawn_procs):
    sender = spawn_procs(per_host={"gpus": 1}).spawn("sender", Sender)
    port, receiver = Channel.open()
    values = [0, "one", {"two": 2}, [3.0], None]
    assert sender.send_values.call_one(port, values).get(timeout=T) == len(values)
    assert [receiver.recv().get(timeout=T) for _ in values] == values


def test_port_used_from_a_background_thread_in_the_actor(spawn_procs):
    sender = spawn_procs(per_host={"gpus": 1}).spawn("sender", Sender)
    port, receiver = Channel.open()
    sender.send_from_thread.call_one(port, 5).get(timeout=T)
    assert [receiver.recv().get(timeout=T) for _ in range(5)] == [("thread", i) for i in range(5)]


def test_recv_before_send_waits_for_the_value(spawn_procs):
    sender = spawn_procs(per_host={"gpus": 1}).spawn("sender", Sender)
    port, receiver = Channel.open()
    futs = [receiver.recv() for _ in range(3)]
    sender.send_values.broadcast(port, ["a", "b", "c"])
    assert [f.get(timeout=T) for f in futs] == ["a", "b", "c"]


def test_port_exception_raises_the_exception_itself(spawn_procs):
    sender = spawn_procs(per_host={"gpus": 1}).spawn("sender", Sender)
    port, receiver = Channel.open()
    sender.send_values.call_one(port, [1]).get(timeout=T)
    sender.send_error.call_one(port, "sent as an error").get(timeout=T)
    sender.send_values.call_one(port, [2]).get(timeout=T)
    assert receiver.recv().get(timeout=T) == 1
    with pytest.raises(ValueError, match="sent as an error") as ei:
        receiver.recv().get(timeout=T)
    assert type(ei.value) is ValueError
    assert not isinstance(ei.value, ActorError)
    # The port stays usable after an exception.
    assert receiver.recv().get(timeout=T) == 2


def test_port_exception_locally():
    port, receiver = Channel.open()
    port.exception(KeyError("local"))
    with pytest.raises(KeyError) as ei:
        receiver.recv().get(timeout=T)
    assert type(ei.value) is KeyError


def test_port_opened_by_an_actor_receives_from_the_controller(spawn_procs):
    sender = spawn_procs(per_host={"gpus": 1}).spawn("sender", Sender)
    port = sender.open_channel.call_one().get(timeout=T)
    assert isinstance(port, Port)
    for v in ("x", "y", "z"):
        port.send(v)
    assert sender.drain.call_one(3).get(timeout=T) == ["x", "y", "z"]


def test_port_passed_on_through_two_actors(spawn_procs):
    procs = spawn_procs(per_host={"gpus": 2})
    sender = procs.slice(gpus=1).spawn("sender", Sender)
    forwarder = procs.slice(gpus=0).spawn("forwarder", Forwarder, sender)
    port, receiver = Channel.open()
    forwarder.forward.call_one(port, 9).get(timeout=T)
    assert [receiver.recv().get(timeout=T) for _ in range(2)] == [("via sender", 9), ("via forwarder", 9)]


def test_mesh_returned_from_an_endpoint_is_callable_by_the_caller(spawn_procs):
    spawner = spawn_procs(per_host={"gpus": 1}).spawn("spawner", Spawner)
    made = spawner.make.call_one("returned").get(timeout=T)
    tag, rank, pid = made.whoami.call_one().get(timeout=T)
    assert tag == "returned"
    assert made.incr.call_one().get(timeout=T) == 1
    with pytest.raises(NotImplementedError):
        made.stop()  # a reference: the spawner owns it


def test_one_shot_channel(spawn_procs):
    sender = spawn_procs(per_host={"gpus": 1}).spawn("sender", Sender)
    port, receiver = Channel.open(once=True)
    sender.send_values.call_one(port, ["only"]).get(timeout=T)
    assert receiver.recv().get(timeout=T) == "only"


# --------------------------------------------------------------------------- singletons


def test_get_or_spawn_controller_singleton_from_controller_and_worker(spawn_procs):
    name = f"registry-{uuid.uuid4().hex[:8]}"
    reg = get_or_spawn_controller(name, Registry, "from-test").get(timeout=T)
    label, token, pid = reg.info.call_one().get(timeout=T)
    assert label == "from-test"
    assert pid == os.getpid(), "the singleton lives in the controller process"

    again = get_or_spawn_controller(name, Registry, "ignored").get(timeout=T)
    assert again.info.call_one().get(timeout=T) == (label, token, pid)

    asker = spawn_procs(per_host={"gpus": 2}).spawn("asker", Asker)
    seen = asker.lookup.call(name, "from-worker").get(timeout=T).values()
    assert seen == [(label, token, pid), (label, token, pid)]

    other = get_or_spawn_controller(f"{name}-other", Registry, "other").get(timeout=T)
    o_label, o_token, o_pid = other.info.call_one().get(timeout=T)
    assert o_label == "other"
    assert o_token != token
    assert o_pid == os.getpid()


def test_get_or_spawn_controller_first_spawned_from_a_worker(spawn_procs):
    name = f"registry-{uuid.uuid4().hex[:8]}"
    asker = spawn_procs(per_host={"gpus": 2}).spawn("asker", Asker)
    first = asker.slice(gpus=0).lookup.call_one(name, "from-worker").get(timeout=T)
    label, token, pid = first
    assert label == "from-worker"
    assert pid == os.getpid(), "spawned from a worker, the singleton still lives in the controller"
    assert asker.slice(gpus=1).lookup.call_one(name, "ignored").get(timeout=T) == first
    reg = get_or_spawn_controller(name, Registry, "ignored").get(timeout=T)
    assert reg.info.call_one().get(timeout=T) == first
    # Different names from the worker side give different actors.
    other = asker.slice(gpus=1).lookup.call_one(f"{name}-2", "second").get(timeout=T)
    assert other[0] == "second" and other[1] != token


def test_get_or_spawn_controller_concurrent_first_lookups_agree(spawn_procs):
    name = f"registry-{uuid.uuid4().hex[:8]}"
    asker = spawn_procs(per_host={"gpus": 3}).spawn("asker", Asker)
    seen = asker.lookup.call(name, "race").get(timeout=T).values()
    assert len({s[1] for s in seen}) == 1, seen


def test_get_or_spawn_controller_whose_init_failed_reports_the_failure(faults):
    """MONARCH_API.md §1.6: once a singleton failed, lookups raise ValueError("Failure on <name>: ...")."""
    name = f"broken-{uuid.uuid4().hex[:8]}"
    reg = get_or_spawn_controller(name, BrokenRegistry).get(timeout=T)
    with pytest.raises(SupervisionError, match="registry cannot start"):
        reg.info.call_one().get(timeout=T)
    faults.wait(1)  # its owner is the controller's client
    with pytest.raises(ValueError, match=f"Failure on {name}"):
        get_or_spawn_controller(name, BrokenRegistry).get(timeout=T)
