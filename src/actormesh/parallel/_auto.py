"""Pick dp/fsdp/tp/pp degrees and pipeline stage boundaries from a measured profile.

:func:`auto_plan` profiles the model here (at the sample batch size and a
quarter of it: per-layer ``time = fixed + per_sample * n``), enumerates the
factorisations ``dp * fsdp * tp * pp = world size`` valid for the model and
batch, splits blocks into stages with :func:`partition`, predicts step time
and memory per rank, and picks the fastest plan within the memory limit.
Cost model (details in docs/partitioner.md):

* step = ``sum of stage times + (m - 1) * slowest`` per microbatch (compute
  at the microbatch size ``/ tp``, TP all-reduces: 2 forward + 2 backward per
  block, pipeline sends; balanced stages give ``(m + pp - 1) * stage``) +
  data-parallel collectives (DDP/HSDP ring all-reduce of gradients; FSDP
  all-gather twice + reduce-scatter, see :class:`Link`), not overlapped; a
  collective over ``n`` ranks of ``B`` bytes costs ``k (n - 1) / n * B / bw +
  k (n - 1) * latency`` (``k = 2`` for all-reduce);
* memory per rank: parameters, gradients and optimizer states ``/ (fsdp *
  tp)``, activations of the microbatches in flight (1F1B) ``/ tp``, FSDP's
  unsharded layer, DDP's gradient buckets.

Example: ``sorted(auto_plan(gpt, (torch.zeros(8, 16, dtype=torch.long),) * 2, 4).plan)``
is ``['boundaries', 'dp', 'fsdp', 'microbatches', 'pp', 'tp']``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ._partition import LayerCost, partition
from ._profile import Link, batch_size_of, measure_link, profile_layers, slice_batch

__all__ = ["AutoPlan", "Candidate", "auto_plan"]

DDP_BUCKET_BYTES = 25 * 2**20
AXES = ("dp", "fsdp", "tp", "pp")


@dataclass(frozen=True)
class Candidate:
    """One candidate plan with its predicted step time (seconds) and peak memory per rank (bytes).

    ``step_s = compute_s + bubble_s + comm_s``: compute of the slowest stage
    over all microbatches, pipeline fill and drain, and communication (its TP
    all-reduces and pipeline sends, then data-parallel collectives).
    """

    dp: int
    fsdp: int
    tp: int
    pp: int
    microbatches: int = 1
    stages: tuple[range, ...] = ()
    step_s: float = math.inf
    compute_s: float = 0.0
    bubble_s: float = 0.0
    comm_s: float = 0.0
    memory_bytes: float = 0.0
    fits: bool = False
    note: str = ""

    @property
    def name(self) -> str:
        """``"PP2xFSDP2"``-style name ("single" when nothing is parallel)."""
        parts = [f"{a.upper()}{getattr(self, a)}" for a in ("pp", "dp", "fsdp", "tp") if getattr(self, a) > 1]
        return "x".join(parts) or "single"

    @property
    def valid(self) -> bool:
        """Whether the plan applies to the model and batch (else ``note`` says why)."""
        return math.isfinite(self.step_s)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt_stages(stages: Sequence[range]) -> str:
    return " | ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in stages)


@dataclass
class AutoPlan:
    """What :func:`auto_plan` chose, the candidates it compared, and why."""

    chosen: Candidate
    candidates: list[Candidate]
    costs: list[LayerCost]
    world_size: int
    batch_size: int
    link: Link
    memory_limit: float | None = None
    n_blocks: int | None = None

    @property
    def plan(self) -> dict[str, Any]:
        """``dict(dp=, fsdp=, tp=, pp=, boundaries=[range, ...], microbatches=)`` of the chosen plan."""
        c = self.chosen
        return {"dp": c.dp, "fsdp": c.fsdp, "tp": c.tp, "pp": c.pp, "boundaries": list(c.stages), "microbatches": c.microbatches}

    @property
    def stages(self) -> list[range] | None:
        """Block ranges per pipeline stage for ``spawn_trainer(..., stages=...)`` (None without pp)."""
        return list(self.chosen.stages) if self.chosen.pp > 1 else None

    def to_plan(self, **options: Any) -> Any:
        """The chosen plan as :class:`actormesh.parallel.Plan` (1F1B schedule); ``options`` go to Plan."""
        from ._plan import Plan

        c = self.chosen
        return Plan(dp=c.dp, fsdp=c.fsdp, tp=c.tp, pp=c.pp, microbatches=c.microbatches if c.pp > 1 else None, **options)

    def table(self) -> str:
        """All candidates, fastest first: predicted step time, its parts, memory per rank, notes."""
        head = ["plan", "dp", "fsdp", "tp", "pp", "mb", "stages (blocks)", "step ms", "compute", "bubble", "comm", "mem/rank", "note"]
        rows = []
        for c in self.candidates:
            note = "<- chosen" if c is self.chosen and c.valid and c.fits else c.note
            nums = ([f"{1e3 * x:.2f}" for x in (c.step_s, c.compute_s, c.bubble_s, c.comm_s)] + [_fmt_bytes(c.memory_bytes)]
                    if c.valid else ["-"] * 5)
            rows.append([c.name, str(c.dp), str(c.fsdp), str(c.tp), str(c.pp), str(c.microbatches), _fmt_stages(c.stages), *nums, note])
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
            return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [head, *rows])
        t = Table(title=f"auto_plan: {self.world_size} ranks, batch {self.batch_size}, link {self.link.gbps:.3g} Gbps")
        for i, h in enumerate(head):
            t.add_column(h, justify="right" if 1 <= i <= 5 or 7 <= i <= 11 else "left",
                         max_width=44 if h == "note" else None, overflow="fold")
        for r in rows:
            t.add_row(*r, style="bold green" if r[-1] == "<- chosen" else ("dim" if r[7] == "-" else None))
        buf = io.StringIO()
        Console(file=buf, width=200, force_terminal=False, color_system=None).print(t)
        return buf.getvalue().rstrip()

    def explain(self) -> str:
        """A few sentences on the choice, followed by :meth:`table`."""
        c = self.chosen
        fitting = [x for x in self.candidates if x.valid and x.fits and x is not c]
        lines = [f"Chose {c.name} (dp={c.dp}, fsdp={c.fsdp}, tp={c.tp}, pp={c.pp}"
                 + (f", {c.microbatches} microbatches, stages {_fmt_stages(c.stages)}" if c.pp > 1 else "") + "): "
                 f"predicted {1e3 * c.step_s:.2f} ms per step and {_fmt_bytes(c.memory_bytes)} per rank"
                 + (f" (limit {_fmt_bytes(self.memory_limit)})" if self.memory_limit else "") + "."]
        if fitting:
            nxt = fitting[0]
            lines.append(f"Next best that fits: {nxt.name} at {1e3 * nxt.step_s:.2f} ms ({nxt.step_s / c.step_s:.2f}x slower).")
        over = [x.name for x in self.candidates if x.valid and not x.fits]
        if over:
            lines.append(f"Over the memory limit: {', '.join(over)}.")
        lines.append(f"Compute profiled here ({len(self.costs)} layers, batch {self.batch_size}); "
                     f"link {self.link.gbps:.3g} Gbps, {1e6 * self.link.latency_s:.0f} us per message, all-gather and "
                     f"reduce-scatter {self.link.sharded_factor:.2g}x the ring model, {1e3 * self.link.fsdp_call_s:.2g} ms "
                     f"per FSDP call ({self.link.source}).")
        return "\n".join(lines) + "\n" + self.table()

    def __str__(self) -> str:
        return self.explain()


# --------------------------------------------------------------------------- cost model


@dataclass
class _Model:
    """Per-layer linear time model and bytes, grouped into pipeline units (one per block)."""

    fixed: list[float]
    per_sample: list[float]
    costs: list[LayerCost]
    kinds: list[str]  # "pre", "block", "post"
    units: list[list[int]]  # layer indices of each pipeline unit (block)


def _fit(model: Any, sample_batch: Any, batch: int, costs: Sequence[LayerCost] | None, repeats: int) -> _Model:
    """Per-layer ``fixed + per_sample * n`` from profiles at ``batch`` and ``batch // 4`` (given costs: linear)."""
    low, small = None, max(1, batch // 4)
    if costs is None:
        costs = profile_layers(model, sample_batch, repeats=repeats)
        if small < batch:
            low = profile_layers(model, slice_batch(sample_batch, small), repeats=repeats)
    costs = list(costs)
    if low is not None and [c.name for c in low] == [c.name for c in costs]:
        slope = [max(0.0, (h.forward_backward_s - lo.forward_backward_s) / (batch - small)) for h, lo in zip(costs, low)]
        fixed = [max(0.0, h.forward_backward_s - s * batch) for h, s in zip(costs, slope)]
    else:
        slope, fixed = [c.forward_backward_s / batch for c in costs], [0.0] * len(costs)
    return _Model(fixed, slope, costs, *_units(costs))


def _units(costs: list[LayerCost]) -> tuple[list[str], list[list[int]]]:
    is_block = [c.name.startswith("blocks.") for c in costs]
    if not any(is_block):
        return ["block"] * len(costs), [[j] for j in range(len(costs))]
    first, last = is_block.index(True), len(costs) - 1 - is_block[::-1].index(True)
    kinds = ["pre" if j < first else "post" if j > last else "block" for j in range(len(costs))]
    units = [[j] for j in range(first, last + 1)]
    units[0] = list(range(first + 1)) if first else units[0]
    units[-1] = units[-1] + list(range(last + 1, len(costs)))
    return kinds, units


def _ring(nbytes: float, n: int, bw: float, lat: float, factor: int = 1, calls: int = 1) -> float:
    return 0.0 if n <= 1 else factor * ((n - 1) / n * nbytes / bw + (n - 1) * lat * calls)


def _evaluate(m: _Model, dp: int, fsdp: int, tp: int, pp: int, mbs: int, batch: int, *, link: Link,
              memory_limit: float | None, optimizer_states: float, uses_ddp: bool) -> Candidate:
    base = Candidate(dp, fsdp, tp, pp, mbs)
    bw, lat = link.gbps * 1e9 / 8, link.latency_s
    mb = batch / (dp * fsdp) / mbs  # samples per microbatch per rank
    scale = mb / batch

    def tp_comm(j: int) -> float:
        if tp == 1 or not m.costs[j].param_bytes:
            return 0.0
        return _ring(m.costs[j].output_bytes * scale, tp, bw, lat, 2) * (4 if m.kinds[j] == "block" else 2)

    unit_comp = [sum(m.fixed[j] + m.per_sample[j] * mb / tp for j in u) for u in m.units]  # TP splits work, not per-op overhead
    unit_comm = [sum(tp_comm(j) for j in u) for u in m.units]
    unit_t = [a + b for a, b in zip(unit_comp, unit_comm)]
    state = [sum(m.costs[j].param_bytes for j in u) * (2 + optimizer_states) / (fsdp * tp) for u in m.units]
    act = [sum(m.costs[j].activation_bytes for j in u) * scale / tp for u in m.units]
    inflight = [min(pp - s, mbs) for s in range(pp)] if pp > 1 else [1]
    biggest = max(c.param_bytes for c in m.costs) / tp
    extra = 2 * biggest if fsdp > 1 else (sum(c.param_bytes for c in m.costs) if uses_ddp else 0.0)
    if pp > 1:
        unit_mem = [s + a * inflight[0] for s, a in zip(state, act)]
        limit = None if memory_limit is None else max(0.0, memory_limit - extra)
        try:
            stages = partition(unit_t, pp, memory=unit_mem, memory_limit=limit)
        except ValueError as e:
            return replace(base, note="no stage split fits the memory limit" if limit is not None else str(e)[:60])
    else:
        stages = [range(len(m.units))]
    stage_t, stage_comm, stage_mem, comm = [], [], [], 0.0
    for s, r in enumerate(stages):
        last_layer = m.units[r.stop - 1][-1]
        send = 2 * (lat + m.costs[last_layer].output_bytes * scale / bw) if s < pp - 1 else 0.0
        stage_comm.append(sum(unit_comm[u] for u in r) + send)
        stage_t.append(sum(unit_comp[u] for u in r) + stage_comm[-1])
        stage_mem.append(sum(state[u] + act[u] * inflight[s] for u in r) + extra)
        grads = sum(m.costs[j].param_bytes for u in r for j in m.units[u]) / tp
        c = _ring(grads / fsdp, dp, bw, lat, 2, max(1, math.ceil(grads / fsdp / DDP_BUCKET_BYTES)))
        if fsdp > 1:  # all-gather forward and backward, reduce-scatter; one call each per block and the root
            c += 3 * (link.sharded_factor * (fsdp - 1) / fsdp * grads / bw + (fsdp - 1) * (len(r) + 1) * link.fsdp_call_s)
        comm = max(comm, c)
    k = max(range(pp), key=lambda i: stage_t[i])
    slow = stage_t[k]  # 1F1B/GPipe: fill and drain through every stage once, the slowest one repeats
    memory = max(stage_mem)
    fits = memory_limit is None or memory <= memory_limit
    return replace(base, stages=tuple(stages), step_s=sum(stage_t) + (mbs - 1) * slow + comm, compute_s=mbs * (slow - stage_comm[k]),
                   bubble_s=sum(stage_t) - slow, comm_s=mbs * stage_comm[k] + comm, memory_bytes=memory, fits=fits,
                   note="" if fits else f"over memory limit by {_fmt_bytes(memory - memory_limit)}")  # type: ignore[operator]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _heads(model: Any) -> int | None:
    for mod in [model, getattr(model, "config", None), *model.modules()]:
        for attr in ("n_heads", "num_heads", "nhead", "num_attention_heads"):
            value = getattr(mod, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _tp_problem(model: Any, tp: int, heads: int | None) -> str:
    if tp == 1:
        return ""
    if heads is None:
        return "head count unknown (no n_heads attribute): tp not considered"
    if heads % tp:
        return f"tp={tp} does not divide {heads} heads"
    try:
        from ._tp import check_tp, resolve_tp_plan

        tp_plan = resolve_tp_plan(model, None)
        if isinstance(tp_plan, dict):
            check_tp(model, tp_plan, tp)
    except ImportError:
        pass
    except ValueError as e:
        return str(e).split(":")[0][:60]
    return ""


def _microbatch_options(local: int, pp: int) -> list[int]:
    """Microbatch counts tried: divisors of the per-rank batch from ``pp`` to ``4 * pp`` (1F1B needs >= pp)."""
    return [1] if pp == 1 else [m for m in _divisors(local) if pp <= m <= 4 * pp]


def _world(procs: Any) -> int:
    if isinstance(procs, bool) or not (isinstance(procs, int) or hasattr(procs, "__len__")):
        raise TypeError(f"procs must be a world size (int) or a proc mesh, got {type(procs).__name__}")
    if (n := procs if isinstance(procs, int) else len(procs)) < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    return n


def _link_from(link_gbps: float | str | None) -> Link:
    """The link auto_plan costs collectives with, from its ``link_gbps`` argument."""
    if link_gbps == "measure":
        return measure_link()
    if link_gbps is None:
        return Link()
    if isinstance(link_gbps, bool) or not isinstance(link_gbps, (int, float)) or not 0 < link_gbps < math.inf:
        raise ValueError(f"link_gbps must be a positive number, None or 'measure', got {link_gbps!r}")
    return Link(gbps=float(link_gbps), source=f"{link_gbps:g} Gbps given, other figures default")


def _candidate_problem(model: Any, c: Candidate, heads: Any, n_blocks: int | None, batch: int) -> str:
    """Why the layout ``c`` cannot run this model and batch at all ("" if it can)."""
    dp, fsdp, tp, pp = c.dp, c.fsdp, c.tp, c.pp
    local = batch // (dp * fsdp)
    return (_tp_problem(model, tp, heads) or
            ("pp needs model.blocks" if pp > 1 and n_blocks is None else "") or
            (f"pp={pp} > {n_blocks} blocks" if n_blocks is not None and pp > n_blocks else "") or
            (f"batch {batch} does not split over dp*fsdp={dp * fsdp}" if batch % (dp * fsdp) else "") or
            (f"{local} samples per rank do not split into >= {pp} microbatches" if not _microbatch_options(local, pp) else ""))


def _n_blocks(model: Any) -> int | None:
    blocks = getattr(model, "blocks", None)
    return len(blocks) if blocks is not None and hasattr(blocks, "__len__") else None


def _check_allow(allow: Sequence[str]) -> None:
    bad = set(allow) - set(AXES)
    if bad:
        raise ValueError(f"allow names unknown axes {sorted(bad)}; choose from {AXES}")


def auto_plan(
    model_fn: Callable[[], Any],
    sample_batch: Any,
    procs_or_world_size: Any,
    memory_limit: float | None = None,
    link_gbps: float | str | None = None,
    *,
    link: Link | None = None,
    optimizer_states: float = 2.0,
    allow: Sequence[str] = AXES,
    costs: Sequence[LayerCost] | None = None,
    repeats: int = 3,
) -> AutoPlan:
    """Choose dp/fsdp/tp/pp, microbatches and stage boundaries for ``model_fn()`` on a world.

    ``sample_batch`` is one global batch (``(inputs, targets)`` or the input);
    ``procs_or_world_size`` an int or a proc mesh (its length). ``memory_limit``
    is bytes per rank; ``link_gbps`` the link bandwidth in Gbit/s, None for
    the loopback defaults of :class:`Link`, or ``"measure"`` to measure the
    link between two local procs (:func:`measure_link`); ``link`` gives every
    figure of the cost of collectives instead. ``optimizer_states``: optimizer
    state per parameter in parameter copies (Adam: 2, SGD: 0); ``allow`` limits
    the axes tried; ``costs`` skips profiling (times then scale with batch).
    Raises ValueError when no candidate fits; the message holds the table.

    Example:
        >>> import torch
        >>> from actormesh.parallel.models import gpt
        >>> auto_plan(gpt, torch.zeros(8, 16, dtype=torch.long), 2, allow=("dp",)).plan["dp"]
        2
    """
    world = _world(procs_or_world_size)
    _check_allow(allow)
    link = link or _link_from(link_gbps)
    model, batch = model_fn(), batch_size_of(sample_batch)
    m = _fit(model, sample_batch, batch, costs, repeats)
    n_blocks, heads = _n_blocks(model), _heads(model)
    out: list[Candidate] = []
    for pp, tp, fsdp in [(p, t, f) for p in _divisors(world) for t in _divisors(world // p) for f in _divisors(world // p // t)]:
        dp = world // pp // tp // fsdp
        base = Candidate(dp, fsdp, tp, pp)
        off = [a for a in AXES if getattr(base, a) > 1 and a not in allow]
        local = batch // (dp * fsdp)
        why = f"{'/'.join(off)} not allowed" if off else _candidate_problem(model, base, heads, n_blocks, batch)
        if why:
            out.append(replace(base, note=why))
            continue
        options = [_evaluate(m, dp, fsdp, tp, pp, mbs, batch, link=link, memory_limit=memory_limit,
                             optimizer_states=optimizer_states, uses_ddp=dp > 1 and fsdp == tp == pp == 1)
                   for mbs in _microbatch_options(local, pp)]
        out.append(min(options, key=lambda c: (not c.fits, c.step_s)))
    out.sort(key=lambda c: (not c.valid, not c.fits, c.step_s, c.memory_bytes))
    ok = [c for c in out if c.valid and c.fits]
    result = AutoPlan(ok[0] if ok else out[0], out, m.costs, world, batch, link, memory_limit, n_blocks)
    if not ok:
        why = f"fits the memory limit ({_fmt_bytes(memory_limit or 0)} per rank)" if any(c.valid for c in out) else "is valid"
        raise ValueError(f"no plan for {world} ranks {why}; the candidates:\n{result.table()}")
    return result
