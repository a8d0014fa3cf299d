"""Serialisation: pickle protocol 5 with out-of-band buffers, cloudpickle for code.

``dumps(obj)`` returns a list of segments: the pickle stream first, then every
large buffer (numpy arrays, torch tensors, ``pickle.PickleBuffer``) as its own
segment, referenced, not copied. ``loads(segments)`` reverses it; buffers that
arrive as writable memoryviews become the arrays' memory directly.

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
from typing import Any

import cloudpickle

from ._frames import Segment

__all__ = ["dumps", "loads", "SerializationError"]

_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})
# Buffers below this are cheaper inline than as a separate segment.
_OOB_MIN_BYTES = 4096


class SerializationError(TypeError):
    """A value could not be pickled (a TypeError, as Monarch raises at the call site)."""


def _is_simple(obj: Any, depth: int = 2) -> bool:
    """Builtin scalars in (nested, up to ``depth``) tuples, lists and dicts."""
    t = type(obj)
    if t in _SCALARS:
        return True
    if depth == 0:
        return False
    if t is tuple or t is list:
        for x in obj:
            if type(x) not in _SCALARS and not _is_simple(x, depth - 1):
                return False
        return True
    if t is dict:
        for k, v in obj.items():
            if type(k) not in _SCALARS or (type(v) not in _SCALARS and not _is_simple(v, depth - 1)):
                return False
        return True
    return False


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


def _pickler_class() -> type:
    """cloudpickle's Pickler, extended for tensors once torch is loaded.

    The C pickler reads ``dispatch_table`` at construction, so the table must be
    a class attribute, not set on an instance.
    """
    global _torch_pickler
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "nn"):
        return cloudpickle.Pickler
    if _torch_pickler is None:
        table = {torch.Tensor: _reduce_tensor, torch.nn.Parameter: _reduce_tensor}
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
    buffers: list[pickle.PickleBuffer] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if not out_of_band or raw.nbytes < _OOB_MIN_BYTES:
            return True  # serialise in-band
        buffers.append(buf)
        return False

    try:
        if _is_simple(obj):
            stream = pickle.dumps(obj, protocol=5)
        else:
            f = io.BytesIO()
            _pickler_class()(f, protocol=5, buffer_callback=keep).dump(obj)
            stream = f.getbuffer()
    except Exception as exc:
        raise SerializationError(f"cannot pickle {type(obj).__name__} value for sending: {exc}") from exc
    segments: list[Segment] = [stream]
    for b in buffers:
        segments.append(b.raw())
    return segments


def loads(segments: Sequence[Segment]) -> Any:
    """Unpickle segments made by :func:`dumps` (buffers are used in place)."""
    return pickle.loads(segments[0], buffers=segments[1:])
