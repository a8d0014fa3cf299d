"""Serialisation: pickle protocol 5 with out-of-band buffers, cloudpickle for code.

``dumps(obj)`` returns a list of segments: the pickle stream first, then every
large buffer (numpy arrays, torch tensors, ``pickle.PickleBuffer``,
``memoryview``, and ``bytes``/``bytearray`` of 64 KiB or more) as its own
segment, referenced, not copied. ``loads(segments)`` reverses it; buffers that
arrive as writable memoryviews become the arrays' memory directly, and a
``bytes``/``bytearray`` segment received as that type (see _buffers.py) is the
value itself.

The C pickler writes ``bytes`` and ``bytearray`` inline before it consults any
hook, so large ones are found before pickling: as the value itself or inside
tuples, lists and dicts up to ``_WALK_DEPTH`` deep (looking at no more than
``_WALK_ITEMS`` items in all). Deeper, or inside other objects, they travel inline
(one copy on each side), as before.

Why two picklers: plain ``pickle`` is several times faster than cloudpickle for
the small messages that dominate traffic, but pickles classes and functions by
reference, which breaks for code defined in ``__main__`` or a notebook. Values
made only of builtin scalars take the fast path; anything else goes through
cloudpickle, which pickles by value what a worker cannot import.

torch is never imported here: tensors are handled only when the caller already
has torch loaded (``"torch" in sys.modules``).
"""

from __future__ import annotations

import ctypes
import io
import pickle
import sys
from collections import ChainMap
from collections.abc import Sequence
from typing import Any, SupportsIndex

import cloudpickle

from ._frames import Segment

__all__ = ["dumps", "loads", "SerializationError", "LostPayload"]

_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})
_ATOMS = frozenset({int, float, str, bool, type(None)})
# Buffers below this are cheaper inline than as a separate segment.
_OOB_MIN_BYTES = 4096
# bytes/bytearray from this size travel as segments of their own (received in place).
_OOB_BYTES_MIN = 64 * 1024
_WALK_DEPTH = 3
_WALK_ITEMS = 4096


class SerializationError(TypeError):
    """A value could not be pickled (a TypeError, as Monarch raises at the call site)."""


def _is_simple(obj: Any, depth: int = 2) -> bool:
    """Builtin scalars in (nested, up to ``depth``) tuples, lists and dicts."""
    t = type(obj)
    if t in _ATOMS:
        return True
    if t is bytes:
        return len(obj) < _OOB_BYTES_MIN  # a large one goes out of band: not simple
    if depth == 0:
        return False
    if t is tuple or t is list:
        for x in obj:
            if type(x) not in _ATOMS and not _is_simple(x, depth - 1):
                return False
        return True
    if t is dict:
        for k, v in obj.items():
            if type(k) not in _SCALARS or (type(v) not in _ATOMS and not _is_simple(v, depth - 1)):
                return False
        return True
    return False


class _Bytes:
    """Stands in for a large ``bytes``/``bytearray`` while pickling: sends it as a segment."""

    __slots__ = ("value",)

    def __init__(self, value: bytes | bytearray) -> None:
        self.value = value

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        rebuild = _as_bytes if type(self.value) is bytes else _as_bytearray
        return (rebuild, (pickle.PickleBuffer(self.value),))


def _as_bytes(buf: Any) -> bytes:
    # Received as a bytes segment: the value itself. Otherwise (shared memory, a relay) one copy.
    return buf if type(buf) is bytes else bytes(buf)


def _as_bytearray(buf: Any) -> bytearray:
    return buf if type(buf) is bytearray else bytearray(buf)


def _as_view(buf: Any, fmt: str, shape: tuple[int, ...] | None, writable: bool = False) -> memoryview:
    mv = memoryview(buf)
    if writable and mv.readonly:  # a small frame's copy (bytes): writable as it was sent
        mv = memoryview(bytearray(mv))
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if shape is None or (fmt == "B" and len(shape) == 1) or not mv.nbytes:
        return mv  # an empty view cannot be cast: it arrives as bytes
    return mv.cast(fmt, shape)  # type: ignore[call-overload]  # the sender's format: a str known only at run time


def _reduce_view(mv: memoryview) -> tuple[Any, ...]:
    if mv.nbytes >= _OOB_MIN_BYTES and mv.c_contiguous:
        shape = None if mv.format == "B" and mv.ndim == 1 else tuple(mv.shape or ())  # typeshed: Optional; CPython: never None
        return (_as_view, (pickle.PickleBuffer(mv), mv.format, shape, not mv.readonly))
    data = bytearray(mv.tobytes()) if not mv.readonly else mv.tobytes()
    return (_as_view, (data, mv.format, tuple(mv.shape or ()), not mv.readonly))


class _Walk:
    """One search for large bytes/bytearray in a value: a memo (one wrapper per object,
    so one that appears twice is sent once, as pickle would) and a budget of visits."""

    __slots__ = ("memo", "budget")

    def __init__(self) -> None:
        self.memo: dict[int, _Bytes] = {}
        self.budget = _WALK_ITEMS

    def wrap(self, obj: Any, depth: int = _WALK_DEPTH) -> Any:
        """``obj`` with each large bytes/bytearray in it (see module docstring) wrapped in :class:`_Bytes`."""
        t = type(obj)
        if t is bytes or t is bytearray:
            if len(obj) < _OOB_BYTES_MIN:
                return obj
            wrapper = self.memo.get(id(obj))
            if wrapper is None:
                wrapper = self.memo[id(obj)] = _Bytes(obj)
            return wrapper
        if depth == 0 or self.budget <= 0:
            return obj
        if t is tuple or t is list:
            self.budget -= len(obj)
            if self.budget < 0:
                return obj
            items = [self.wrap(x, depth - 1) for x in obj]
            if any(a is not b for a, b in zip(items, obj)):
                return tuple(items) if t is tuple else items
        elif t is dict:
            self.budget -= len(obj)
            if self.budget < 0:
                return obj
            values = {k: self.wrap(v, depth - 1) for k, v in obj.items()}
            if any(values[k] is not v for k, v in obj.items()):
                return values
        return obj


def _rebuild_tensor(buf: Any, dtype_name: str, shape: tuple[int, ...], requires_grad: bool, param: bool) -> Any:
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None:
        # a message decoded under a dispatch mode (inside the tensor engine's activate())
        # is still a local tensor: rebuild it with torch's modes off
        with _disable_current_modes():
            return _build_tensor(buf, dtype_name, shape, requires_grad, param)
    return _build_tensor(buf, dtype_name, shape, requires_grad, param)


def _build_tensor(buf: Any, dtype_name: str, shape: tuple[int, ...], requires_grad: bool, param: bool) -> Any:
    import torch

    dtype = getattr(torch, dtype_name)
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        mv = memoryview(buf)
        if mv.readonly:  # torch wants writable memory; small inline buffers only
            mv = memoryview(bytearray(mv))
        t = torch.frombuffer(mv, dtype=torch.uint8).view(dtype).reshape(shape)
    if param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _reduce_tensor(t: Any) -> tuple[Any, ...]:
    import torch

    param = isinstance(t, torch.nn.Parameter)
    requires_grad = bool(t.requires_grad)
    t = t.detach()
    if t.device.type != "cpu":  # like Monarch: tensors in messages arrive on CPU
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    dtype_name = str(t.dtype).removeprefix("torch.")
    if nbytes == 0:
        data: Any = b""
    elif nbytes < _OOB_MIN_BYTES:
        data = bytes((ctypes.c_char * nbytes).from_address(t.data_ptr()))
    else:
        raw = (ctypes.c_char * nbytes).from_address(t.data_ptr())
        raw._keepalive = t  # type: ignore[attr-defined]  # the buffer must not outlive the tensor
        data = pickle.PickleBuffer(raw)
    return (_rebuild_tensor, (data, dtype_name, tuple(t.shape), requires_grad, param))


_torch_pickler: type | None = None
_plain_pickler = type("_Pickler", (cloudpickle.Pickler,),
                      {"dispatch_table": ChainMap({memoryview: _reduce_view}, cloudpickle.Pickler.dispatch_table)})


def _pickler_class() -> type:
    """cloudpickle's Pickler, extended for tensors once torch is loaded.

    The C pickler reads ``dispatch_table`` at construction, so the table must be
    a class attribute, not set on an instance.
    """
    global _torch_pickler
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "nn"):
        return _plain_pickler
    if _torch_pickler is None:
        table = {torch.Tensor: _reduce_tensor, torch.nn.Parameter: _reduce_tensor, memoryview: _reduce_view}
        _torch_pickler = type(
            "_TensorPickler",
            (cloudpickle.Pickler,),
            {"dispatch_table": ChainMap(table, cloudpickle.Pickler.dispatch_table)},
        )
    return _torch_pickler


def dumps(obj: Any, *, out_of_band: bool = True) -> list[Segment]:
    """Pickle ``obj`` into segments: stream first, then out-of-band buffers.

    With ``out_of_band=False`` everything is in the one stream segment.
    Raises SerializationError (a TypeError) naming what could not be pickled.
    """
    segments: list[Segment] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if not out_of_band or raw.nbytes < _OOB_MIN_BYTES:
            return True  # serialise in-band
        owner = raw.obj
        # bytes/bytearray go as themselves: the receiver allocates that type (see _buffers.py)
        if (type(owner) is bytes or type(owner) is bytearray) and len(owner) == raw.nbytes:
            segments.append(owner)
        else:
            segments.append(raw)
        return False

    try:
        if _is_simple(obj):
            return [pickle.dumps(obj, protocol=5)]
        if out_of_band:
            obj = _Walk().wrap(obj)
        f = io.BytesIO()
        _pickler_class()(f, protocol=5, buffer_callback=keep).dump(obj)
        stream = f.getbuffer()
    except Exception as exc:
        raise SerializationError(f"cannot pickle {type(obj).__name__} value for sending: {exc}") from exc
    return [stream, *segments]


def loads(segments: Sequence[Segment]) -> Any:
    """Unpickle segments made by :func:`dumps` (buffers are used in place)."""
    if len(segments) == 1:
        return pickle.loads(segments[0])
    # A small frame's buffers arrive as bytes copies; arrays and views must be writable as sent.
    # (Large bytes values, the only bytes meant to stay bytes, are never this small.)
    buffers = [bytearray(b) if type(b) is bytes and len(b) < _OOB_BYTES_MIN else b for b in segments[1:]]
    return pickle.loads(segments[0], buffers=buffers)


class LostPayload:
    """Stands in for a frame's payload that this process could not take in.

    A frame handler gets ``[envelope, LostPayload]``: the envelope arrived, the
    payload did not (``error`` says why: out of descriptors or memory). The
    connection and the process live on; the layer above fails that one message.
    """

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error  # ShmExhausted or MemoryError; ``.resource`` names what ran out

    def __repr__(self) -> str:
        return f"<LostPayload {self.error}>"
