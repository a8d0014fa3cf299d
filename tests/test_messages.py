"""The wire messages (runtime/_messages.py): named fields, plain-tuple wire form."""

from __future__ import annotations

import pickle

import pytest

from actormesh.runtime import messages as M

EXAMPLES = [
    M.Call(M.CALL, "counter-1a2b", "incr", ("unix:/tmp/c.sock", 7), 3, ("gpus",), (4,), "unix:/tmp/c.sock", 41, 40),
    M.Reply(M.REPLY, 7, 3, M.OK, "unix:/tmp/w.sock"),
    M.ReplyMulti(M.REPLY_MULTI, 7, ((0, M.OK, 1), (1, M.ERROR, 1)), "unix:/tmp/w.sock"),
    M.Spawn(M.SPAWN, "counter-1a2b", 0, ("gpus",), (4,), ("unix:/tmp/c.sock", "client"), ("unix:/tmp/c.sock", 2), "<counter>", False),
    M.StopActor(M.STOP_ACTOR, "counter-1a2b", None, 0, "unix:/tmp/c.sock", 42, 41),
    M.Cast(M.CAST, "counter-1a2b", "incr", None, ("gpus",), (4,), "unix:/tmp/c.sock", 0, ("unix:/tmp/w.sock",), (3, 1), 5, 4, {0: 2}),
    M.StopProc(M.STOP_PROC, None),
    M.Hello(M.HELLO, "unix:/tmp/w.sock", 123, None, M.RESTART),
    M.Failure(M.FAILURE, "client", "counter-1a2b", 2, "boom", "<counter 2>", "unix:/tmp/w.sock"),
    M.Singleton(M.SINGLETON, "registry", ("unix:/tmp/w.sock", 9)),
    M.Ping(M.PING),
    M.Pong(M.PONG),
    M.Join(M.JOIN, "tcp:10.0.0.2:4000", "node2", 77),
    M.RelayLost(M.RELAY_LOST, "unix:/tmp/w.sock", "gone"),
    M.Stats(M.STATS, ("unix:/tmp/c.sock", 3)),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_a_message_comes_back_with_its_type_and_fields(msg: tuple) -> None:
    back = M.decode(M.encode(msg))
    assert type(back) is type(msg) and back == msg and back._asdict() == msg._asdict()


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_the_wire_form_is_the_plain_tuple_no_class_reference(msg: tuple) -> None:
    data = M.encode(msg)
    assert data == pickle.dumps(tuple(msg), 5)
    assert b"actormesh" not in data and type(pickle.loads(data)) is tuple


def test_every_kind_has_one_type() -> None:
    kinds = [m.kind for m in EXAMPLES]
    assert sorted(kinds) == list(range(15))


def test_a_hello_without_extra_gets_none() -> None:
    hello = M.decode(pickle.dumps((M.HELLO, "unix:/tmp/w.sock", 1, None), 5))
    assert type(hello) is M.Hello and hello.extra is None


@pytest.mark.parametrize("bad", [(), [M.CALL], (99, "x"), (-1, ("a", 1)), (M.REPLY, 1, 2), ("x",), 5, None])
def test_anything_else_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        M.decode(pickle.dumps(bad, 5))


class _Capture:
    """A route stand-in that keeps what the verbs hand it."""

    dead = None

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, env: tuple, payload: object = (), key: object = None) -> None:
        self.sent.append((env, key))


def test_the_verbs_build_messages_that_decode_to_their_types() -> None:
    from actormesh.runtime import CastPlan, ProcRuntime

    rt = ProcRuntime(name="verbs")
    try:
        peer, capture = "unix:/nonexistent/peer.sock", _Capture()
        rt._routes[peer] = capture  # type: ignore[assignment]
        rt.call_actor(peer, "counter-1", "incr", (rt.address, 3), 2, ("gpus",), (4,), [b""])
        rt.reply((peer, 7), 1, M.OK, [b""])
        rt.stop_actor(peer, "counter-1", None, 0)
        rt.spawn_actor(peer, "counter-1", 0, (), (), None, None, "<c>", False, [b""])
        peer2 = "unix:/nonexistent/peer2.sock"
        rt._routes[peer2] = capture  # type: ignore[assignment]
        rt.cast("counter-1", "incr", None, (), (), CastPlan([peer, peer2], fanout=8), [b""], whole=True)
        types, keys = [], []
        for env, key in capture.sent:
            back = M.decode(M.encode(env))
            assert back == tuple(env) and M.typed(tuple(env)) == back
            types.append(type(back))
            keys.append(key)
        assert types == [M.Call, M.Reply, M.StopActor, M.Spawn, M.Cast, M.Cast]  # one cast per subtree
        assert keys == ["counter-1", 7, "counter-1", None, "counter-1", "counter-1"]  # what a connection keeps in order
        call, _, stop, _, cast0, cast1 = (M.decode(M.encode(env)) for env, _ in capture.sent)
        assert (call.sender, call.seq, call.prev, call.member) == (rt.address, 0, -1, 2)
        # one chain per destination actor, whether by call, stop or cast
        assert (stop.seq, stop.prev) == (1, 0)
        assert (cast0.lo, cast0.addrs, cast0.seq, cast0.prev, cast0.exceptions) == (0, (peer,), 2, -1, {0: 1})
        assert (cast1.lo, cast1.addrs, cast1.seq, cast1.prev, cast1.exceptions) == (1, (peer2,), 2, -1, None)
    finally:
        rt.close()
