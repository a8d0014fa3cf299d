"""Monarch's reduce semantics on a torch process group, poison agreement, and the
point-to-point exchange that moves tensors between meshes.

Every data movement is one of the backend's own collectives (all_reduce, all_gather,
reduce_scatter, all_to_all, isend/irecv); nothing here reduces values that arrived
as messages. Each wait is bounded by the backend's timeout (``Groups.timeout_s``); a
failure raises :class:`~actormesh.tensor._groups.CollectiveError` naming the group and
the op.

Shapes follow Monarch's ``_fake_reduce``: a reduction keeps the shape; ``stack``
adds an outer dim of the group size (ordered by group rank); ``scatter=True`` needs
an outer dim equal to the group size and drops it (my row of the reduction), except
``stack`` + ``scatter`` (all-to-all), which keeps the shape: row j of the result is
what group rank j held in its row for me.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from actormesh.tensor._groups import Groups, fail

__all__ = ["REDUCTIONS", "agree_ok", "collective", "exchange"]

REDUCTIONS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "stack")

_OPS = {
    "sum": ReduceOp.SUM, "avg": ReduceOp.SUM, "product": ReduceOp.PRODUCT,
    "min": ReduceOp.MIN, "max": ReduceOp.MAX,
    "band": ReduceOp.BAND, "bor": ReduceOp.BOR, "bxor": ReduceOp.BXOR,
}
# On bools, torch's own arithmetic is logical: True + True is True, so sum is "any"
# and product "all". The backends reduce bools as bytes holding 0 or 1.
_BOOL_OPS = {"sum": "max", "product": "min"}


def _wait(pg: ProcessGroup, op: str, start: Callable[[], Any]) -> None:
    """Start one backend op and wait for it (bounded by the backend timeout)."""
    try:
        work = start()
        if work is not None:
            work.wait()
    except (RuntimeError, OSError) as exc:
        raise fail(pg, op, exc) from exc


def _op_for(reduction: str, dtype: torch.dtype) -> tuple[Any, str]:
    """The ReduceOp for ``reduction`` on ``dtype``, or a ValueError naming the fix."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction {reduction!r} not supported, reductions are {REDUCTIONS}")
    if reduction in ("band", "bor", "bxor") and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(
            f"reduction {reduction!r} needs an integer or bool tensor, got {dtype}; "
            "use sum/min/max, or cast with .int()")
    if reduction == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(
            f"reduction 'avg' needs a floating point tensor, got {dtype}; cast with .float() "
            "first, or use 'sum'")
    if dtype.is_complex and reduction not in ("sum", "avg"):
        raise ValueError(f"reduction {reduction!r} is not defined on complex tensors ({dtype})")
    if dtype == torch.bool:
        reduction = _BOOL_OPS.get(reduction, reduction)
    return _OPS.get(reduction), reduction


def _wire(x: torch.Tensor) -> torch.Tensor:
    """A flat view the backend can reduce: bools as bytes, complex as pairs of reals."""
    flat = x.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    if flat.dtype.is_complex:
        return torch.view_as_real(flat).reshape(-1)
    return flat


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """A flat byte view: stack and all-to-all only move data, so any dtype goes."""
    return x.reshape(-1).view(torch.uint8)


def collective(
    t: torch.Tensor,
    pg: ProcessGroup,
    group_size: int,
    reduction: str = "sum",
    scatter: bool = False,
    inplace: bool = False,
) -> torch.Tensor:
    """Run Monarch's ``reduce(reduction, scatter)`` of ``t`` over ``pg``; return the result.

    ``inplace=True`` writes the result into ``t`` and returns ``t``; it is valid only
    where the result has ``t``'s shape (a reduction without scatter, or ``stack`` with
    scatter), else ValueError, as Monarch's ``reduce_``. Non-contiguous ``t`` works.
    Every member must call with the same reduction, scatter and shape.
    """
    if group_size != pg.size():
        raise ValueError(f"group_size {group_size} does not match the group's size {pg.size()}")
    op, effective = _op_for(reduction, t.dtype)
    if inplace and scatter != (reduction == "stack"):
        raise ValueError(
            f"reduction {reduction!r} with scatter={scatter} is not valid in place: the output "
            "size would not match the input size; use reduce() instead of reduce_()")
    if scatter and (t.dim() == 0 or t.size(0) != group_size):
        raise ValueError(
            f"when scattering, the outermost dimension of a tensor of size {list(t.shape)} must "
            f"match the group size ({group_size})")
    x = t.contiguous()
    if x.numel() == 0:  # every member has the same empty shape: nothing to move
        return _empty_result(t, x, group_size, reduction, scatter, inplace)
    if reduction == "stack":
        out = torch.empty_like(x) if scatter else x.new_empty((group_size, *x.shape))
        name = "all_to_all" if scatter else "all_gather"
        if scatter:
            _wait(pg, name, lambda: pg.alltoall_base(_bytes(out), _bytes(x), [], []))
        else:
            _wait(pg, name, lambda: pg._allgather_base(_bytes(out), _bytes(x)))
    elif scatter:
        out = x.new_empty(x.shape[1:])
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = op
        _wait(pg, "reduce_scatter",
              lambda: pg._reduce_scatter_base(_wire(out), _wire(x), opts))
    else:
        out = x if (inplace or x is not t) else x.clone()
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        _wait(pg, f"all_reduce({effective})", lambda: pg.allreduce([_wire(out)], opts))
    if reduction == "avg":
        out.div_(group_size)
    if inplace:
        if out is not t:
            t.copy_(out)
        return t
    return out


def _empty_result(
    t: torch.Tensor, x: torch.Tensor, group_size: int, reduction: str, scatter: bool, inplace: bool
) -> torch.Tensor:
    if inplace:
        return t
    if reduction == "stack":
        return torch.empty_like(x) if scatter else x.new_empty((group_size, *x.shape))
    return x.new_empty(x.shape[1:]) if scatter else x.clone()


def agree_ok(pg: ProcessGroup, ok: bool) -> list[int]:
    """Tell every member of ``pg`` which members' inputs failed; return their group ranks.

    Call it before each data collective, on every member: where the list is not
    empty, every member skips the data collective and marks its output failed, so
    none blocks in a collective another skipped. A tiny CPU all-gather.
    """
    mine = torch.tensor([1 if ok else 0], dtype=torch.uint8)
    every = torch.empty(pg.size(), dtype=torch.uint8)
    _wait(pg, "agree_ok (all_gather)", lambda: pg._allgather_base(every, mine))
    return [i for i, flag in enumerate(every.tolist()) if not flag]


def start_agree(pg: ProcessGroup, ok: bool) -> Callable[[], list[int]]:
    """:func:`agree_ok` posted without waiting: returns the wait. Posted just before
    the data collective on the same group, the two overlap instead of costing two
    round trips one after the other (a member whose input failed then runs the data
    collective on zeros, and everyone discards the result)."""
    mine = torch.tensor([1 if ok else 0], dtype=torch.uint8)
    every = torch.empty(pg.size(), dtype=torch.uint8)
    work = _start(pg, "agree_ok (all_gather)", lambda: pg._allgather_base(every, mine))

    def finish() -> list[int]:
        _wait(pg, "agree_ok (all_gather)", lambda: work)
        return [i for i, flag in enumerate(every.tolist()) if not flag]

    return finish


def exchange(
    groups: Groups,
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, Sequence[int], torch.dtype]],
    device_type: str = "cpu",
) -> list[torch.Tensor]:
    """Send and receive tensors point to point; return the received ones, in ``recvs`` order.

    ``sends`` are ``(dst_global_rank, tensor)``, ``recvs`` ``(src_global_rank, shape,
    dtype)``; received tensors live on ``device_type`` ("cuda": the current device). The k-th send from A to B matches B's k-th receive from A (tags count
    per peer), so both sides must list them in the same order. A send to myself is
    matched with my receive from myself by a local clone. Pair groups (sorted rank
    pairs) are built in ascending order on every proc, so their rendezvous cannot
    deadlock; then all sends are posted, then all receives, then all are awaited.
    """
    me = groups.my_rank
    local = [t for dst, t in sends if dst == me]
    to_self = sum(1 for src, *_ in recvs if src == me)
    if to_self != len(local):
        raise ValueError(
            f"rank {me} sends {len(local)} tensor(s) to itself but receives {to_self} from "
            "itself; list each self-transfer once in sends and once in recvs")
    device = torch.device(device_type)
    peers = sorted({r for r, *_ in list(sends) + list(recvs) if r != me})
    pairs = {p: groups.group(tuple(sorted((me, p))), device_type) for p in peers}
    pending: list[tuple[ProcessGroup, str, Any]] = []
    sent: dict[int, int] = {}
    for dst, t in sends:
        if dst == me:
            continue
        pg, tag = pairs[dst], sent.get(dst, 0)
        sent[dst] = tag + 1
        x = t.contiguous()
        name = f"isend to rank {dst}"
        pending.append((pg, name, _start(pg, name, lambda: pg.send([_bytes(x)], 1 - pg.rank(), tag))))
    got: dict[int, int] = {}
    out: list[torch.Tensor] = []
    for src, shape, dtype in recvs:
        if src == me:
            out.append(local.pop(0).clone())
            continue
        pg, tag = pairs[src], got.get(src, 0)
        got[src] = tag + 1
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        name = f"irecv from rank {src}"
        pending.append((pg, name, _start(pg, name, lambda: pg.recv([_bytes(buf)], 1 - pg.rank(), tag))))
        out.append(buf)
    for pg, name, work in pending:
        _wait(pg, name, lambda: work)
    return out


def _start(pg: ProcessGroup, op: str, start: Callable[[], Any]) -> Any:
    try:
        return start()
    except (RuntimeError, OSError) as exc:
        raise fail(pg, op, exc) from exc
