"""The worker's side of remote functions and actor ``rref`` calls.

Command kinds: 10 runs a remote function and stores its tensor results under
the refs the controller allocated; 11 calls this proc's member of an actor
mesh and stores what it returns. Both check the results against the shapes the
controller propagated: a mismatch poisons the outputs (the controller's
metadata would otherwise be wrong for every later op).

Two endpoints are added to the engine: ``call_remote`` (``f.call()`` and the
other adverbs: the plain result of one proc) and ``propagate_remote`` (the
output shapes of a function that cannot run on fake tensors, found by running
it once on this proc's shards, as Monarch's cached propagation does). They are
engine endpoints so they run on the engine's thread after every batch the
controller sent before them.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..mesh import NotAnEndpoint, as_endpoint
from ..runtime import endpoint
from ..transport import loads
from ._engine import HANDLERS, Failed, Poisoned, TensorEngine
from ._tensor import Ref

__all__ = ["FnRef", "MetaLeaf", "resolve_fn", "resolve_args"]

REMOTE, ACTOR_RREF = 10, 11

#: How long an rref command waits for the actor's answer (the engine is blocked meanwhile).
ACTOR_WAIT_S = 120.0

logger = logging.getLogger(__name__)
_fns: dict[Any, Any] = {}


class FnRef:
    """A function as a command names it: a dotted path, or cloudpickle bytes."""

    __slots__ = ("how", "what", "name")

    def __init__(self, how: str, what: Any, name: str) -> None:
        self.how, self.what, self.name = how, what, name

    def __reduce__(self) -> tuple[Any, ...]:
        return (FnRef, (self.how, self.what, self.name))


class MetaLeaf:
    """Stands for a tensor result in a propagation answer: its metadata only."""

    __slots__ = ("meta",)

    def __init__(self, meta: tuple[Any, ...]) -> None:
        self.meta = meta

    def __reduce__(self) -> tuple[Any, ...]:
        return (MetaLeaf, (self.meta,))


def import_path(path: str) -> Any:
    """``"pkg.mod.fn"`` or ``"pkg.mod:Class.fn"`` -> the object (ImportError/AttributeError if none)."""
    if ":" in path:
        mod, qual = path.split(":", 1)
        obj = importlib.import_module(mod)
    else:
        parts = path.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            qual = ".".join(parts[cut:])
            break
        else:
            raise ImportError(f"cannot import a function from {path!r}: give 'package.module.function'")
    for name in qual.split("."):
        obj = getattr(obj, name)
    return obj


def resolve_fn(ref: FnRef) -> Any:
    """The callable a FnRef names, imported or unpickled once per proc."""
    fn = _fns.get(ref.what)
    if fn is None:
        fn = import_path(ref.what) if ref.how == "path" else loads([ref.what])
        while not callable(fn) or hasattr(fn, "_remote_target"):
            target = getattr(fn, "_remote_target", None)  # a module-level @remote: take its function
            if target is None:
                raise TypeError(f"{ref.name} is not callable on the worker (got {type(fn).__name__})")
            fn = import_path(target) if isinstance(target, str) else target
        _fns[ref.what] = fn
    return fn


def _plain(x: Any) -> bool:
    """Only builtin tuples, lists and dicts as containers (the engine's own res() suffices)."""
    t = type(x)
    if t is tuple or t is list:
        return all(_plain(v) for v in x)
    if t is dict:
        return all(_plain(v) for v in x.values())
    return not isinstance(x, (tuple, list, dict))


def resolve_args(engine: TensorEngine, x: Any) -> Any:
    """Every Ref in a pytree replaced by its shard (Poisoned if one is Failed)."""
    if _plain(x):
        return engine.res(x)
    return pytree.tree_map(engine.res, x)  # res() also turns a GroupToken into this proc's group


def _tensor_leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]


def _describe(meta: tuple[Any, ...]) -> str:
    return f"{list(meta[0])} {meta[1]} on {meta[2]}"


def store_results(engine: TensorEngine, what: str, out: Any, outs: tuple[int, ...], checks: tuple[Any, ...], where: Any) -> None:
    """Put a function's tensor results under ``outs``, or poison them if they do not
    match the propagated (size, dtype, device type) in ``checks``."""
    if not outs:
        return
    got = _tensor_leaves(out)
    problem = None
    if len(got) != len(outs):
        problem = f"returned {len(got)} tensor(s) but its propagation said {len(outs)}"
    else:
        for i, (t, want) in enumerate(zip(got, checks)):
            have = (tuple(t.shape), t.dtype, t.device.type)
            if have != want:
                problem = f"returned a tensor {_describe(have)} as result {i}, but its propagation said {_describe(want)}"
                break
    if problem is not None:
        failed = Failed(engine.rank, f"{what} {problem}; make propagate=... return what the function returns", "", where)
        engine.fail(outs, failed)
        return
    for r, t in zip(outs, got):
        engine.table[r] = t


def _run_remote(engine: TensorEngine, cmd: tuple[Any, ...]) -> None:
    _, fnref, a, k, outs, checks, muts, sid, where = cmd
    if engine.member_index(sid) is None:
        return
    what = f"remote function {fnref.name}"
    try:
        fn = resolve_fn(fnref)
        out = fn(*resolve_args(engine, a), **resolve_args(engine, k))
    except Poisoned as p:
        engine.fail(outs, p.failed)
        engine.fail(muts, p.failed)
        return
    except Exception as exc:
        failed = engine.failure(what, exc, where)
        engine.fail(outs, failed)
        engine.fail(muts, failed)
        if not outs and not muts:
            logger.warning("rank %d: %s (no result to carry the error)\n%s", engine.rank, failed.message, failed.tb)
        return
    store_results(engine, what, out, outs, checks, where)


class _LocalShard:
    """A shard handed to an actor by the engine itself: the receiving actor gets
    the table's own tensor (seq 0: nothing to wait for, the engine is here)."""

    __slots__ = ("key", "ref")

    def __init__(self, key: str, ref: int) -> None:
        self.key, self.ref = key, ref

    def __reduce__(self) -> tuple[Any, ...]:
        from ._shard_ref import local_shard

        return (local_shard, (self.key, self.ref, 0))


def _shards_for_actor(engine: TensorEngine, x: Any) -> Any:
    def one(v: Any) -> Any:
        if type(v) is Ref:
            engine.res(v)  # raises Poisoned for a failed input
            return _LocalShard(engine.key, v.id)
        return v

    return pytree.tree_map(one, x)


def _run_actor_rref(engine: TensorEngine, cmd: tuple[Any, ...]) -> None:
    _, actors, method, a, k, outs, checks, muts, sid, where = cmd
    i = engine.member_index(sid)
    if i is None:
        return
    what = f"actor endpoint {method}"
    try:
        args, kwargs = _shards_for_actor(engine, a), _shards_for_actor(engine, k)
        shape = engine.shapes[sid]
        point = shape.point(i)
        member = actors.slice(**{label: point[label] for label in shape.labels})
        ep = getattr(member, method)
        if isinstance(ep, NotAnEndpoint):  # a plain method, called through as_endpoint(...)
            ep = as_endpoint(ep)
        out = ep.call_one(*args, **kwargs).get(timeout=ACTOR_WAIT_S)
    except Poisoned as p:
        engine.fail(outs, p.failed)
        engine.fail(muts, p.failed)
        return
    except Exception as exc:
        failed = engine.failure(what, exc, where)
        engine.fail(outs, failed)
        engine.fail(muts, failed)
        if not outs and not muts:
            logger.warning("rank %d: %s\n%s", engine.rank, failed.message, failed.tb)
        return
    store_results(engine, what, out, outs, checks, where)


def _cpu(x: Any) -> Any:
    return pytree.tree_map(lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, x)


def call_remote(self: TensorEngine, fnref: FnRef, args: Any, kwargs: Any, raise_errors: bool = False) -> Any:
    """Run a remote function on this proc's shards now; its plain result (tensors
    as CPU copies), or a Failed (raised instead with ``raise_errors``)."""
    try:
        with torch.no_grad():
            value = _cpu(resolve_fn(fnref)(*resolve_args(self, args), **resolve_args(self, kwargs)))
    except Poisoned as p:
        value = p.failed
    except Exception as exc:
        value = self.failure(f"remote function {fnref.name}", exc, None)
    if raise_errors and type(value) is Failed:
        raise value.as_exception()
    return value


def propagate_remote(self: TensorEngine, fnref: FnRef, args: Any, kwargs: Any) -> Any:
    """Run a function once on this proc's shards; answer (its result with each
    tensor replaced by a MetaLeaf, indices of mutated inputs), or a Failed."""
    from ._meta import meta_of

    try:
        a, k = resolve_args(self, args), resolve_args(self, kwargs)
        inputs = _tensor_leaves((a, k))
        before = [t._version for t in inputs]
        with torch.no_grad():
            out = resolve_fn(fnref)(*a, **k)
    except Poisoned as p:
        return p.failed
    except Exception as exc:
        return self.failure(f"remote function {fnref.name} (shape propagation on this proc)", exc, None)
    mutated = [i for i, t in enumerate(inputs) if t._version != before[i]]
    spec = pytree.tree_map(lambda v: MetaLeaf(meta_of(v)) if isinstance(v, torch.Tensor) else v, out)
    return spec, mutated


def _attach(name: str, fn: Any) -> None:
    prop = endpoint(fn)
    prop.name = name
    setattr(TensorEngine, name, prop)


_attach("call_remote", call_remote)
_attach("propagate_remote", propagate_remote)
HANDLERS[REMOTE] = _run_remote
HANDLERS[ACTOR_RREF] = _run_actor_rref
