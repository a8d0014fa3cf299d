"""Streams and borrows (actormesh/tensor/_stream.py, _stream_worker.py) over real
procs: Monarch's rules checked on the controller, values and failures on the
workers. On CPU the workers run every stream's commands in issue order."""

from __future__ import annotations

import gc
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import actormesh.tensor as T
from actormesh.errors import RemoteException

from conftest import module_procs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def procs() -> Iterator[Any]:
    yield from module_procs({"gpus": 2})


def test_tensors_belong_to_the_stream_active_when_made(procs: Any) -> None:
    other = T.Stream("other")
    assert T.get_active_stream().name == "main" and T.get_active_stream().default
    with procs.activate():
        x = torch.ones(2)
        with other.activate():
            assert T.get_active_stream() is other
            y = torch.ones(2) * 3
        assert T.get_active_stream().name == "main"
    assert x.stream is T.get_active_stream() and y.stream is other
    assert repr(other).startswith("<Stream('other') at ") and str(other) == "stream 'other'"
    with procs.activate(), other.activate():
        z = y + y
    assert torch.equal(T.inspect(z), torch.full((2,), 6.0))


def test_wrong_stream_names_the_op_and_the_fix(procs: Any) -> None:
    other = T.Stream("other")
    with procs.activate():
        x = torch.rand(3)
        with other.activate():
            with pytest.raises(TypeError, match=r"(?s)aten\.add\.Tensor.*WRONG_STREAM.*stream 'main'.*borrow"):
                x.add(1)
            with pytest.raises(TypeError, match="WRONG_STREAM"):
                x + 1  # the operator form keeps the message
        y = x * 2  # still fine on its own stream
    assert torch.allclose(T.inspect(y), T.inspect(x) * 2)


def test_immutable_borrow_reads_on_both_streams_and_writes_on_neither(procs: Any) -> None:
    other = T.Stream("other")
    with procs.activate():
        x = torch.arange(4.0)
        xv = x.view(2, 2)
        b, borrow = other.borrow(x)
        assert b.stream is other and b.shape == x.shape
        with pytest.raises(TypeError, match="would be mutated"):
            x.abs_()
        with pytest.raises(TypeError, match="MUTATING_BORROW"):
            xv.mul_(2)  # a view of the borrowed storage: same rule
        with pytest.raises(TypeError, match="WRONG_STREAM"):
            b.add(1)
        with other.activate():
            with pytest.raises(TypeError, match="would be mutated"):
                b.add_(1)
            twice = b + b
        also = x + 1  # the origin stream may still read
        borrow.drop()
        x.add_(10)  # and write again after the drop
    assert torch.equal(T.inspect(twice), torch.arange(4.0) * 2)
    assert torch.equal(T.inspect(also), torch.arange(4.0) + 1)
    assert torch.equal(T.inspect(x), torch.arange(4.0) + 10)


def test_mutable_borrow_locks_the_origin_until_drop(procs: Any) -> None:
    other = T.Stream("other")
    with procs.activate():
        x = torch.zeros(2, 2)
        row = x[0]
        b, borrow = other.borrow(x, mutable=True)
        for use in (lambda: x.add(1), lambda: row.mul(2), lambda: x.add_(1)):
            with pytest.raises(TypeError, match="BORROWED"):
                use()
        with pytest.raises(TypeError, match="BORROWED"):
            other.borrow(x, mutable=True)  # lent already
        with other.activate():
            b.add_(5)
            b[1].fill_(7)  # a view of the borrowed tensor, written on its stream
        borrow.drop()
        after = x * 1
    assert torch.equal(T.inspect(after), torch.tensor([[5.0, 5.0], [7.0, 7.0]]))
    assert torch.equal(T.inspect(row), torch.tensor([5.0, 5.0]))


def test_mutable_borrow_refused_while_borrowed_immutably(procs: Any) -> None:
    other, third = T.Stream("other"), T.Stream("third")
    with procs.activate():
        x = torch.ones(2)
        _, b1 = other.borrow(x)
        with pytest.raises(RuntimeError, match="already being borrowed non-mutably"):
            third.borrow(x, mutable=True)
        _, b2 = third.borrow(x)  # a second reader is fine
        b1.drop()
        with pytest.raises(TypeError, match="would be mutated"):
            x.add_(1)  # b2 still lives
        b2.drop()
        x.add_(1)
    assert torch.equal(T.inspect(x), torch.full((2,), 2.0))


def test_dropped_borrow_says_where_it_was_dropped(procs: Any) -> None:
    other = T.Stream("other")
    with procs.activate():
        x = torch.rand(4, 4)
        b, borrow = other.borrow(x)
        with other.activate():
            bv = b.t()
        borrow.drop()
        borrow.drop()  # idempotent
        assert b.dropped and bv.dropped
        with other.activate():
            pattern = re.compile(r".*tensor.*is dropped at.*borrow\.drop\(\).*", flags=re.DOTALL)
            with pytest.raises(TypeError, match=pattern):
                b.abs()
            with pytest.raises(TypeError, match="DROPPED"):
                bv.abs()
        with pytest.raises(TypeError, match="DROPPED"):
            other.borrow(b)
        with pytest.raises(TypeError, match="expected a distributed tensor"):
            other.borrow(3)  # type: ignore[arg-type]
        x.abs_()  # the origin is free again


def test_borrow_as_context_manager_and_back_to_main(procs: Any) -> None:
    side = T.Stream("side")
    with procs.activate():
        x = torch.full((3,), 2.0)
        b, borrow = side.borrow(x, mutable=True)
        with borrow, side.activate():
            b.mul_(3)
            y = b + 0  # made on `side`
        x.add_(1)  # borrow dropped at the end of the with
        back, borrow2 = T.get_active_stream().borrow(y)  # `side` -> main
        z = back * 2
        borrow2.drop()
    assert torch.equal(T.inspect(x), torch.full((3,), 7.0))
    assert torch.equal(T.inspect(z), torch.full((3,), 12.0))


def test_failed_write_on_a_mutable_borrow_poisons_the_origin(procs: Any) -> None:
    other = T.Stream("other")
    with procs.activate():
        x = torch.ones(2, 2)
        ok = torch.ones(2)
        b, borrow = other.borrow(x, mutable=True)
        with other.activate():  # the index is only checked on the worker: this write fails there
            b.index_fill_(0, torch.tensor([5]), 1.0)
        borrow.drop()
        y = x + 1
    with pytest.raises(RemoteException, match="asynchronously on rank"):
        T.inspect(y)
    assert torch.equal(T.inspect(ok), torch.ones(2))


def test_borrow_freed_without_drop_warns_and_drops(procs: Any) -> None:
    other = T.Stream("other")
    with procs.activate():
        x = torch.ones(2)
        _, borrow = other.borrow(x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del borrow, _
            gc.collect()
        assert any("borrow.drop() must be called" in str(w.message) for w in caught)
        x.add_(1)  # permissions restored by the implicit drop
    assert torch.equal(T.inspect(x), torch.full((2,), 2.0))


def test_borrow_state_is_per_mesh(spawn_procs: Any) -> None:
    """Ref numbers are per mesh: a dropped borrow on one mesh says nothing of another's tensors."""
    one, two = spawn_procs({"gpus": 1}), spawn_procs({"gpus": 1})
    side = T.Stream("side")
    with one.activate():
        x = torch.ones(2)
        b, borrow = side.borrow(x, mutable=True)
        borrow.drop()
    with two.activate():
        theirs = [torch.ones(1) for _ in range(4)]
    assert {t._ref.id for t in theirs} >= {x._ref.id, b._ref.id}  # the same numbers on the other mesh
    with two.activate():
        total = sum(t * 1 for t in theirs)  # none of them is BORROWED or DROPPED there
    assert torch.equal(T.inspect(total), torch.full((1,), 4.0))
