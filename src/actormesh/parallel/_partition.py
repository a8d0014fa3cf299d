"""Exact contiguous partitioning of a layer sequence into pipeline stages.

:func:`partition` splits ``n`` layers into ``num_stages`` contiguous, non-empty
stages so that the slowest stage is as fast as possible, optionally under a
per-stage memory limit and with stages of different speeds. The answer is
exact (not a heuristic): a bisection over the bit patterns of non-negative
floats finds the smallest bottleneck ``T`` for which a feasibility check
succeeds, and the check itself is exact.

Feasibility of a bottleneck ``T`` is decided by reachability: ``R[i]`` is the
set of layer positions ``p`` such that stages ``0..i-1`` can cover exactly
layers ``[0, p)``. For a fixed start ``a`` the ends that stage ``i`` may take
form an interval ``(a, f(a)]`` (costs and memory are non-negative, so
shrinking a stage never breaks it), and ``f`` is non-decreasing, so ``R[i]``
stays a short union of intervals that is computed with binary searches. A
start is useless only where its single layer does not fit stage ``i`` (too
slow for the stage's speed, or over its memory limit); those positions split
the intervals. Each check costs ``O(k log n)`` in the usual case, so 1,000
layers by 64 stages take a few tens of milliseconds.

Stage time is ``(P[stop] - P[start]) / speed`` where ``P`` holds the
floating-point prefix sums of the costs; the optimum is exact with respect to
that evaluation (see :func:`stage_times`).

Example:
    >>> partition([1, 1, 1, 1, 4], 2)
    [range(0, 4), range(4, 5)]
    >>> partition([4, 1, 1, 1, 1], 2, speeds=[2.0, 1.0])
    [range(0, 2), range(2, 5)]
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["LayerCost", "even_split", "partition", "stage_memory", "stage_times"]


@dataclass(frozen=True)
class LayerCost:
    """Measured cost of one layer (block) of a model.

    ``forward_backward_s`` is the wall time of one forward plus backward pass
    of the layer on the profiling batch; ``param_bytes`` the bytes of its
    parameters; ``activation_bytes`` the bytes it keeps alive for backward
    (saved tensors, parameters excluded); ``output_bytes`` the bytes of its
    output (what a pipeline stage ending here sends, and what tensor
    parallelism all-reduces).

    Example:
        >>> LayerCost(0.002, 4096, 8192, name="blocks.0").memory_bytes
        12288
    """

    forward_backward_s: float
    param_bytes: int = 0
    activation_bytes: int = 0
    name: str = ""
    output_bytes: int = 0

    @property
    def memory_bytes(self) -> int:
        """Parameter plus activation bytes: the default per-layer memory of :func:`partition`."""
        return self.param_bytes + self.activation_bytes


Cost = float | int | LayerCost


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _label(j: int, names: Sequence[str]) -> str:
    return f"layer {j} ({names[j]!r})" if names[j] else f"layer {j}"


def _check_values(values: Sequence[float], what: str, names: Sequence[str]) -> list[float]:
    out = []
    for j, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{what} of {_label(j, names)} must be a number, got {type(v).__name__}")
        v = float(v)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{what} of {_label(j, names)} must be finite and >= 0, got {v}")
        out.append(v)
    return out


def _per_stage(value: float | Sequence[float] | None, k: int, what: str, positive: bool) -> list[float] | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        vals: list[float] = [value] * k
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        vals = list(value)
    else:
        raise TypeError(f"{what} must be a number or one number per stage, got {type(value).__name__}")
    if len(vals) != k:
        raise ValueError(f"{what} has {len(vals)} entries, expected one per stage ({k})")
    out = []
    for i, v in enumerate(vals):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{what}[{i}] must be a number, got {type(v).__name__}")
        v = float(v)
        if math.isnan(v) or v < 0 or (positive and (v == 0 or math.isinf(v))):
            raise ValueError(f"{what}[{i}] must be {'finite and > 0' if positive else '>= 0'}, got {v}")
        out.append(v)
    return out


def _prefix(values: Sequence[float]) -> list[float]:
    p = [0.0]
    for v in values:
        p.append(p[-1] + v)
    return p


def _sparse(values: list[float], op: Callable[[float, float], float]) -> list[list[float]]:
    """Sparse table: ``t[l][j] = op`` over ``values[j : j + 2**l]``."""
    table, w = [values], 1
    while 2 * w <= len(values):
        prev = table[-1]
        table.append([op(prev[j], prev[j + w]) for j in range(len(values) - 2 * w + 1)])
        w *= 2
    return table


def _skip(table: list[list[float]], x: int, end: int, over: Callable[[float], bool]) -> int:
    """First ``j`` in ``[x, end)`` with ``not over(values[j])`` (``table`` of range minima), else ``end``."""
    while x < end:
        lvl = (end - x).bit_length() - 1
        while lvl >= 0 and not over(table[lvl][x]):
            lvl -= 1
        if lvl < 0:
            return x
        x += 1 << lvl  # every layer in this block is over
    return end


class _Problem:
    """Prefix sums and per-stage limits of one partition instance."""

    def __init__(self, costs: list[float], mem: list[float], speeds: list[float], limits: list[float]) -> None:
        self.n, self.k = len(costs), len(speeds)
        self.P, self.M = _prefix(costs), _prefix(mem)
        self.speeds, self.limits = speeds, limits
        cc = [self.P[j + 1] - self.P[j] for j in range(self.n)]
        mm = [self.M[j + 1] - self.M[j] for j in range(self.n)]
        # range maxima find the next layer that does not fit a stage; range minima the next that does
        self.cmax, self.mmax = _sparse(cc, max), _sparse(mm, max)
        self.cmin, self.mmin = _sparse(cc, min), _sparse(mm, min)

    def fits(self, a: int, b: int, i: int, t: float) -> bool:
        """Whether layers ``[a, b)`` fit stage ``i`` under bottleneck ``t``."""
        return (self.P[b] - self.P[a]) / self.speeds[i] <= t and self.M[b] - self.M[a] <= self.limits[i]

    def next_blocked(self, x: int, end: int, i: int, t: float) -> int:
        """First ``j`` in ``[x, end)`` whose single layer does not fit stage ``i``, else ``end``."""
        s, lim, tc, tm = self.speeds[i], self.limits[i], self.cmax, self.mmax
        while x < end:
            lvl = (end - x).bit_length() - 1
            # jump over the largest power-of-two block whose layers all fit
            while lvl >= 0 and (tc[lvl][x] / s > t or tm[lvl][x] > lim):
                lvl -= 1
            if lvl < 0:
                return x
            x += 1 << lvl
        return end

    def next_fitting(self, x: int, end: int, i: int, t: float) -> int:
        """First ``j`` in ``[x, end)`` whose single layer fits stage ``i``, else ``end``."""
        s, lim = self.speeds[i], self.limits[i]
        while x < end:
            y = _skip(self.cmin, x, end, lambda v: v / s > t)  # past layers too slow for the stage
            y = _skip(self.mmin, y, end, lambda v: v > lim)  # past layers too large for it
            if y == x:
                return x
            x = y
        return end

    def reach(self, y: int, hi: int, i: int, t: float) -> int:
        """Largest ``b`` in ``[y+1, hi]`` with ``[y, b)`` fitting stage ``i`` (``y+1`` is known to fit)."""
        lo = y + 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(y, mid, i, t):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def reachable(self, t: float) -> tuple[list[list[tuple[int, int]]], int]:
        """``R[i]`` for ``i = 0..k`` as merged closed intervals, and the furthest position reached."""
        n, k = self.n, self.k
        rs: list[list[tuple[int, int]]] = [[(0, 0)]]
        furthest = 0
        for i in range(k):
            cap = n - (k - 1 - i)  # leave one layer for each later stage
            new: list[tuple[int, int]] = []
            for lo, hi in rs[-1]:
                hi = min(hi, cap - 1)
                x = lo
                while x <= hi:
                    nb = self.next_blocked(x, hi + 1, i, t)
                    if nb > x:  # starts x..nb-1 all fit: union of (a, f(a)] is (x, f(nb-1)]
                        new.append((x + 1, self.reach(nb - 1, cap, i, t)))
                    x = self.next_fitting(nb + 1, hi + 1, i, t)
            new.sort()
            merged: list[tuple[int, int]] = []
            for lo, hi in new:
                if merged and lo <= merged[-1][1] + 1:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
                else:
                    merged.append((lo, hi))
            if not merged:
                return rs, furthest
            furthest = max(furthest, merged[-1][1])
            rs.append(merged)
        return rs, furthest

    def split(self, t: float) -> list[range] | None:
        """A split with every stage within ``t``, or ``None`` when there is none."""
        rs, _ = self.reachable(t)
        if len(rs) <= self.k or rs[self.k][-1][1] != self.n:
            return None
        stages: list[range] = []
        b = self.n
        for i in range(self.k - 1, -1, -1):
            # smallest start a in R[i] with [a, b) fitting stage i: later stages take as much as they may
            lo, hi = 0, b - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if self.fits(mid, b, i, t):
                    hi = mid
                else:
                    lo = mid + 1
            a = next(max(lo, ilo) for ilo, ihi in rs[i] if ihi >= lo and max(lo, ilo) < b)
            stages.append(range(a, b))
            b = a
        stages.reverse()
        return stages

    def bottleneck(self, stages: Sequence[range]) -> float:
        return max((self.P[r.stop] - self.P[r.start]) / self.speeds[i] for i, r in enumerate(stages))


def _costs_and_names(costs: Sequence[Cost]) -> tuple[list[float], list[str], list[float] | None]:
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence):
        raise TypeError(f"costs must be a sequence of numbers or LayerCost, got {type(costs).__name__}")
    names = [c.name if isinstance(c, LayerCost) else "" for c in costs]
    raw = [c.forward_backward_s if isinstance(c, LayerCost) else c for c in costs]
    mem = None
    if costs and all(isinstance(c, LayerCost) for c in costs):
        mem = [float(c.memory_bytes) for c in costs]  # type: ignore[union-attr]
    return _check_values(raw, "cost", names), names, mem


def partition(
    costs: Sequence[Cost],
    num_stages: int,
    *,
    memory: Sequence[float] | None = None,
    memory_limit: float | Sequence[float] | None = None,
    speeds: Sequence[float] | None = None,
) -> list[range]:
    """Split layers into ``num_stages`` contiguous stages minimising the slowest stage.

    ``costs`` are per-layer times (numbers or :class:`LayerCost`). Stage ``i``
    takes ``sum(costs[start:stop]) / speeds[i]`` (``speeds`` default to 1).
    ``memory`` gives per-layer bytes (default: ``param_bytes +
    activation_bytes`` of LayerCosts); ``memory_limit`` caps each stage's sum,
    as one number or one per stage. Returns ``num_stages`` ranges covering
    ``range(len(costs))`` in order, none empty. Ties between optimal splits go
    to the one whose later stages are as large as allowed.

    Raises ValueError for ``num_stages`` outside ``1..len(costs)``, negative
    or non-finite costs or memory, a layer too large for every stage's memory
    limit (named), or limits that no contiguous split can meet.

    Example:
        >>> partition([3, 1, 1, 1, 2, 2], 3)
        [range(0, 1), range(1, 4), range(4, 6)]
        >>> partition([1, 1, 1, 1], 2, memory=[3, 1, 1, 1], memory_limit=[3, 4])
        [range(0, 1), range(1, 4)]
    """
    cost_values, names, default_mem = _costs_and_names(costs)
    n = len(cost_values)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int):
        raise TypeError(f"num_stages must be an int, got {type(num_stages).__name__}")
    if n == 0:
        raise ValueError("costs is empty: there are no layers to partition")
    if not 1 <= num_stages <= n:
        raise ValueError(f"num_stages must be between 1 and the number of layers ({n}), got {num_stages}")
    k = num_stages
    speed_list = _per_stage(speeds, k, "speeds", positive=True) or [1.0] * k
    mem, limits = _memory_and_limits(memory, memory_limit, default_mem, names, n, k)
    prob = _Problem(cost_values, mem, speed_list, limits)
    best = prob.split(math.inf)
    if best is None:
        _, furthest = prob.reachable(math.inf)
        raise ValueError(
            f"no split of {n} layers into {k} contiguous stages meets the memory limits "
            f"{[f'{x:g}' for x in limits]}: at most layers [0, {furthest}) fit in order, so "
            f"{_label(furthest, names)} onwards cannot be placed "
            f"(total memory {sum(mem):g}, sum of limits {sum(limits):g})"
        )
    # smallest float bit pattern t with a feasible split; the answer is a stage time, so exact
    lo, hi = -1, _bits(prob.bottleneck(best))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        cand = prob.split(_float(mid))
        if cand is None:
            lo = mid
        else:
            best = cand
            hi = _bits(prob.bottleneck(cand))  # jump to the achieved value (<= mid)
    return best


def _memory_and_limits(memory: Sequence[float] | None, memory_limit: float | Sequence[float] | None, default_mem: list[float] | None,
                       names: Sequence[str], n: int, k: int) -> tuple[list[float], list[float]]:
    """Per-layer memory and per-stage limits, checked: every layer fits some stage."""
    limits = _per_stage(memory_limit, k, "memory_limit", positive=False)
    if memory is not None:
        if isinstance(memory, (str, bytes)) or len(memory) != n:
            raise ValueError(f"memory must have one entry per layer ({n})")
        mem = _check_values(memory, "memory", names)
    elif limits is not None:
        if default_mem is None:
            raise ValueError("memory_limit needs per-layer memory: pass memory=[...] or LayerCost costs")
        mem = default_mem
    else:
        mem = [0.0] * n
    limits = limits or [math.inf] * k
    biggest = max(limits)
    for j, m in enumerate(mem):
        if m > biggest:
            raise ValueError(
                f"{_label(j, names)} needs {m:g} bytes of memory, more than any stage's limit "
                f"(largest {biggest:g}): it cannot fit in any stage"
            )
    return mem, limits


def stage_times(costs: Sequence[Cost], stages: Sequence[range], speeds: Sequence[float] | None = None) -> list[float]:
    """Time of each stage, evaluated exactly as :func:`partition` does.

    Example:
        >>> stage_times([1, 2, 3], [range(0, 2), range(2, 3)])
        [3.0, 3.0]
    """
    values, _, _ = _costs_and_names(costs)
    p = _prefix(values)
    s = list(speeds) if speeds is not None else [1.0] * len(stages)
    return [(p[r.stop] - p[r.start]) / s[i] for i, r in enumerate(stages)]


def stage_memory(memory: Sequence[float], stages: Sequence[range]) -> list[float]:
    """Sum of per-layer ``memory`` in each stage.

    Example:
        >>> stage_memory([1, 2, 3], [range(0, 1), range(1, 3)])
        [1.0, 5.0]
    """
    p = _prefix([float(m) for m in memory])
    return [p[r.stop] - p[r.start] for r in stages]


def even_split(num_layers: int, num_stages: int) -> list[range]:
    """Split by layer count (the common default): the first ``num_layers % num_stages`` stages get one more.

    Example:
        >>> even_split(13, 4)
        [range(0, 4), range(4, 7), range(7, 10), range(10, 13)]
    """
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"num_stages must be between 1 and num_layers ({num_layers}), got {num_stages}")
    q, r = divmod(num_layers, num_stages)
    out, start = [], 0
    for i in range(num_stages):
        stop = start + q + (1 if i < r else 0)
        out.append(range(start, stop))
        start = stop
    return out
