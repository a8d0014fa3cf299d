"""Free remote functions: ``@remote`` functions run on every proc of the active
mesh, on that proc's shards.

``f(*args)`` records one command and returns distributed tensors at once, shaped
by *propagation* (Monarch's modes):

- ``"cached"`` (the default): run the function itself on fake tensors here once
  per input metadata and remember the output spec; a function that cannot run
  on fake tensors (``.item()``, numpy, process groups) is run once on the first
  proc's real shards instead, as Monarch always does;
- a callable ``propagate(*args, **kwargs)``: given fake tensors, returns fake
  results (or plain values); run on every call;
- ``"inspect"``: the function returns no tensors (call it for its effects, or
  read its value with ``f.call()``); ``f(*args)`` returns None;
- ``"mocked"``: not supported (Monarch raises NotImplementedError too).

``f.call()`` and the other adverbs run it on each proc through the engine, after
every tensor command issued before them, and return its plain results.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..mesh import Endpoint, ValueMesh, with_shape
from ..runtime import Future
from ..transport import dumps
from ._activate import active_view
from ._client import View, client_for, local_torch, raise_failed
from ._fetch import shard_index
from ._meta import fake_from_meta, fake_mode, meta_of
from ._process_group import RemoteProcessGroup
from ._remote_worker import FnRef, MetaLeaf, import_path
from ._tensor import Tensor, _where

__all__ = ["remote", "Remote", "call_on_shard_and_fetch", "scan_args", "spec_from_fake", "make_outputs"]

_MODES = (None, "cached", "inspect", "mocked")
#: Longest wait for a worker to propagate a function that fake tensors cannot run.
PROPAGATE_WAIT_S = 600.0
_NO_MESH = "Calling a remote function requires an active proc mesh: use `with mesh.activate():` (or pass distributed tensors)"


def _check_propagate(propagate: Any) -> None:
    if propagate not in _MODES and not callable(propagate):
        raise TypeError(f"propagate must be a callable, 'cached', 'inspect' or 'mocked', got {propagate!r}")


def _fn_ref(target: Any) -> FnRef:
    """Name the function by module path when the worker can import it, else pickle it."""
    if isinstance(target, str):
        return FnRef("path", target, target)
    mod, qual = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    name = f"{mod}.{qual}" if mod and qual else repr(target)
    if mod and qual and mod != "__main__" and "<" not in qual:
        try:
            obj = import_path(f"{mod}:{qual}")
        except (ImportError, AttributeError):
            obj = None
        if obj is target or getattr(obj, "_remote_target", None) is target:
            return FnRef("path", f"{mod}:{qual}", name)
    blob = b"".join(bytes(s) for s in dumps(target, out_of_band=False))
    return FnRef("pickle", blob, name)


# -- arguments --------------------------------------------------------------------------------
class Scanned:
    """A call's arguments: encoded for the workers, with their distributed tensors and view."""

    __slots__ = ("args", "kwargs", "tensors", "view", "key")

    def __init__(self, args: Any, kwargs: Any, tensors: list[Tensor], view: View, key: Any) -> None:
        self.args, self.kwargs, self.tensors, self.view, self.key = args, kwargs, tensors, view, key


_FLAT = (int, float, bool, str, type(None))


def _flat_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
    """The arguments as leaves when they are only tensors and scalars (no pytree needed)."""
    leaves = list(args)
    if kwargs:
        leaves.extend(kwargs.values())
    for x in leaves:
        if type(x) not in _FLAT and not isinstance(x, torch.Tensor):
            return None
    return leaves


def scan_args(what: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, need_view: bool = True) -> Scanned:
    """Check and encode ``args``: distributed tensors become refs. TypeError for a
    local, dropped or other-mesh tensor; ValueError with no mesh to run on."""
    flat = _flat_leaves(args, kwargs)
    if flat is not None:  # the common case: skips pytree (~40 us)
        leaves, spec = flat, ("flat", len(args), tuple(kwargs))
    else:
        leaves, spec = pytree.tree_flatten((args, kwargs))
    ambient = active_view()
    tensors: list[Tensor] = []
    enc: list[Any] = []
    key: list[Any] | None = [spec]
    for i, x in enumerate(leaves):
        if type(x) is Tensor:
            if x.dropped:
                raise TypeError(f"{what}: argument {i} is DROPPED: it was deleted with t.drop() and can no longer be used")
            tensors.append(x)
            enc.append(x._ref)
            if key is not None:
                key.append(x._meta)
        elif isinstance(x, torch.Tensor):
            raise TypeError(f"{what}: argument {i} is a LOCAL_TENSOR (not distributed); create it inside "
                            "`with mesh.activate():`, or pass it as a plain value (e.g. a list)")
        else:
            enc.append(x)
            if key is not None:
                try:
                    hash(x)
                    key.append((type(x), x))
                except TypeError:
                    key = None
    view: Any = tensors[0]._view if tensors else ambient  # None only where no mesh is needed
    if view is None and need_view:
        raise ValueError(f"{what}: {_NO_MESH}")
    for t in tensors:
        if t._view is not view:
            raise TypeError(f"{what}: WRONG_MESH: a tensor of mesh {dict(t._view.procs.sizes)} used on mesh "
                            f"{dict(view.procs.sizes)}; move it with t.to_mesh(...) or activate its mesh")
    if ambient is not None and view is not ambient:
        raise TypeError(f"{what}: WRONG_MESH: tensors of mesh {dict(view.procs.sizes)} used while mesh "
                        f"{dict(ambient.procs.sizes)} is active; move them with t.to_mesh(...) or activate their mesh")
    if flat is not None:
        n = len(args)
        a, k = tuple(enc[:n]), dict(zip(kwargs, enc[n:]))
    else:
        a, k = pytree.tree_unflatten(enc, spec)
    return Scanned(a, k, tensors, view, None if key is None else tuple(key))


def _fakes(call: Scanned, args: Any, kwargs: Any) -> tuple[Any, Any, list[torch.Tensor]]:
    fakes = {id(t): fake_from_meta(t._meta) for t in call.tensors}

    def swap(x: Any) -> Any:
        if type(x) is Tensor:
            return fakes[id(x)]
        if isinstance(x, RemoteProcessGroup):
            return dummy_group(x.size())
        return x

    fa, fk = pytree.tree_map(swap, (args, kwargs))
    return fa, fk, [fakes[id(t)] for t in call.tensors]


def has_group(args: Any, kwargs: Any) -> bool:
    return any(isinstance(x, RemoteProcessGroup) for x in pytree.tree_leaves((args, kwargs)))


def spec_from_fake(fn: Callable[..., Any], call: Scanned, args: Any, kwargs: Any) -> tuple[Any, list[int]]:
    """Run ``fn`` on fake stand-ins of the arguments: (result with each tensor as a
    MetaLeaf, indices of the distributed inputs it wrote in place)."""
    with local_torch():
        fa, fk, fakes = _fakes(call, args, kwargs)
        before = [f._version for f in fakes]
        with fake_mode():
            out = fn(*fa, **fk)
        mutated = [i for i, f in enumerate(fakes) if f._version != before[i]]
        spec = pytree.tree_map(lambda v: MetaLeaf(meta_of(v)) if isinstance(v, torch.Tensor) else v, out)
    return spec, mutated


def make_outputs(spec: Any, view: View) -> tuple[Any, tuple[int, ...], tuple[Any, ...]]:
    """Distributed tensors for each MetaLeaf of ``spec``: (result, their refs, their checks)."""
    if type(spec) is MetaLeaf:  # one tensor: the common case, without pytree
        t = Tensor._make(spec.meta, view)
        return t, (t._ref.id,), ((tuple(spec.meta[0]), spec.meta[3], torch.device(spec.meta[4]).type),)
    refs: list[int] = []
    checks: list[Any] = []

    def one(v: Any) -> Any:
        if type(v) is not MetaLeaf:
            return v
        t = Tensor._make(v.meta, view)
        refs.append(t._ref.id)
        checks.append((tuple(v.meta[0]), v.meta[3], torch.device(v.meta[4]).type))
        return t

    result = pytree.tree_map(one, spec, is_leaf=lambda v: type(v) is MetaLeaf)
    return result, tuple(refs), tuple(checks)


# -- the remote function ----------------------------------------------------------------------
class Remote:
    """A function that runs on the procs of the active mesh (see the module doc).

    >>> @remote(propagate=lambda x: x)            # doctest: +SKIP
    ... def double(x): return x * 2
    >>> with procs.activate():                    # doctest: +SKIP
    ...     y = double(torch.ones(3))             # a distributed tensor
    ...     print(double.call(1).get())           # ValueMesh of each proc's 2
    """

    def __init__(self, target: Callable[..., Any] | str, propagate: Any = None) -> None:
        if not (callable(target) or isinstance(target, str)):
            raise TypeError(f"remote() takes a function or a 'package.module.function' path, got {target!r}")
        _check_propagate(propagate)
        self._remote_target = target
        self._propagate = propagate
        self._ref: FnRef | None = None
        self._cache: dict[Any, tuple[Any, list[int]]] = {}
        if callable(target):
            functools.update_wrapper(self, target)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"<remote {self._fnref().name}>"

    def _fnref(self) -> FnRef:
        if self._ref is None:
            self._ref = _fn_ref(self._remote_target)
        return self._ref

    def _local_fn(self) -> Callable[..., Any] | None:
        """The function here, for fake propagation (None: only the workers can import it)."""
        t = self._remote_target
        if isinstance(t, str):
            try:
                return import_path(t)
            except (ImportError, AttributeError):
                return None
        return t

    # -- f(*args): distributed results -----------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run on every proc of the mesh; distributed tensors of the results, at once."""
        return self.rref(*args, **kwargs)

    def rref(self, *args: Any, **kwargs: Any) -> Any:
        """Same as calling it: record the call, return the results as distributed tensors."""
        ref = self._fnref()
        call = scan_args(f"remote function {ref.name}", args, kwargs)
        spec, mutated = self._spec(call, args, kwargs)
        result, outs, checks = make_outputs(spec, call.view)
        muts = tuple(call.tensors[i]._ref.id for i in mutated)
        call.view.client.record((10, ref, call.args, call.kwargs, outs, checks, muts, call.view.sid, _where()))
        return result

    def _spec(self, call: Scanned, args: Any, kwargs: Any) -> tuple[Any, list[int]]:
        p = self._propagate
        if p == "inspect":
            return None, []
        if p == "mocked":
            raise NotImplementedError("propagate='mocked' is not supported (nor by Monarch): give propagate=fn "
                                      "returning fake results, or use the default 'cached'")
        if callable(p):
            return spec_from_fake(p, call, args, kwargs)
        hit = self._cache.get(call.key) if call.key is not None else None
        if hit is not None:
            return hit
        fn = self._local_fn()
        try:
            found = spec_from_fake(fn, call, args, kwargs) if fn is not None else None
        except Exception:
            found = None
        if found is None:  # not importable here, or cannot run on fake tensors: ask the first proc
            if has_group(args, kwargs):  # one proc alone would wait forever in the collective
                raise ValueError(f"remote function {self._fnref().name} takes a process group and cannot run on fake "
                                 "tensors here (with the group mocked); give propagate=fn returning its fake results")
            found = self._spec_on_worker(call)
        if call.key is not None:
            self._cache[call.key] = found
        return found

    def _spec_on_worker(self, call: Scanned) -> tuple[Any, list[int]]:
        view = call.view
        client = view.client
        client.flush()
        fut = client.member(view.shape.rank_at(0)).propagate_remote.call_one(self._fnref(), call.args, call.kwargs)
        try:
            answer = raise_failed(fut.then(lambda v: v, local_torch).get(timeout=PROPAGATE_WAIT_S))
        except TimeoutError:
            raise TimeoutError(f"remote function {self._fnref().name}: shape propagation on rank {view.shape.rank_at(0)} "
                               f"took over {PROPAGATE_WAIT_S:.0f} s; give propagate=fn to skip it") from None
        spec, mutated = answer
        return spec, list(mutated)

    # -- adverbs: plain results, ordered with the tensor commands ---------------------------
    def _engine_ep(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Endpoint[..., Any], tuple[Any, ...]]:
        ref = self._fnref()
        call = scan_args(f"remote function {ref.name}", args, kwargs)
        if self._propagate == "mocked":
            raise NotImplementedError("propagate='mocked' is not supported (nor by Monarch)")
        client = call.view.client
        client.flush()  # everything issued before runs first on every proc
        engine = with_shape(client.engine, call.view.shape)
        return engine.call_remote, (ref, call.args, call.kwargs)

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh[Any]]:
        """Run on every proc of the active mesh; a ValueMesh of the plain results."""
        ep, a = self._engine_ep(args, kwargs)
        return ep.call(*a).then(_raise_any, local_torch)

    def call_one(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run on the only proc of a one-proc mesh (ValueError otherwise)."""
        ep, a = self._engine_ep(args, kwargs)
        return ep.call_one(*a).then(raise_failed, local_torch)

    def choose(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run on one proc of the active mesh chosen at random."""
        ep, a = self._engine_ep(args, kwargs)
        return ep.choose(*a).then(raise_failed, local_torch)

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Future[Any]]:
        """Run on every proc; one Future per proc, completed in arrival order."""
        ep, a = self._engine_ep(args, kwargs)
        return iter([f.then(raise_failed, local_torch) for f in ep.stream(*a)])

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Run on every proc for its effects; no answer (a failure is logged by the worker)."""
        ref = self._fnref()
        call = scan_args(f"remote function {ref.name}", args, kwargs)
        call.view.client.record((10, ref, call.args, call.kwargs, (), (), (), call.view.sid, _where()))
        call.view.client.flush()

    def _send(self, args: tuple[Any, ...], kwargs: dict[str, Any], port: Any = None, selection: str = "all") -> None:
        """``send(f, args, kwargs, port=...)``: each proc's result (or error) goes to ``port``."""
        ep, a = self._engine_ep(tuple(args), dict(kwargs))
        ep._send((*a, True), {}, port, selection)


def _raise_any(values: ValueMesh[Any]) -> ValueMesh[Any]:
    for v in values.values():
        raise_failed(v)
    return values


def remote(function: Any = None, *, propagate: Any = None) -> Any:
    """Make ``function`` (or ``"package.module.function"``) a remote function.

    Works as ``@remote``, ``@remote(propagate=...)`` and ``remote("mod.fn", propagate=...)``.
    """
    if function is None:
        _check_propagate(propagate)
        return functools.partial(remote, propagate=propagate)
    return Remote(function, propagate)


def call_on_shard_and_fetch(remote: Remote, *args: Any, shard: dict[str, int] | None = None, **kwargs: Any) -> Future[Any]:
    """Run ``remote`` on one proc (``shard``: its coordinates, default 0 on every dim)
    after everything issued before; a Future of its local result."""
    if not isinstance(remote, Remote):
        raise TypeError(f"call_on_shard_and_fetch needs a remote function (actormesh.remote), got {remote!r}")
    ref = remote._fnref()
    call = scan_args(f"remote function {ref.name}", args, kwargs)
    index = shard_index(call.view, shard, {})
    client = call.view.client
    client.flush()
    member = client.member(call.view.shape.rank_at(index))
    return member.call_remote.call_one(ref, call.args, call.kwargs).then(raise_failed, local_torch)


_dummy_groups: dict[int, Any] = {}


def dummy_group(size: int) -> Any:
    """A torch ProcessGroup whose collectives return their input at once: stands for
    a RemoteProcessGroup while a function runs on fake tensors (as Monarch mocks it)."""
    group = _dummy_groups.get(size)
    if group is None:
        import torch.distributed as dist

        class _Done:
            def __init__(self, value: Any) -> None:
                self.value = value

            def wait(self, timeout: Any = None) -> Any:
                return self.value

            def is_completed(self) -> bool:
                return True

        class DummyGroup(dist.ProcessGroup):  # type: ignore[misc]
            def allreduce(self, tensors: Any, opts: Any = None) -> Any:
                return _Done(tensors)

            def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:
                return _Done(output)

            def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:
                return _Done(output)

            def broadcast(self, tensors: Any, opts: Any = None) -> Any:
                return _Done(tensors)

        group = _dummy_groups[size] = DummyGroup(0, size)
    return group
