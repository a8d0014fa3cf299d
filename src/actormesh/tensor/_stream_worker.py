"""Streams and borrows on the workers: command kinds 20-22 (see ``_stream.py``).

With CUDA each stream id is a ``torch.cuda.Stream`` of this proc (0 is the
device's default stream) and the engine thread's current stream follows the
controller's ``SET_STREAM`` commands. A borrow makes the borrowing stream wait
for the origin stream (and tells the caching allocator the storage is used
there); its drop makes the origin stream wait for the borrower, so the origin
sees every write and may reuse the memory. Without CUDA (or for CPU tensors)
commands run in order anyway and these commands only manage the ref table.
"""

from __future__ import annotations

from typing import Any

import torch

from ._engine import HANDLERS, Failed, TensorEngine
from ._stream import BORROW, BORROW_DROP, SET_STREAM

__all__: list[str] = []

_cuda: list[bool] = []


def _has_cuda() -> bool:
    if not _cuda:
        _cuda.append(torch.cuda.is_available())
    return _cuda[0]


def _cuda_stream(engine: TensorEngine, sid: int) -> Any:
    streams = engine.extra.setdefault("cuda_streams", {})
    s = streams.get(sid)
    if s is None:
        s = streams[sid] = torch.cuda.default_stream() if sid == 0 else torch.cuda.Stream()
    return s


def _set_stream(engine: TensorEngine, cmd: tuple[Any, ...]) -> None:
    _, stream_id = cmd
    if _has_cuda():
        torch.cuda.set_stream(_cuda_stream(engine, stream_id))


def _borrow(engine: TensorEngine, cmd: tuple[Any, ...]) -> None:
    _, ref, origin, from_id, to_id, sid = cmd
    if engine.member_index(sid) is None:
        return
    value = engine.table.get(origin)
    if value is None:
        value = Failed(engine.rank, f"borrow: tensor ref {origin} is not defined on rank {engine.rank} (deleted)", "", None)
    engine.table[ref] = value  # the same storage (a Failed passes on as it is)
    if _has_cuda() and isinstance(value, torch.Tensor) and value.is_cuda:
        to = _cuda_stream(engine, to_id)
        to.wait_stream(_cuda_stream(engine, from_id))
        value.record_stream(to)


def _borrow_drop(engine: TensorEngine, cmd: tuple[Any, ...]) -> None:
    _, ref, origin, from_id, to_id, mutable, sid = cmd
    if engine.member_index(sid) is None:
        return
    value = engine.table.get(ref)
    if mutable and type(value) is Failed and origin in engine.table:
        engine.table[origin] = value  # a failed write on the borrowing stream poisons the origin
    if _has_cuda() and isinstance(value, torch.Tensor) and value.is_cuda:
        _cuda_stream(engine, from_id).wait_stream(_cuda_stream(engine, to_id))


HANDLERS[SET_STREAM] = _set_stream
HANDLERS[BORROW] = _borrow
HANDLERS[BORROW_DROP] = _borrow_drop
