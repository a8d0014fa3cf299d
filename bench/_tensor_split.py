"""Per-op cost split of ``t = t + 1`` for ``bench.tensor_bench`` (measured in-process).

Each part is the difference between two runs of the same loop of ``n`` ops,
so the parts add up to the controller's own time per op:

- ``interception``: a TorchDispatchMode that returns a cached wrapper tensor
  (torch's Python-dispatch floor; no engine code runs);
- ``dispatch``: the engine's dispatch with the propagation cache warm (argument
  scan and checks, cache lookup, output handle, the dead handle's release),
  with recording stubbed out, minus the floor;
- ``encode``: the same with recording real (the command tuple, the issuing
  line via ``_where()``, the queue append), minus ``dispatch``;
- ``send``: ``flush()`` of the ``n`` queued commands (pickling + broadcast) / n;
  all these are CPU time of the controller thread (``time.thread_time``), so
  other load on the machine does not inflate them; best of the rounds;
- worker: unpickling that batch and running it on a ``TensorEngine`` built
  in-process (as a worker's ``run`` does), per op; ``drain`` is the time from
  the flush returning until ``inspect`` returns, seen from the controller.

Auxiliary figures: ``propagate()`` alone on a cache hit, ``Tensor._make``
alone. Touches private engine names on purpose (this is a profile of them);
everything patched is restored.
"""

from __future__ import annotations

import gc
import pickle
import threading
import time
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import actormesh.tensor._client as _client
import actormesh.tensor._tensor as _tensor
from actormesh.tensor._engine import TensorEngine
from actormesh.tensor._meta import propagate


class _Wrapper(torch.Tensor):
    """A bare wrapper subclass (no engine code), the floor's cached output."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return NotImplemented  # never reached: the mode runs first and answers


class _Floor(TorchDispatchMode):
    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out


def _floor_dispatch(self: _Floor, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    return self.out


# the engine's own mode takes the plain function too (no dynamo wrapper): same floor
_Floor.__torch_dispatch__ = _floor_dispatch  # type: ignore[method-assign]


#: CPU time of this thread: what an op costs, whatever else the shared machine runs
clock = time.thread_time


def _loop(t: Any, n: int) -> tuple[Any, float]:
    gc.collect()
    t0 = clock()
    for _ in range(n):
        t = t + 1
    return t, clock() - t0


def floor_us(n: int) -> float:
    w = torch.Tensor._make_wrapper_subclass(_Wrapper, (4, 4), dtype=torch.float32)
    with _Floor(w):
        _, dt = _loop(w, n)
    return dt / n * 1e6


@contextmanager
def _no_auto_flush() -> Any:
    old = _client.FLUSH_EVERY
    _client.FLUSH_EVERY = 1 << 40
    try:
        yield
    finally:
        _client.FLUSH_EVERY = old


def _stubbed_us(procs: Any, t: Any, n: int) -> float:
    client = t._view.client
    where = _tensor._where
    client.record = lambda cmd: None  # instance attribute shadows the method
    _tensor._where = lambda: None
    try:
        with _no_auto_flush(), procs.activate():
            _, dt = _loop(t, n)
    finally:
        del client.record
        _tensor._where = where
        client._deletes.clear()  # refs the workers never saw
    return dt / n * 1e6


def _lookup_us(t: Any, n: int) -> tuple[float, float]:
    """``propagate`` on a cache hit and ``Tensor._make`` alone, per call."""
    func = torch.ops.aten.add.Tensor
    key = (t._meta, int, 1, func)
    propagate(func, (t, 1), {}, [t], key)
    t0 = clock()
    for _ in range(n):
        spec = propagate(func, (t, 1), {}, [t], key)
    lookup = clock() - t0
    client, view = t._view.client, t._view
    deletes = len(client._deletes)
    t0 = clock()
    for _ in range(n):
        _tensor.Tensor._make(spec.single, view)
    make = clock() - t0
    del client._deletes[deletes:]  # those handles were never recorded
    return lookup / n * 1e6, make / n * 1e6


def worker_run_us(batch: list[Any], first_ref: int, shape: Any, sid: int) -> tuple[float, float]:
    """(unpickle, run) microseconds per command of ``batch`` on an in-process engine."""
    e = TensorEngine.__new__(TensorEngine)
    e.rank, e.table, e.shapes, e.index = shape.rank_at(0), {first_ref: torch.zeros(4, 4)}, {sid: shape}, {}
    e.cond, e.done, e.extra = threading.Condition(), 0, {}
    blob = pickle.dumps(batch, protocol=5)
    gc.collect()
    t0 = clock()
    batch = pickle.loads(blob)
    t1 = clock()
    TensorEngine.__dict__["run"]._fn(e, 1, {}, batch)  # the endpoint's own function
    t2 = clock()
    return (t1 - t0) / len(batch) * 1e6, (t2 - t1) / len(batch) * 1e6


def _recorded(procs: Any, t: Any, n: int, fetch: Any) -> dict[str, Any]:
    """The real loop without auto-flush, then one flush of it and the wait for the workers."""
    client = t._view.client
    with _no_auto_flush():
        with procs.activate():
            u, dt = _loop(t, n)
            batch = list(client._pending)
            w0, c0 = time.perf_counter(), clock()
            client.flush()
            send_cpu, send_wall = clock() - c0, time.perf_counter() - w0
        w1 = time.perf_counter()
        fetch(u)
        drain = time.perf_counter() - w1
    return {"full": dt, "send": send_cpu, "send_wall": send_wall, "drain": drain, "batch": batch}


def split(procs: Any, n: int, fetch: Any, reps: int = 3) -> dict[str, float]:
    """The cost split on ``procs`` (engine running): microseconds per op, the best of
    ``reps`` rounds for each part, the parts taking turns round by round."""
    with procs.activate():
        t = torch.zeros(4, 4)
        t = t + 1  # propagation cache warm for this op and metadata
    fetch(t)
    runs: dict[str, list[float]] = {k: [] for k in ("floor", "stubbed", "full", "send", "send_wall", "drain", "lookup",
                                                     "make", "unpickle", "run")}
    for _ in range(reps):
        runs["floor"].append(floor_us(n))
        runs["stubbed"].append(_stubbed_us(procs, t, n))
        rec = _recorded(procs, t, n, fetch)
        for k in ("full", "send", "send_wall", "drain"):
            runs[k].append(rec[k] / n * 1e6)
        lookup, make = _lookup_us(t, n)
        runs["lookup"].append(lookup)
        runs["make"].append(make)
        unpickle, run = worker_run_us(rec["batch"], t._ref.id, t._view.shape, t._view.sid)
        runs["unpickle"].append(unpickle)
        runs["run"].append(run)
    b = {k: min(v) for k, v in runs.items()}
    return {"interception_us": b["floor"], "dispatch_us": b["stubbed"] - b["floor"], "encode_us": b["full"] - b["stubbed"],
            "send_us": b["send"], "send_wall_us": b["send_wall"], "controller_total_us": b["full"] + b["send"],
            "propagate_hit_us": b["lookup"], "make_handle_us": b["make"], "drain_us": b["drain"],
            "worker_unpickle_us": b["unpickle"], "worker_run_us": b["run"], "batch_commands": n,
            "rounds": {k: [round(x, 2) for x in v] for k, v in runs.items()}}
