"""The wire messages (runtime/_messages.py): named fields, plain-tuple wire form."""

from __future__ import annotations

import pickle

import pytest

from actormesh.runtime import messages as M

EXAMPLES = [
    M.Call(M.CALL, "counter-1a2b", "incr", ("unix:/tmp/c.sock", 7), 3, ("gpus",), (4,), "unix:/tmp/c.sock", 41),
    M.Reply(M.REPLY, 7, 3, M.OK, "unix:/tmp/w.sock"),
    M.ReplyMulti(M.REPLY_MULTI, 7, ((0, M.OK, 1), (1, M.ERROR, 1)), "unix:/tmp/w.sock"),
    M.Spawn(M.SPAWN, "counter-1a2b", 0, ("gpus",), (4,), ("unix:/tmp/c.sock", "client"), ("unix:/tmp/c.sock", 2), "<counter>", False),
    M.StopActor(M.STOP_ACTOR, "counter-1a2b", None, 0, "unix:/tmp/c.sock", 42),
    M.Cast(M.CAST, "counter-1a2b", "incr", None, ("gpus",), (4,), "unix:/tmp/c.sock", ((0, "unix:/tmp/w.sock", 5),)),
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


@pytest.mark.parametrize("bad", [(), [M.CALL], (99, "x"), (M.REPLY, 1, 2), ("x",), 5, None])
def test_anything_else_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        M.decode(pickle.dumps(bad, 5))
