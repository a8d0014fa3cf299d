"""Tests for actormesh.mesh._value_mesh.ValueMesh."""

from __future__ import annotations

import itertools
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actormesh.mesh._shape import Extent, MeshTrait, Point, Shape
from actormesh.mesh._value_mesh import ValueMesh

FAST = settings(derandomize=True, database=None, deadline=None, max_examples=100)


def _vm(sizes=(2, 3), labels=("hosts", "gpus")) -> ValueMesh[str]:
    n = 1
    for s in sizes:
        n *= s
    return ValueMesh(Shape.row_major(list(labels), list(sizes)), [f"v{i}" for i in range(n)])


def test_basics():
    vm = _vm()
    assert isinstance(vm, MeshTrait)
    assert len(vm) == 6 and vm.size() == 6 and vm.sizes == {"hosts": 2, "gpus": 3}
    assert vm.extent == Extent(["hosts", "gpus"], [2, 3])
    assert vm.values() == [f"v{i}" for i in range(6)]
    assert [vm.get(i) for i in range(6)] == vm.values()
    assert vm.item(hosts=1, gpus=2) == "v5" and vm.item(hosts=-1, gpus=0) == "v3"


def test_items_and_iter_use_own_extent():
    vm = _vm()
    items = list(vm.items())
    assert items == list(vm)
    assert [(p.rank, v) for p, v in items] == [(i, f"v{i}") for i in range(6)]
    assert all(isinstance(p, Point) and p.extent == vm.extent for p, _ in items)
    assert dict(items[4][0]) == {"hosts": 1, "gpus": 1}


def test_slice_remaps_values_and_points():
    vm = _vm()
    s = vm.slice(hosts=1, gpus=slice(1, 3))
    assert isinstance(s, ValueMesh) and len(s) == 2 and s.sizes == {"gpus": 2}
    assert s.values() == ["v4", "v5"]
    assert [(dict(p), p.rank, v) for p, v in s] == [({"gpus": 0}, 0, "v4"), ({"gpus": 1}, 1, "v5")]
    assert s.item(gpus=1) == "v5" and s.get(0) == "v4"
    # Slicing a slice composes.
    assert s.slice(gpus=1).item() == "v5"
    assert vm.slice(gpus=slice(0, 3, 2)).slice(hosts=1).values() == ["v3", "v5"]


def test_split_flatten_rename_keep_values():
    vm = _vm((4, 2), ("h", "g"))
    assert vm.flatten("r").values() == vm.values() and vm.flatten("r").sizes == {"r": 8}
    sp = vm.split(h=("a", "b"), b=2)
    assert sp.sizes == {"a": 2, "b": 2, "g": 2} and sp.values() == vm.values()
    assert sp.item(a=1, b=0, g=1) == vm.item(h=2, g=1)
    assert vm.rename(h="host").item(host=3, g=0) == "v6"
    with pytest.raises(ValueError, match="cannot flatten sparse mesh"):
        vm.slice(g=0).flatten("r")


def test_values_given_in_order_of_a_strided_shape():
    # The shape of a sliced actor mesh: global ranks 5 and 7; values follow its points.
    shape = Shape.row_major(["h", "g"], [2, 4]).slice(h=1, g=slice(1, 4, 2))
    vm = ValueMesh(shape, ["a", "b"])
    assert vm.values() == ["a", "b"] and vm.item(g=1) == "b" and vm.sizes == {"g": 2}


def test_item_singletons():
    assert ValueMesh(Shape.unity(), ["only"]).item() == "only"
    assert ValueMesh(Shape.row_major(["g"], [1]), ["x"]).item() == "x"
    assert _vm().slice(hosts=1, gpus=1).item() == "v4"


@pytest.mark.parametrize(
    "coords, exc, match",
    [
        ({}, KeyError, "missing coordinate"),
        ({"hosts": 0}, KeyError, r"missing coordinate.*gpus"),
        ({"hosts": 0, "gpus": 0, "cpus": 0}, KeyError, "unknown dimension.*cpus"),
        ({"hosts": 2, "gpus": 0}, IndexError, "index out of range"),
        ({"hosts": 0, "gpus": -4}, IndexError, "index out of range"),
        ({"hosts": 0, "gpus": "1"}, TypeError, "int coordinate"),
    ],
)
def test_item_errors(coords, exc, match):
    with pytest.raises(exc, match=match):
        _vm().item(**coords)


def test_get_out_of_range():
    s = _vm().slice(hosts=0)
    for i in (-1, 3):
        with pytest.raises(IndexError, match="out of range"):
            s.get(i)


def test_constructor_errors():
    with pytest.raises(ValueError, match="needs 6 values"):
        ValueMesh(Shape.row_major(["a", "b"], [2, 3]), [1, 2, 3])
    with pytest.raises(TypeError, match="needs a Shape"):
        ValueMesh({"a": 2}, [1, 2])  # type: ignore[arg-type]


def test_eq_and_unhashable():
    a, b = _vm(), _vm()
    assert a == b and a != _vm((3, 2)) and a != _vm((2, 3), ("x", "y"))
    assert a.slice(hosts=1) == ValueMesh(Shape.row_major(["gpus"], [3]), ["v3", "v4", "v5"])
    assert (a == "nope") is False
    with pytest.raises(TypeError):
        hash(a)


def test_pickle_sends_only_selected_values():
    big = ValueMesh(Shape.row_major(["r"], [1000]), [b"x" * 100] * 1000)
    one = big.slice(r=slice(10, 12))
    data = pickle.dumps(one)
    assert len(data) < 1000
    back = pickle.loads(data)
    assert back == one and back.values() == [b"x" * 100] * 2 and back.sizes == {"r": 2}
    assert pickle.loads(pickle.dumps(_vm())) == _vm()


def test_repr():
    vm = ValueMesh(Shape.row_major(["gpus"], [3]), ["a", 1, None])
    assert repr(vm) == ("ValueMesh({gpus: 3}):\n  ({'gpus': 0/3}, 'a')\n"
                        "  ({'gpus': 1/3}, 1)\n  ({'gpus': 2/3}, None)")
    assert repr(vm.slice(gpus=2)) == "ValueMesh({}):\n  ({}, None)"


@FAST
@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=3).flatmap(
        lambda sizes: st.tuples(
            st.just(sizes),
            st.lists(st.one_of(st.none(), st.integers(0, 3), st.tuples(st.integers(0, 3), st.integers(1, 2))),
                     min_size=len(sizes), max_size=len(sizes)),
        )
    )
)
def test_slice_values_match_model(case):
    sizes, picks = case
    labels = [f"d{i}" for i in range(len(sizes))]
    n = 1
    for s in sizes:
        n *= s
    vm = ValueMesh(Shape.row_major(labels, sizes), list(range(n)))
    sel, kept = {}, []
    for label, size, pick in zip(labels, sizes, picks):
        if pick is None:
            kept.append(list(range(size)))
        elif isinstance(pick, int):
            idx = pick % size
            sel[label] = idx
            kept.append([idx])
        else:
            start, step = pick[0] % size, pick[1]
            sel[label] = slice(start, None, step)
            kept.append(list(range(size))[start::step])
    strides = Shape.row_major(labels, sizes).strides
    expected = [sum(c * s for c, s in zip(coords, strides)) for coords in itertools.product(*kept)]
    sliced = vm.slice(**sel)
    assert sliced.values() == expected
    assert [v for _, v in sliced.items()] == expected
    assert [p.rank for p, _ in sliced.items()] == list(range(len(expected)))
    assert pickle.loads(pickle.dumps(sliced)).values() == expected
