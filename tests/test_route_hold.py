"""A child's connection that closes under a sender, before the loop hears of it.

The sender's message must wait for the exit status like any message sent a moment
later (see runtime._peers.connection_closed), not fail with a bare "connection lost":
a caller is owed the reason its process died. No processes: a route, a closed
connection, and a runtime that records what failed."""

from __future__ import annotations

from types import SimpleNamespace

from actormesh.errors import Cause, CauseKind, TransportError
from actormesh.runtime._messages import PING, Ping
from actormesh.runtime._routes import Route


class ClosedConn:
    flush_scheduled = False

    def send(self, *args, **kwargs):
        raise TransportError("connection to unix-peer is closed")


class Recorder:
    def __init__(self) -> None:
        self.failed: list[tuple[object, str, Cause]] = []
        self.config = SimpleNamespace(message_delivery_timeout=1.0)

    def undeliverable(self, env, address, reason) -> None:
        self.failed.append((env, address, reason))

    def in_loop(self) -> bool:
        return False


def _env():
    return Ping(PING)


def test_message_to_a_closed_child_waits_for_its_exit_status():
    rt = Recorder()
    route = Route(rt, "unix:/child.sock", child=True)
    conn = ClosedConn()
    route.conn = conn
    env = _env()
    route.send(env)
    assert rt.failed == []  # held, not failed as "connection lost"
    status = Cause("exited with non-zero code 3", CauseKind.EXITED)
    assert [e for e, _ in route.fail(status)] == [env]


def test_message_to_a_closed_peer_that_is_not_a_child_fails_at_once():
    rt = Recorder()
    route = Route(rt, "tcp:peer:1")  # nobody reports its status: waiting would only delay
    route.conn = ClosedConn()
    route.send(_env())
    [(_, address, reason)] = rt.failed
    assert address == "tcp:peer:1" and reason.kind is CauseKind.UNREACHABLE
    assert "connection lost" in str(reason)


def test_message_to_a_child_already_declared_dead_fails_with_its_status():
    rt = Recorder()
    route = Route(rt, "unix:/child.sock", child=True)
    conn = ClosedConn()
    route.conn = conn
    status = Cause("exited with non-zero code 3", CauseKind.EXITED)
    route.fail(status)
    route.conn = conn  # a sender that read the connection before it was dropped
    route.send(_env())
    [(_, _, reason)] = rt.failed
    assert reason is status  # dead: nothing will come to release it, and its end is known
