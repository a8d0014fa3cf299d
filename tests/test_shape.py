"""Tests for actormesh.mesh._shape: Extent, Point, Shape and the MeshTrait mixin."""

from __future__ import annotations

import itertools
import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actormesh.mesh._shape import Extent, MeshTrait, Point, Shape

# Deterministic (derandomized, no example database) so runs are reproducible.
FAST = settings(derandomize=True, database=None, deadline=None, max_examples=150)


# ---------------------------------------------------------------- Extent

def test_extent_mapping_basics():
    e = Extent(["hosts", "gpus"], [2, 4])
    assert e.labels == ("hosts", "gpus") and e.sizes == (2, 4)
    assert e.nelements == 8
    assert dict(e) == {"hosts": 2, "gpus": 4}
    assert list(e) == ["hosts", "gpus"] and len(e) == 2
    assert e["gpus"] == 4 and "hosts" in e and "cpus" not in e
    assert e.get("cpus") is None
    assert str(e) == "{hosts: 2, gpus: 4}"
    assert repr(e) == "Extent({hosts: 2, gpus: 4})"


def test_extent_empty_and_zero_size():
    e = Extent([], [])
    assert e.nelements == 1 and str(e) == "{}" and dict(e) == {}
    assert Extent(["a"], [0]).nelements == 0


def test_extent_eq_hash_pickle_and_order():
    a, b = Extent(["x", "y"], [2, 3]), Extent(("x", "y"), (2, 3))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != Extent(["y", "x"], [3, 2])  # order matters between extents
    assert a == {"x": 2, "y": 3}  # plain mappings compare by content
    assert pickle.loads(pickle.dumps(a)) == a


def test_extent_is_immutable():
    e = Extent(["x"], [2])
    with pytest.raises(AttributeError):
        e.labels = ("y",)  # type: ignore[misc]
    with pytest.raises(TypeError):
        e["x"] = 3  # type: ignore[index]


@pytest.mark.parametrize(
    "labels, sizes, exc, match",
    [
        (["a", "a"], [1, 2], ValueError, "duplicate labels"),
        (["a"], [-1], ValueError, "must be >= 0"),
        (["a", "b"], [1], ValueError, "2 labels"),
        ([1], [2], TypeError, "labels must be str"),
        ("ab", [1, 2], TypeError, "not the str"),
        (["a"], [1.5], TypeError, "must be an int"),
        (["a"], [True], TypeError, "not bool"),
    ],
)
def test_extent_bad_input(labels, sizes, exc, match):
    with pytest.raises(exc, match=match):
        Extent(labels, sizes)


def test_extent_missing_label_error_lists_valid():
    with pytest.raises(KeyError, match="valid"):
        Extent(["a"], [1])["b"]


# ---------------------------------------------------------------- Point

def test_point_coordinates_and_format():
    e = Extent(["hosts", "gpus"], [2, 4])
    p = Point(5, e)
    assert dict(p) == {"hosts": 1, "gpus": 1}
    assert p.rank == 5 and p.extent is e and p.size("gpus") == 4
    assert str(p) == repr(p) == "{'hosts': 1/2, 'gpus': 1/4}"
    assert [dict(Point(r, e)) for r in (0, 3, 4, 7)] == [
        {"hosts": 0, "gpus": 0}, {"hosts": 0, "gpus": 3}, {"hosts": 1, "gpus": 0}, {"hosts": 1, "gpus": 3}]


def test_point_zero_dim():
    p = Point(0, Extent([], []))
    assert dict(p) == {} and str(p) == "{}" and len(p) == 0


def test_point_eq_hash_pickle():
    e = Extent(["a"], [3])
    assert Point(1, e) == Point(1, Extent(["a"], [3])) and hash(Point(1, e)) == hash(Point(1, e))
    assert Point(1, e) != Point(2, e)
    assert Point(1, e) != Point(1, Extent(["a"], [4]))  # same coords, different extent
    assert Point(1, e) == {"a": 1}
    assert pickle.loads(pickle.dumps(Point(2, e))) == Point(2, e)


def test_point_errors():
    e = Extent(["a"], [3])
    for bad in (-1, 3):
        with pytest.raises(IndexError, match="out of range"):
            Point(bad, e)
    with pytest.raises(KeyError):
        Point(0, e)["b"]
    with pytest.raises(TypeError, match="Extent"):
        Point(0, {"a": 3})  # type: ignore[arg-type]


# ---------------------------------------------------------------- Shape basics

def test_row_major_and_unity():
    s = Shape.row_major(["hosts", "gpus"], [2, 4], offset=10)
    assert s.labels == ("hosts", "gpus") and s.sizes == (2, 4) and s.strides == (4, 1)
    assert s.offset == 10 and s.nelements == len(s) == 8
    assert s.ranks() == list(range(10, 18))
    assert s.extent == Extent(["hosts", "gpus"], [2, 4])
    assert str(s) == "{hosts=2,gpus=4}"
    u = Shape.unity()
    assert u.ranks() == [0] and len(u) == 1 and str(u) == "{}" and u.rank_at(0) == 0 and u.index_of(0) == 0
    assert dict(u.point(0)) == {}


def test_shape_eq_hash_pickle_repr():
    s = Shape.row_major(["a", "b"], [2, 3])
    t = Shape(["a", "b"], 0, [2, 3], [3, 1])
    assert s == t and hash(s) == hash(t)
    assert s != Shape.row_major(["a", "b"], [2, 3], offset=1)
    assert pickle.loads(pickle.dumps(s.slice(b=slice(1, 3)))) == s.slice(b=slice(1, 3))
    assert eval(repr(s), {"Shape": Shape}) == s


def test_rank_at_index_of_point():
    s = Shape.row_major(["h", "g"], [3, 4]).slice(h=slice(1, 3), g=slice(0, 4, 2))
    assert s.ranks() == [4, 6, 8, 10]
    assert [s.rank_at(i) for i in range(4)] == [4, 6, 8, 10]
    assert [s.index_of(r) for r in (4, 6, 8, 10)] == [0, 1, 2, 3]
    for r in (0, 3, 5, 7, 12, -1, 100):
        with pytest.raises(ValueError, match="not in shape"):
            s.index_of(r)
    for i in (-1, 4):
        with pytest.raises(IndexError, match="out of range"):
            s.rank_at(i)
    p = s.point(3)
    assert dict(p) == {"h": 1, "g": 1} and p.extent == s.extent


def test_transposed_strides_are_supported():
    s = Shape(["a", "b"], 0, [3, 2], [1, 3])
    assert s.ranks() == [0, 3, 1, 4, 2, 5]
    assert [s.index_of(r) for r in s.ranks()] == list(range(6))


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((["a", "b"], 0, [2, 3], [2, 1]), ValueError, "map several points to one rank"),
        ((["a", "b"], 0, [2, 2], [0, 1]), ValueError, "map several points"),
        ((["a"], -1, [2], [1]), ValueError, "offset must be >= 0"),
        ((["a"], 0, [2], [-1]), ValueError, "stride of 'a' must be >= 0"),
        ((["a"], 0, [2], [1, 1]), ValueError, "1 labels"),
        ((["a", "a"], 0, [2, 2], [2, 1]), ValueError, "duplicate"),
    ],
)
def test_shape_constructor_validation(args, exc, match):
    with pytest.raises(exc, match=match):
        Shape(*args)


def test_empty_shape():
    s = Shape(["a"], 0, [0], [1])
    assert s.ranks() == [] and len(s) == 0
    with pytest.raises(ValueError):
        s.index_of(0)
    with pytest.raises(IndexError):
        s.rank_at(0)


# ---------------------------------------------------------------- slice

def test_slice_int_drops_slice_keeps():
    s = Shape.row_major(["hosts", "gpus"], [2, 4])
    t = s.slice(hosts=1, gpus=slice(1, 3))
    assert t.labels == ("gpus",) and t.sizes == (2,) and t.ranks() == [5, 6]
    assert s.slice(gpus=-1).ranks() == [3, 7]
    assert s.slice(hosts=slice(None), gpus=slice(None, None, 3)).ranks() == [0, 3, 4, 7]
    assert s.slice(hosts=0, gpus=0).ranks() == [0] and s.slice(hosts=0, gpus=0).labels == ()
    assert s.slice() == s


def test_slice_errors():
    s = Shape.row_major(["hosts", "gpus"], [2, 4])
    with pytest.raises(IndexError, match="index out of range"):
        s.slice(gpus=4)
    with pytest.raises(IndexError, match="index out of range"):
        s.slice(hosts=-3)
    with pytest.raises(TypeError, match=r"no dimension 'cpus'.*\['hosts', 'gpus'\]"):
        s.slice(cpus=0)
    with pytest.raises(TypeError, match="int or a slice"):
        s.slice(gpus="1")
    with pytest.raises(TypeError, match="int or a slice"):
        s.slice(gpus=True)
    with pytest.raises(ValueError, match="empty"):
        s.slice(gpus=slice(3, 1))
    with pytest.raises(ValueError, match="positive"):
        s.slice(gpus=slice(None, None, -1))


# Hypothesis model: each original dim keeps a list of original indices; slicing a
# shape is list indexing on those lists, and the expected ranks are the row-major
# enumeration of the full mesh filtered to the kept coordinates.
@st.composite
def _mesh_and_slices(draw):
    sizes = draw(st.lists(st.integers(1, 5), min_size=0, max_size=4))
    offset = draw(st.integers(0, 7))
    rounds = []
    remaining = list(range(len(sizes)))  # original dims still present
    kept = [list(range(n)) for n in sizes]
    for _ in range(draw(st.integers(1, 2))):
        sel = {}
        for d in list(remaining):
            n = len(kept[d])
            choice = draw(st.sampled_from(["skip", "int", "slice"]))
            if choice == "int":
                i = draw(st.integers(-n, n - 1))
                sel[f"d{d}"] = i
                kept[d] = [kept[d][i]]
                remaining.remove(d)
            elif choice == "slice":
                bound = st.none() | st.integers(-n - 1, n + 1)
                sl = slice(draw(bound), draw(bound), draw(st.none() | st.integers(1, 3)))
                if not kept[d][sl]:
                    continue  # empty selections are tested separately
                sel[f"d{d}"] = sl
                kept[d] = kept[d][sl]
        rounds.append(sel)
    return sizes, offset, rounds, kept, remaining


@FAST
@given(_mesh_and_slices())
def test_slicing_matches_filtered_row_major_enumeration(case):
    sizes, offset, rounds, kept, remaining = case
    shape = Shape.row_major([f"d{i}" for i in range(len(sizes))], sizes, offset=offset)
    strides = shape.strides
    for sel in rounds:
        shape = shape.slice(**sel)
    expected = [offset + sum(c * s for c, s in zip(coords, strides)) for coords in itertools.product(*kept)]
    assert shape.ranks() == expected
    assert shape.labels == tuple(f"d{d}" for d in remaining)
    assert shape.sizes == tuple(len(kept[d]) for d in remaining)
    assert [shape.rank_at(i) for i in range(len(shape))] == expected
    assert [shape.index_of(r) for r in expected] == list(range(len(expected)))
    members = set(expected)
    for r in range(offset + math.prod(sizes) + 2):
        if r not in members:
            with pytest.raises(ValueError):
                shape.index_of(r)
    assert pickle.loads(pickle.dumps(shape)) == shape


# ---------------------------------------------------------------- rename / split / flatten

def test_rename():
    s = Shape.row_major(["hosts", "gpus"], [2, 4])
    r = s.rename(hosts="dp", gpus="tp")
    assert r.labels == ("dp", "tp") and r.ranks() == s.ranks()
    assert s.rename(hosts="gpus", gpus="hosts").labels == ("gpus", "hosts")  # swap is fine
    with pytest.raises(TypeError, match="no dimension 'cpus'"):
        s.rename(cpus="x")
    with pytest.raises(ValueError, match="duplicate"):
        s.rename(hosts="gpus")
    with pytest.raises(TypeError, match="str"):
        s.rename(hosts=1)


def test_split_infers_one_size():
    s = Shape.row_major(["host", "gpu"], [32, 8])
    t = s.split(host=("dp", "pp"), pp=16)
    assert t.labels == ("dp", "pp", "gpu") and t.sizes == (2, 16, 8) and t.strides == (128, 8, 1)
    assert t.ranks() == s.ranks()
    u = s.split(host=("dp", "pp"), gpu=("tp", "cp"), pp=16, cp=2)
    assert dict(u.extent) == {"dp": 2, "pp": 16, "tp": 4, "cp": 2}
    assert s.split(host=("a", "b", "c"), a=2, b=4).sizes == (2, 4, 4, 8)
    assert s.split(host=("h",)) == s.rename(host="h")


def test_split_of_strided_view_keeps_ranks():
    s = Shape.row_major(["h", "g"], [2, 8]).slice(g=slice(0, 8, 2))
    t = s.split(g=("a", "b"), b=2)
    assert t.ranks() == s.ranks() == [0, 2, 4, 6, 8, 10, 12, 14]
    assert [t.index_of(r) for r in t.ranks()] == list(range(8))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"host": ("dp", "pp"), "pp": 5}, "not evenly divided"),
        ({"host": ("dp", "pp")}, "cannot infer the sizes of both"),
        ({"host": ("dp", "pp"), "dp": 2, "pp": 4}, "multiply to 8"),
        ({"host": ("dp", "gpu"), "dp": 4}, "duplicate dimension names"),
        ({"host": ("dp", "dp"), "dp": 4}, "duplicate dimension names"),
        ({"host": ("dp", "pp"), "pp": 4, "xx": 2}, "unused size constraints"),
        ({"host": "dp"}, "sequence of new dimension names"),
        ({"hots": ("a", "b"), "b": 2}, "'hots' is not a dimension"),
        ({"host": ("a", "b"), "b": 0}, "positive int"),
        ({"host": ("a", 1)}, "must be str"),
    ],
)
def test_split_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Shape.row_major(["host", "gpu"], [32, 8]).split(**kwargs)


def test_flatten():
    s = Shape.row_major(["h", "g"], [2, 4], offset=3)
    f = s.flatten("rank")
    assert f.labels == ("rank",) and f.sizes == (8,) and f.ranks() == s.ranks()
    assert s.slice(h=1).flatten("r").ranks() == [7, 8, 9, 10]
    assert s.slice(h=slice(1, 2)).flatten("r").ranks() == [7, 8, 9, 10]  # size-1 dim stride ignored
    assert Shape.unity().flatten("r").ranks() == [0]
    with pytest.raises(ValueError, match="cannot flatten sparse mesh"):
        s.slice(g=slice(0, 2)).flatten("r")
    with pytest.raises(ValueError, match="cannot flatten sparse mesh"):
        s.slice(g=slice(0, 4, 2)).flatten("r")
    with pytest.raises(TypeError, match="str"):
        s.flatten(3)


@FAST
@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 4), st.integers(0, 5))
def test_split_flatten_roundtrip(a, b, g, offset):
    s = Shape.row_major(["host", "gpu"], [a * b, g], offset=offset)
    t = s.split(host=("x", "y"), y=b)
    assert t.ranks() == s.ranks()
    assert t.flatten("all").ranks() == s.ranks()
    assert t.flatten("all") == s.flatten("all")


# ---------------------------------------------------------------- MeshTrait

class _Mesh(MeshTrait):
    def __init__(self, shape: Shape) -> None:
        self._shape = shape

    def _new_with_shape(self, shape: Shape) -> _Mesh:
        return _Mesh(shape)


def test_mesh_trait_operations():
    m = _Mesh(Shape.row_major(["hosts", "gpus"], [2, 4]))
    assert m.size() == 8 and m.size("gpus") == 4 and m.size(["hosts", "gpus"]) == 8 and m.size([]) == 1
    assert m.sizes == {"hosts": 2, "gpus": 4}
    assert m.extent == Extent(["hosts", "gpus"], [2, 4])
    s = m.slice(hosts=1, gpus=slice(1, 3))
    assert isinstance(s, _Mesh) and s._shape.ranks() == [5, 6] and s.sizes == {"gpus": 2}
    assert m.split(gpus=("a", "b"), b=2).sizes == {"hosts": 2, "a": 2, "b": 2}
    assert m.flatten("r").sizes == {"r": 8}
    assert m.rename(hosts="dp").sizes == {"dp": 2, "gpus": 4}
    assert m._labels == ("hosts", "gpus") and m.slice(hosts=0)._labels == ("gpus",)  # Monarch's docs use _labels
    with pytest.raises(KeyError, match="cpus"):
        m.size("cpus")
    with pytest.raises(TypeError, match="cpus"):
        m.slice(cpus=0)
    assert not hasattr(MeshTrait, "__len__")


def test_mesh_trait_requires_new_with_shape():
    class Bare(MeshTrait):
        _shape = Shape.row_major(["a"], [2])

    with pytest.raises(NotImplementedError, match="Bare must implement _new_with_shape"):
        Bare().slice(a=0)
