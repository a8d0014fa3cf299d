"""Automatic partitioner: exact stage splits, layer profiling, plan selection.

``partition`` is checked against brute force over every contiguous split of
small random instances (hypothesis, derandomized), including memory limits
and heterogeneous speeds; ``profile_layers`` against a model with known
uneven blocks; ``auto_plan`` on hand-made costs where the right answer is
known.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actormesh.parallel._partition import LayerCost, even_split, partition, stage_memory, stage_times

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=300)


def _prefix(xs: Sequence[float]) -> list[float]:
    p = [0.0]
    for x in xs:
        p.append(p[-1] + float(x))
    return p


def brute_force(
    costs: Sequence[float],
    k: int,
    memory: Sequence[float] | None = None,
    limits: Sequence[float] | None = None,
    speeds: Sequence[float] | None = None,
) -> float | None:
    """Best bottleneck over all contiguous splits (same float evaluation), None if none fits."""
    n = len(costs)
    p, pm = _prefix(costs), _prefix(memory or [0.0] * n)
    s = speeds or [1.0] * k
    lim = limits or [math.inf] * k
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        if any(pm[b[i + 1]] - pm[b[i]] > lim[i] for i in range(k)):
            continue
        worst = max((p[b[i + 1]] - p[b[i]]) / s[i] for i in range(k))
        best = worst if best is None else min(best, worst)
    return best


def assert_valid(stages: list[range], n: int, k: int) -> None:
    assert len(stages) == k
    assert all(isinstance(r, range) and r.step == 1 and len(r) > 0 for r in stages)
    assert stages[0].start == 0 and stages[-1].stop == n
    assert all(a.stop == b.start for a, b in itertools.pairwise(stages))


costs_st = st.lists(
    st.one_of(st.integers(0, 20).map(float), st.floats(0, 100, allow_nan=False, allow_infinity=False)),
    min_size=1,
    max_size=9,
)


@SETTINGS
@given(costs=costs_st, data=st.data())
def test_optimal_against_brute_force(costs: list[float], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(costs)))
    stages = partition(costs, k)
    assert_valid(stages, len(costs), k)
    assert max(stage_times(costs, stages)) == brute_force(costs, k)


@SETTINGS
@given(costs=costs_st, data=st.data())
def test_optimal_with_speeds_and_memory(costs: list[float], data: st.DataObject) -> None:
    n = len(costs)
    k = data.draw(st.integers(1, n))
    speeds = data.draw(st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 7.0]), min_size=k, max_size=k))
    memory = data.draw(st.lists(st.integers(0, 10).map(float), min_size=n, max_size=n))
    limits = data.draw(
        st.one_of(
            st.none(),
            st.integers(0, 40).map(float),
            st.lists(st.integers(0, 40).map(float), min_size=k, max_size=k),
        )
    )
    per_stage = None if limits is None else ([limits] * k if isinstance(limits, float) else limits)
    want = brute_force(costs, k, memory, per_stage, speeds)
    if want is None:
        with pytest.raises(ValueError, match="cannot fit in any stage|no split of"):
            partition(costs, k, memory=memory, memory_limit=limits, speeds=speeds)
        return
    stages = partition(costs, k, memory=memory, memory_limit=limits, speeds=speeds)
    assert_valid(stages, n, k)
    assert max(stage_times(costs, stages, speeds)) == want
    if per_stage is not None:
        assert all(m <= lim for m, lim in zip(stage_memory(memory, stages), per_stage))


# per-block fwd+bwd ms of the uneven 13-block model (also in bench/partition_bench.py)
UNEVEN_13 = [11.0, 14.0, 15.0, 1.0, 4.0, 10.0, 7.0, 1.0, 1.0, 1.0, 5.0, 5.0, 4.0]


def test_uneven_13_block_model_beats_equal_split() -> None:
    for k, equal_ratio in ((2, 1.55), (4, 1.64)):
        opt = max(stage_times(UNEVEN_13, partition(UNEVEN_13, k)))
        equal = max(stage_times(UNEVEN_13, even_split(13, k)))
        assert equal / opt == pytest.approx(equal_ratio, abs=0.005)
        assert opt == brute_force(UNEVEN_13, k)


def test_layer_costs_default_memory_and_names_in_errors() -> None:
    layers = [LayerCost(1.0, 10, 5, f"blocks.{i}") for i in range(4)]
    layers[2] = LayerCost(1.0, 100, 5, "blocks.2")
    assert partition(layers, 2) == [range(0, 2), range(2, 4)]
    assert partition(layers, 2, memory_limit=[30, 200]) == [range(0, 2), range(2, 4)]
    # 105 bytes: too big for every stage; the error names it
    with pytest.raises(ValueError, match=r"layer 2 \('blocks.2'\).*cannot fit in any stage"):
        partition(layers, 2, memory_limit=100)
    # every layer fits some stage, but not in order: stage 1 cannot take blocks.2 and blocks.3 together
    with pytest.raises(ValueError, match=r"no split of 4 layers .*layers \[0, 3\) fit in order, so layer 3 \('blocks.3'\)"):
        partition(layers[:3] + [LayerCost(1.0, 200, 0, "blocks.3")], 2, memory_limit=[30, 200])
    with pytest.raises(ValueError, match="memory_limit needs per-layer memory"):
        partition([1.0, 2.0], 2, memory_limit=10)


@pytest.mark.parametrize(
    ("costs", "k", "kwargs", "error", "match"),
    [
        ([1.0, 2.0], 0, {}, ValueError, "between 1 and the number of layers"),
        ([1.0, 2.0], 3, {}, ValueError, "between 1 and the number of layers"),
        ([], 1, {}, ValueError, "empty"),
        ([1.0, -2.0], 1, {}, ValueError, "cost of layer 1 must be finite and >= 0"),
        ([1.0, math.nan], 1, {}, ValueError, "finite"),
        ([1.0, math.inf], 1, {}, ValueError, "finite"),
        ([1.0, "x"], 1, {}, TypeError, "must be a number"),
        ([1.0, 2.0], 2.0, {}, TypeError, "num_stages must be an int"),
        ([1.0, 2.0], 2, {"speeds": [1.0]}, ValueError, "one per stage"),
        ([1.0, 2.0], 2, {"speeds": [1.0, 0.0]}, ValueError, r"speeds\[1\] must be finite and > 0"),
        ([1.0, 2.0], 2, {"memory": [1.0]}, ValueError, "one entry per layer"),
        ([1.0, 2.0], 2, {"memory": [1.0, -1.0]}, ValueError, "memory of layer 1"),
        ([1.0, 2.0], 2, {"memory": [1, 1], "memory_limit": -1}, ValueError, r"memory_limit\[0\]"),
        ([1.0, 2.0], 2, {"memory": [1, 1], "memory_limit": True}, TypeError, r"memory_limit\[0\] must be a number"),
        ([1.0, 2.0], 2, {"memory": [1, 1], "memory_limit": "x"}, TypeError, "one number per stage"),
        ("ab", 1, {}, TypeError, "sequence"),
    ],
)
def test_invalid_arguments(costs: list, k: int, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        partition(costs, k, **kwargs)


def test_edge_cases() -> None:
    assert partition([5.0], 1) == [range(0, 1)]
    assert partition([1.0, 2.0, 3.0], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert partition([0.0] * 5, 2) == [range(0, 1), range(1, 5)]  # ties: later stages as large as allowed
    assert partition([1, 1, 1, 1, 1, 1], 3, speeds=[1, 1, 4]) == [range(0, 1), range(1, 2), range(2, 6)]
    assert even_split(13, 2) == [range(0, 7), range(7, 13)]
    with pytest.raises(ValueError):
        even_split(2, 3)


def test_speed_1000_layers_64_stages() -> None:
    costs = [((i * 7919) % 97 + 1) / 97 for i in range(1000)]
    speeds = [1.0 + (i % 3) for i in range(64)]
    memory = [float((i * 31) % 13) for i in range(1000)]
    # CPU time, not wall time: another process on the machine must not fail this (~0.03 s here)
    t0 = time.process_time()
    uniform = partition(costs, 64)
    hetero = partition(costs, 64, speeds=speeds, memory=memory, memory_limit=200.0)
    elapsed = time.process_time() - t0
    assert_valid(uniform, 1000, 64)
    assert_valid(hetero, 1000, 64)
    # a lower bound any split must meet: total work over total speed
    assert max(stage_times(costs, uniform)) >= sum(costs) / 64
    assert max(stage_times(costs, uniform)) <= sum(costs) / 64 + max(costs)
    assert elapsed < 1.0, elapsed


# --------------------------------------------------------------------------- profile_layers

torch = pytest.importorskip("torch")
from torch import nn

from actormesh.parallel._profile import model_inputs, profile_layers

D = 32


class Uneven(nn.Module):
    """Embedding, MLP blocks of the given hidden widths, head: uneven on purpose."""

    def __init__(self, widths: Sequence[int], vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, w), nn.GELU(), nn.Linear(w, D)) for w in widths)
        self.head = nn.Linear(D, vocab, bias=False)
        self.unused = nn.Linear(3, 3)
        self.n_heads = 4

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def test_profile_layers_names_bytes_and_times() -> None:
    torch.manual_seed(0)
    model = Uneven([16, 1024, 16, 1024])
    tokens = torch.randint(0, 50, (8, 16))
    for p in model.parameters():
        p.grad = None
    rng = torch.get_rng_state()
    costs = profile_layers(model, (tokens, tokens), repeats=5)  # the fastest of 5: robust to other work on the machine
    assert [c.name for c in costs] == ["emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]  # unused left out
    for c, mod in zip(costs, [model.emb, *model.blocks, model.head]):
        assert c.param_bytes == sum(p.numel() * 4 for p in mod.parameters())
        assert c.forward_backward_s > 0
    hidden = 8 * 16 * D * 4
    assert [c.output_bytes for c in costs[1:5]] == [hidden] * 4
    assert costs[-1].output_bytes == 8 * 16 * 50 * 4
    # a block saves its input, its hidden pre- and post-activation: more for the wide ones
    assert costs[2].activation_bytes >= 2 * 8 * 16 * 1024 * 4 > costs[1].activation_bytes >= hidden
    # 64x the FLOPs: measured slower (by how much depends on the machine and what else it runs)
    assert costs[2].forward_backward_s + costs[4].forward_backward_s > costs[1].forward_backward_s + costs[3].forward_backward_s
    # no side effects: no .grad, RNG untouched
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_profile_layers_explicit_blocks_and_errors() -> None:
    model = Uneven([8, 8])
    tokens = torch.randint(0, 50, (2, 4))
    costs = profile_layers(model, tokens, blocks=list(model.blocks), warmup=0, repeats=1)
    assert [c.name for c in costs] == ["blocks.0", "blocks.1"]
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    assert [c.name for c in profile_layers(seq, torch.randn(3, 4), repeats=1)] == ["0", "1"]
    with pytest.raises(ValueError, match="no child modules"):
        profile_layers(nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(ValueError, match="repeats >= 1"):
        profile_layers(seq, torch.randn(3, 4), repeats=0)
    with pytest.raises(TypeError, match="blocks must be"):
        profile_layers(seq, torch.randn(3, 4), blocks=[1])
    assert model_inputs({"x": 1}) == ((), {"x": 1})
    assert model_inputs(((1, 2), 3)) == ((1, 2), {})


# --------------------------------------------------------------------------- auto_plan

from actormesh.parallel._auto import auto_plan
from actormesh.parallel._profile import Link

MiB = 2**20


def uneven_costs(block_s: Sequence[float], block_params: int, act: int = 1 * MiB) -> list[LayerCost]:
    """Hand-made costs for Uneven: deterministic, no timing."""
    out = [LayerCost(0.001, 1 * MiB, 1024, "emb", 256 * 1024)]
    out += [LayerCost(t, block_params, act, f"blocks.{i}", 256 * 1024) for i, t in enumerate(block_s)]
    return out + [LayerCost(0.002, 1 * MiB, 1024, "head", 1 * MiB)]


def test_auto_plan_prefers_data_parallel_for_small_models() -> None:
    tokens = torch.zeros(16, 4, dtype=torch.long)
    costs = uneven_costs([0.01] * 4, 64 * 1024)
    choice = auto_plan(lambda: Uneven([8] * 4), (tokens, tokens), 4, link_gbps=10, costs=costs)
    assert choice.plan == {"dp": 4, "fsdp": 1, "tp": 1, "pp": 1, "boundaries": [range(0, 4)], "microbatches": 1}
    c = choice.chosen
    grads = 4 * 64 * 1024 + 2 * MiB
    comm = 2 * 3 / 4 * grads / (10e9 / 8) + 2 * 3 * Link().latency_s  # ring all-reduce, one bucket
    assert c.comm_s == pytest.approx(comm)
    assert c.step_s == pytest.approx(sum(x.forward_backward_s for x in costs) / 4 + comm)
    # parameters, gradients, DDP buckets, Adam's two states: 5 copies; activations of 4 samples
    assert c.memory_bytes == pytest.approx(5 * grads + (4 * MiB + 2048) / 4)
    assert "<- chosen" in choice.table() and "Chose DP4" in choice.explain()
    assert len(choice.candidates) == 10  # ordered factorisations of 4 into dp*fsdp*tp*pp


def test_auto_plan_memory_limit_pipeline_with_partitioned_stages() -> None:
    tokens = torch.zeros(8, 4, dtype=torch.long)
    block_s = [0.02, 0.001, 0.001, 0.001, 0.001, 0.02, 0.001, 0.001]
    costs = uneven_costs(block_s, 16 * MiB)
    limit = 200 * MiB  # a replica needs 8 * 16 MiB * 4 (params, grads, Adam) = 512 MiB: forces sharding or stages
    choice = auto_plan(lambda: Uneven([8] * 8), (tokens, tokens), 4, memory_limit=limit, costs=costs, allow=("dp", "pp"))
    c = choice.chosen
    assert c.pp > 1 and c.fits and c.memory_bytes <= limit
    fitting = [x for x in choice.candidates if x.valid and x.fits]
    assert c is fitting[0] and all(c.step_s <= x.step_s for x in fitting)
    assert all(not x.fits for x in choice.candidates if x.valid and x.pp == 1)
    # stages balance compute (the two slow blocks land in different stages), not block counts
    slow = [next(i for i, r in enumerate(c.stages) if b in r) for b in (0, 5)]
    assert slow[0] != slow[1]
    assert (c.dp, c.pp) == (1, 4)  # 512 MiB of state over 4 stages; dp would need replicas of 2 stages
    assert c.step_s == pytest.approx(c.compute_s + c.bubble_s + c.comm_s)
    assert 0 < c.bubble_s <= (c.pp - 1) * (c.compute_s + c.comm_s) / c.microbatches
    assert choice.plan["boundaries"] == list(c.stages) == choice.stages
    plan = choice.to_plan()
    assert (plan.dp, plan.fsdp, plan.tp, plan.pp, plan.n_microbatches) == (c.dp, c.fsdp, c.tp, c.pp, c.microbatches)
    assert "fsdp not allowed" in choice.table()


def test_auto_plan_pipeline_step_formula() -> None:
    # 8 equal blocks, 2 stages, no bytes to move: step = sum of stage times + (m - 1) * slowest
    tokens = torch.zeros(8, 4, dtype=torch.long)
    costs = [LayerCost(0.008, 0, 0, f"blocks.{i}", 0) for i in range(8)]
    link = Link(gbps=1.0, latency_s=0.001)
    c = auto_plan(lambda: Uneven([8] * 8), tokens, 2, link=link, costs=costs, allow=("pp",)).chosen
    assert (c.pp, c.stages) == (2, (range(0, 4), range(4, 8)))
    stage = 4 * 0.008 / c.microbatches  # seconds per microbatch; the first stage also sends and receives: 2 latencies
    want = (stage + 2e-3) + stage + (c.microbatches - 1) * (stage + 2e-3)
    assert c.step_s == pytest.approx(want)
    assert c.bubble_s == pytest.approx(stage) and c.comm_s == pytest.approx(c.microbatches * 2e-3)
    # (m + 1) * 32 ms / m of compute + m * 2 ms of sends: m = 2: 52 ms, m = 4: 48 ms, m = 8: 52 ms
    assert c.microbatches == 4 and c.step_s == pytest.approx(0.048)


def test_auto_plan_invalid_candidates_and_errors() -> None:
    tokens = torch.zeros(6, 4, dtype=torch.long)
    costs = uneven_costs([0.01] * 2, 1024)
    choice = auto_plan(lambda: Uneven([8] * 2), tokens, [0, 1, 2], costs=costs)  # a 3-proc "mesh"
    notes = {x.name: x.note for x in choice.candidates}
    assert "does not divide 4 heads" in notes["TP3"]
    assert "6 samples per rank do not split into >= 3" in notes["PP3"] or "3 > 2 blocks" in notes["PP3"]
    assert choice.chosen.valid
    with pytest.raises(ValueError, match="fits the memory limit"):
        auto_plan(lambda: Uneven([8] * 2), tokens, 2, memory_limit=1024, costs=costs)
    with pytest.raises(ValueError, match="link_gbps"):
        auto_plan(lambda: Uneven([8] * 2), tokens, 2, link_gbps=0, costs=costs)
    with pytest.raises(ValueError, match="unknown axes"):
        auto_plan(lambda: Uneven([8] * 2), tokens, 2, allow=("zp",), costs=costs)
    with pytest.raises(TypeError):
        auto_plan(lambda: Uneven([8] * 2), tokens, True, costs=costs)


def test_auto_plan_profiles_a_real_model() -> None:
    from actormesh.parallel.models import gpt

    tokens = torch.zeros(8, 16, dtype=torch.long)
    choice = auto_plan(lambda: gpt(n_blocks=2), (tokens, tokens), 2, repeats=1)
    assert [c.name for c in choice.costs][:3] == ["tok_emb", "pos_emb", "blocks.0"]
    assert choice.chosen.valid and choice.chosen.step_s > 0
    assert {(x.dp, x.fsdp, x.tp, x.pp) for x in choice.candidates} == {(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)}
