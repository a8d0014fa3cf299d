"""Failure causes as data: every way an actor can be lost, with real procs.

Each case checks the three places a cause is seen: the caller's error (its
class and ``cause.kind``), later calls on the mesh, and the owner's
``MeshFailure``.
"""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest

from actormesh.actor import (
    Actor,
    ActorDiedError,
    ActorUnreachableError,
    Cause,
    CauseKind,
    MeshStoppedError,
    SupervisionError,
    endpoint,
)
from actormesh.errors import TransportError, supervision_error

from conftest import wait_for


class Victim(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    @endpoint
    def exit(self, code: int) -> None:
        os._exit(code)

    @endpoint
    def boom(self) -> None:
        raise ValueError("boom in a broadcast")


def _in_flight_error(fut) -> SupervisionError:
    with pytest.raises(SupervisionError) as ei:
        fut.get(timeout=30)
    return ei.value


def test_sigkill_is_signaled_9_everywhere(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    v = procs.spawn("v", Victim)
    pid = v.pid.call_one().get(timeout=30)
    fut = v.wait.call_one(30.0)
    os.kill(pid, signal.SIGKILL)
    err = _in_flight_error(fut)
    assert type(err) is ActorDiedError
    assert err.cause.kind is CauseKind.SIGNALED and err.cause.signal == signal.SIGKILL
    assert err.endpoint == "v.wait" and err.rank == 0 and "v" in err.actor
    assert "Killed(sig=9)" in str(err)  # the text is as before
    failure = faults.wait(1)[0]
    assert failure.cause.kind is CauseKind.SIGNALED and failure.cause.signal == 9
    with pytest.raises(ActorDiedError) as later:
        v.pid.call_one().get(timeout=30)
    assert later.value.cause.kind is CauseKind.SIGNALED


def test_exit_code_3_is_exited_3(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    v = procs.spawn("v", Victim)
    err = _in_flight_error(v.exit.call_one(3))
    assert type(err) is ActorDiedError
    assert err.cause.kind is CauseKind.EXITED and err.cause.code == 3 and err.cause.signal is None
    assert "exited with non-zero code 3" in str(err)
    assert faults.wait(1)[0].cause.code == 3


def test_sigstop_is_hung_with_the_stop_signal(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    v = procs.spawn("v", Victim)
    pid = v.pid.call_one().get(timeout=30)
    fut = v.wait.call_one(0.0)
    fut.get(timeout=30)
    fut = v.wait.call_one(30.0)
    os.kill(pid, signal.SIGSTOP)  # the liveness judge kills it (so no SIGCONT is needed)
    err = _in_flight_error(fut)
    assert type(err) is ActorDiedError
    assert err.cause.kind is CauseKind.HUNG and err.cause.signal == signal.SIGSTOP
    assert faults.wait(1)[0].cause.kind is CauseKind.HUNG


def test_an_actor_that_raised_in_a_broadcast_is_raised(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    v = procs.spawn("v", Victim)
    v.boom.broadcast()
    failure = faults.wait(1)[0]
    assert failure.cause.kind is CauseKind.RAISED and "boom in a broadcast" in failure.cause
    with pytest.raises(ActorDiedError) as ei:
        v.pid.call_one().get(timeout=30)
    assert ei.value.cause.kind is CauseKind.RAISED and ei.value.rank == 0


def test_a_stopped_mesh_raises_mesh_stopped(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    v = procs.spawn("v", Victim)
    v.pid.call_one().get(timeout=30)
    v.stop().get(timeout=30)
    for adverb in (lambda: v.pid.call_one().get(timeout=10), lambda: v.pid.call().get(timeout=10), v.pid.broadcast):
        with pytest.raises(MeshStoppedError) as ei:
            adverb()
        assert ei.value.cause.kind is CauseKind.STOPPED and ei.value.endpoint == "v.pid"
    procs.stop().get(timeout=30)
    with pytest.raises(MeshStoppedError, match="cannot spawn on proc mesh") as ei:
        procs.spawn("again", Victim)
    assert ei.value.cause.kind is CauseKind.STOPPED
    assert faults.failures == []  # a stop is not a failure


def test_calls_in_flight_when_the_proc_mesh_stops_fail_as_stopped(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 1})
    v = procs.spawn("v", Victim)
    v.pid.call_one().get(timeout=30)
    fut = v.wait.call_one(60.0)
    procs.stop().get(timeout=60)
    err = _in_flight_error(fut)
    assert isinstance(err, MeshStoppedError) and err.cause.kind is CauseKind.STOPPED
    assert faults.failures == []


def test_a_peer_nobody_listens_at_is_unreachable(tmp_path):
    from actormesh.mesh._host_agent import agent_mesh

    ghost = agent_mesh(f"unix:{tmp_path}/nobody.sock")
    with pytest.raises(ActorUnreachableError, match="unreachable") as ei:
        ghost.info.call_one().get(timeout=30)
    assert ei.value.cause.kind is CauseKind.UNREACHABLE and not ei.value.cause.died
    assert isinstance(ei.value, SupervisionError) and not isinstance(ei.value, ActorDiedError)
    assert isinstance(ei.value.__cause__, TransportError)  # raised from the transport's own error


# -- the types alone ----------------------------------------------------------------------


def test_a_cause_is_its_text_and_pickles_small():
    c = Cause("the process this actor was running on failed: Killed(sig=9)", CauseKind.SIGNALED, signal=9)
    assert c == "the process this actor was running on failed: Killed(sig=9)" and "Killed" in c
    back = pickle.loads(pickle.dumps(c, 5))
    assert (type(back), back, back.kind, back.signal, back.code) == (Cause, c, CauseKind.SIGNALED, 9, None)
    assert len(pickle.dumps(c, 5)) - len(pickle.dumps(str(c), 5)) <= 48
    assert c.reworded("other words").kind is CauseKind.SIGNALED
    assert Cause.of(c) is c and Cause.of("text").kind is CauseKind.UNREACHABLE


@pytest.mark.parametrize(
    "kind, cls",
    [
        (CauseKind.EXITED, ActorDiedError),
        (CauseKind.SIGNALED, ActorDiedError),
        (CauseKind.HUNG, ActorDiedError),
        (CauseKind.RAISED, ActorDiedError),
        (CauseKind.UNREACHABLE, ActorUnreachableError),
        (CauseKind.STOPPED, MeshStoppedError),
    ],
)
def test_each_kind_maps_to_one_error_class(kind, cls):
    err = supervision_error("call failed", Cause("why", kind), endpoint="f", actor="a[0]", rank=0)
    assert type(err) is cls and isinstance(err, SupervisionError) and isinstance(err, RuntimeError)
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.cause.kind, back.actor, back.rank, back.endpoint) == (cls, kind, "a[0]", 0, "f")


def test_text_without_a_cause_stays_a_plain_supervision_error():
    err = supervision_error("call failed", "no actor named 'x'")
    assert type(err) is SupervisionError and err.cause is None
