"""The distributed tensor handle: one shard per proc of a mesh, known on the
controller only by its metadata and a reference number.

Every aten op on a handle (or, inside ``activate()``, every aten op at all)
comes to :func:`dispatch`, which checks the arguments, answers the output
metadata from the propagation cache, allocates output handles and queues one
command; nothing waits for a worker.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import torch

from . import _stream
from ._meta import _INPUT, _NEW, DataDependent, meta_of, propagate

__all__ = ["Tensor", "Ref", "dispatch", "is_lift"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIFT = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
_SCALARS = (int, float, bool, str, type(None), complex)


class Ref:
    """A reference number standing for a shard in a command (the worker's ref table key)."""

    __slots__ = ("id",)

    def __init__(self, id: int) -> None:
        self.id = id

    def __reduce__(self) -> tuple[Any, ...]:
        return (Ref, (self.id,))

    def __repr__(self) -> str:
        return f"Ref({self.id})"


class Tensor(torch.Tensor):
    """A distributed tensor: one shard per proc of ``t.mesh``.

    Made by torch calls inside ``mesh.activate()``; shapes, dtypes and devices
    are known here, values only on the workers (``actormesh.inspect(t)``).

    >>> with procs.activate():                    # doctest: +SKIP
    ...     t = torch.ones(2, 2) * 3
    >>> actormesh.inspect(t)                      # doctest: +SKIP
    tensor([[3., 3.], [3., 3.]])
    """

    __torch_function__ = torch._C._disabled_torch_function_impl
    _meta: tuple
    _view: Any
    _ref: Ref

    @staticmethod
    def _make(meta: tuple, view: Any) -> Tensor:
        size, stride, offset, dtype, device = meta
        r = torch.Tensor._make_wrapper_subclass(Tensor, size, strides=stride, storage_offset=offset, dtype=dtype, device=device)
        r._meta = meta
        r._view = view
        r._ref = Ref(view.client.new_ref())
        r._dropped = False
        if _stream.tag is not None:  # made inside `with other_stream.activate():`
            r._stream = _stream.tag
        return r

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return dispatch(func, args, kwargs or {}, None)

    # -- Monarch's tensor API ---------------------------------------------------------------
    @property
    def mesh(self) -> Any:
        """The proc mesh (view) this tensor lives on."""
        return self._view.procs

    @property
    def stream(self) -> Any:
        """The stream this tensor belongs to (see :class:`actormesh.Stream`)."""
        return _stream.stream_of(self)

    def drop(self) -> None:
        """Free the remote storage now; later use raises TypeError (DROPPED)."""
        if not self.__dict__.get("_dropped", True):
            self._dropped = True
            self._view.client.release(self._ref.id)

    @property
    def dropped(self) -> bool:
        """True once :meth:`drop` was called."""
        return self.__dict__.get("_dropped", False)

    def reduce(self, dims: Any, reduction: str = "sum", scatter: bool = False, mesh: Any = None, _inplace: bool = False, out: Any = None) -> Tensor:
        """Collective over mesh dims (see :func:`actormesh.reduce`)."""
        from ._reduce import reduce_tensor

        return reduce_tensor(self, dims, reduction, scatter, mesh, _inplace, out)

    def reduce_(self, dims: Any, reduction: str = "sum", scatter: bool = False, mesh: Any = None) -> Tensor:
        """In-place :meth:`reduce`."""
        return self.reduce(dims, reduction, scatter, mesh, _inplace=True)

    def to_mesh(self, mesh: Any, stream: Any = None) -> Tensor:
        """Copy this tensor onto ``mesh`` (same dim sizes; extra dims are broadcast)."""
        from ._reduce import move_to_mesh

        return move_to_mesh(self, self._view, mesh)

    def slice_mesh(self, **coords: Any) -> Any:
        """The shards at ``coords`` only, to be moved with ``.to_mesh(other)``."""
        from ._reduce import MeshSliceTensor

        return MeshSliceTensor(self, self._view.procs.slice(**coords))

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Passed to an actor: each member gets its own proc's shard.
        from ._shard_ref import shard_ref_for

        return shard_ref_for(self)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        size = list(self._meta[0])
        return f"actormesh.Tensor(shape={size}, dtype={self.dtype}, device={self.device}, mesh={dict(self._view.procs.sizes)})"

    def __del__(self) -> None:
        d = self.__dict__
        if not d.get("_dropped", True):
            d["_dropped"] = True
            d["_view"].client.release(d["_ref"].id)


_errors = threading.local()

_BINARY = ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv", "rfloordiv", "mod", "rmod",
           "pow", "rpow", "matmul", "rmatmul", "and", "rand", "or", "ror", "xor", "rxor", "lshift", "rlshift", "rshift",
           "rrshift", "eq", "ne", "lt", "le", "gt", "ge", "iadd", "isub", "imul", "itruediv", "ipow")


def _keep_error(name: str) -> Any:
    """torch turns a TypeError inside a binary operator into NotImplemented, so Python
    reports "unsupported operand"; re-raise the engine's own message instead."""
    base = getattr(torch.Tensor, name)

    def op(self: Tensor, other: Any) -> Any:
        _errors.last = None
        result = base(self, other)
        if result is NotImplemented:
            error = _errors.last
            if error is not None:
                _errors.last = None
                raise error
        return result

    op.__name__ = name
    return op


for _name in _BINARY:
    if hasattr(torch.Tensor, f"__{_name}__"):
        setattr(Tensor, f"__{_name}__", _keep_error(f"__{_name}__"))


def is_lift(func: Any) -> bool:
    return func in _LIFT


_internal_file: dict[str, bool] = {}
def _where() -> tuple[str, int] | None:
    """The first caller frame outside torch and actormesh: the line that issued the op.

    Probes ``sys._getframe(depth)`` rather than walking ``f_back``: on 3.11 that
    builds a frame object only for the probed frame, not for each one between.
    """
    internal = _internal_file
    getframe = sys._getframe
    for depth in range(2, 60):
        try:
            f = getframe(depth)
        except ValueError:
            return None
        code = f.f_code
        name = code.co_filename
        inside = internal.get(name)
        if inside is None:
            inside = internal[name] = name.startswith(_TORCH_DIR) or name.startswith(_HERE) or name.startswith("<frozen")
        if not inside:
            return (name, f.f_lineno)
    return None


class _Scan:
    """One pass over an op's arguments: encode them, collect the distributed
    tensors and the cache key, and find the first problem."""

    __slots__ = ("ins", "key", "problems", "lift")

    def __init__(self, lift: bool) -> None:
        self.ins: list[Tensor] = []
        self.key: list[Any] | None = []
        self.problems: list[tuple[str, Any]] = []
        self.lift = lift

    def enc(self, x: Any, where: Any) -> Any:
        t = type(x)
        if t is Tensor:
            self.ins.append(x)
            if self.key is not None:
                self.key.append(x._meta)
            if x.__dict__.get("_dropped"):
                self.problems.append((where, "DROPPED: this tensor was deleted with t.drop() and can no longer be used"))
            return x._ref
        if t in _SCALARS:
            if self.key is not None:
                self.key.append(t)
                self.key.append(x)
            return x
        if t is list or t is tuple:
            if self.key is not None:
                self.key.append(t)
                self.key.append(len(x))
            return t([self.enc(e, where) for e in x])
        if isinstance(x, torch.Tensor):
            if self.lift:
                self.key = None
                return x.detach().clone()  # a constant the controller made (torch.tensor([...]))
            self.problems.append((where, "LOCAL_TENSOR: a local (non-distributed) tensor used with distributed ones; "
                                  "create it inside `with mesh.activate():`, or compute locally under `with no_mesh.activate():`"))
            return x
        if self.key is not None:
            try:
                hash(x)
                self.key.append(x)
            except TypeError:
                self.key = None
        return x


def _check(func: Any, scan: _Scan, ambient: Any) -> Any:
    view = scan.ins[0]._view if scan.ins else ambient
    if view is None:
        raise TypeError(f"{func}: no distributed tensor among its arguments and no active mesh; use `with mesh.activate():`")
    if ambient is not None and view is not ambient:
        scan.problems.append(("argument", f"WRONG_MESH: a tensor of mesh {dict(view.procs.sizes)} used while mesh "
                              f"{dict(ambient.procs.sizes)} is active; move it with t.to_mesh(...) or activate its mesh"))
    for t in scan.ins:
        if t._view is not view:
            scan.problems.append(("argument", f"WRONG_MESH: tensors of different meshes ({dict(view.procs.sizes)} and "
                                  f"{dict(t._view.procs.sizes)}) in one op; move one with t.to_mesh(...)"))
            break
    if scan.problems:
        lines = "\n".join(f"  {'arg ' + str(where) if isinstance(where, int) else where}: {what}" for where, what in scan.problems)
        error = TypeError(f"Incorrect arguments to actormesh operation {func}:\n{lines}")
        _errors.last = error
        raise error
    return view


_op_info: dict[Any, tuple[str, bool, bool, int]] = {}


def dispatch(func: Any, args: Any, kwargs: dict[str, Any], ambient: Any) -> Any:
    """Record ``func(*args, **kwargs)`` on the mesh of its tensors (or ``ambient``)."""
    info = _op_info.get(func)
    if info is None:
        info = _op_info[func] = (str(func), func in _LIFT, func.namespace == "profiler", _view_source(func))
    name, lift, local, alias = info
    if local:
        return func(*args, **kwargs)  # record_function markers: local bookkeeping only
    scan = _Scan(lift)
    enc = scan.enc
    enc_args = tuple([enc(a, i) for i, a in enumerate(args)])
    enc_kwargs = {k: scan.enc(v, k) for k, v in kwargs.items()} if kwargs else kwargs
    if _stream.live:  # streams or borrows in use: their rules first (they explain DROPPED better)
        try:
            _stream.check(func, scan.ins, args, kwargs)
        except TypeError as error:
            _errors.last = error  # kept through binary operators (see _keep_error)
            raise
    view = _check(func, scan, ambient)
    if _stream.live:
        _stream.announce(view.client)
    if scan.lift:
        return _constant(view, enc_args[0])
    key = None
    if scan.key is not None:
        scan.key.append(func)
        key = tuple(scan.key)
    try:
        spec = propagate(func, args, kwargs, scan.ins, key)
    except DataDependent:
        return _value_from_first(view, func, args, kwargs, enc_args, enc_kwargs)
    client = view.client
    if spec.single is not None:
        out = Tensor._make(spec.single, view)
        if alias >= 0:
            _stream.alias(args[alias], out)
        client.record((0, name, enc_args, enc_kwargs, (out._ref.id,), view.sid, _where()))
        return out
    leaves: list[Any] = []
    outs: list[int | None] = []
    for kind, what in spec.leaves:
        if kind == _NEW:
            t = Tensor._make(what, view)
            if alias >= 0:
                _stream.alias(args[alias], t)
            leaves.append(t)
            outs.append(t._ref.id)
        elif kind == _INPUT:
            leaves.append(scan.ins[what])
            outs.append(None)
        else:
            leaves.append(what)
            outs.append(None)
    if any(o is not None for o in outs) or func._schema.is_mutable:
        client.record((0, name, enc_args, enc_kwargs, tuple(outs), view.sid, _where()))
    from torch.utils import _pytree as pytree

    return pytree.tree_unflatten(leaves, spec.treespec)


def _view_source(func: Any) -> int:
    """The position of the argument a view op's outputs alias (-1: not a view op)."""
    schema = func._schema
    outs = {a for r in schema.returns if r.alias_info is not None and not r.alias_info.is_write for a in r.alias_info.before_set}
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and not a.alias_info.is_write and outs & set(a.alias_info.before_set):
            return i
    return -1


def _constant(view: Any, value: torch.Tensor) -> Tensor:
    out = Tensor._make(meta_of(value), view)
    view.client.record((1, out._ref.id, value, view.sid))
    return out


def _value_from_first(view: Any, func: Any, args: Any, kwargs: Any, enc_args: Any, enc_kwargs: Any) -> Any:
    """``.item()``, ``bool(t)`` and other data-dependent results: ask the first proc."""
    if func._schema.is_mutable or any(isinstance(r.type, torch.TensorType) for r in func._schema.returns):
        raise TypeError(
            f"{func} has an output shape that depends on the tensor's values, which the controller cannot know; "
            "run it inside a remote function with propagate=... (actormesh.remote), or fetch the tensor with inspect()"
        )
    return view.client.value_on(view, 0, str(func), enc_args, enc_kwargs)
