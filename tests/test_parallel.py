"""actormesh.parallel: plans validated, every combination matching a single-process run,
checkpoints resuming under another plan, user TP plans, compile and checkpointing.

The distributed tests share one proc mesh per test and run the plans one after
another on it (torch is imported once per proc; each trainer's process group
is destroyed when it stops), which keeps the whole file to about two minutes.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from actormesh.parallel import Plan, PlanError, check_stages, default_tp_plan, equal_stages, gather_state_dict, spawn_trainer  # noqa: E402
from actormesh.parallel._pipeline import cut_to_stage  # noqa: E402
from actormesh.parallel._tp import check_tp  # noqa: E402
from actormesh.parallel.models import GPTConfig, gpt, lm_loss, synthetic_batches  # noqa: E402

CFG = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_blocks=4, seq_len=16)
MODEL = partial(gpt, CFG.vocab_size, CFG.d_model, CFG.n_heads, CFG.n_blocks, CFG.seq_len)
SGD = partial(torch.optim.SGD, lr=0.2)
ADAMW = partial(torch.optim.AdamW, lr=1e-2)
BATCH, STEPS, TOL = 8, 3, 1e-5


def batches(n: int = STEPS) -> list[tuple[Any, Any]]:
    return [b for _, b in zip(range(n), synthetic_batches(CFG, BATCH, seed=1))]


def reference(model_fn: Any, optimizer_fn: Any, data: list[Any], seed: int = 0) -> tuple[list[float], nn.Module]:
    """The same training, one process, no parallelism: losses and the final model."""
    torch.manual_seed(seed)
    model = model_fn()
    opt = optimizer_fn(model.parameters())
    losses = []
    for x, y in data:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def run_plan(procs: Any, plan: Plan, data: list[Any], optimizer_fn: Any = SGD, model_fn: Any = MODEL, **kw: Any) -> tuple[list[float], list[dict[str, Any]]]:
    trainer = spawn_trainer(procs, model_fn, lm_loss, optimizer_fn, plan, timeout=240, **kw)
    try:
        info = trainer.info.call().get(timeout=60).values()
        losses = []
        for batch in data:
            per_rank = trainer.step.call(batch).get(timeout=240).values()
            assert len(set(per_rank)) == 1, f"{plan}: ranks disagree on the loss: {per_rank}"
            losses.append(per_rank[0])
        return losses, info
    finally:
        trainer.stop().get(timeout=60)


# ------------------------------------------------------------------ no procs


def test_plan_product_must_equal_world_size() -> None:
    with pytest.raises(PlanError, match=r"dp\*fsdp\*tp\*pp = 2\*1\*2\*1 = 4 procs, but the proc mesh has 8"):
        Plan(dp=2, tp=2).check_world(8)
    Plan(dp=2, tp=2).check_world(4)


@pytest.mark.parametrize("kwargs, message", [
    ({"tp": 0}, "tp must be a positive int"),
    ({"dp": 1.5}, "dp must be a positive int"),
    ({"pp": 2, "pp_schedule": "zigzag"}, "not a known schedule"),
    ({"pp": 4, "microbatches": 2}, "needs microbatches >= pp"),
    ({"pp": 2, "pp_schedule": "GPipe", "stages_per_rank": 2}, "one stage per rank"),
    ({"compile": 3}, "compile"),
    ({"tp_plan": 42}, "tp_plan"),
])
def test_plan_rejects_bad_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Plan(**kwargs)


def test_plan_derived_sizes_and_wrappers() -> None:
    assert Plan(pp_schedule="interleaved1f1b").pp_schedule == "Interleaved1F1B"
    assert Plan(dp=4).uses_ddp and not Plan(dp=4).uses_fsdp
    assert Plan(dp=2, tp=2).uses_fsdp and not Plan(dp=2, tp=2).uses_ddp  # DDP only when dp is the only axis
    assert Plan(pp=2, dp=2).uses_fsdp
    assert Plan(pp=2, pp_schedule="Interleaved1F1B").n_stages == 4
    assert Plan(pp=2).n_microbatches == 2 and Plan(pp=2, microbatches=4).n_microbatches == 4
    assert Plan(pp=2, fsdp=2, tp=2).describe() == "PP2xFSDP2xTP2" and Plan().describe() == "single"
    with pytest.raises(PlanError, match="needs 4 pipeline stages .* only 3 blocks"):
        Plan(pp=2, pp_schedule="Interleaved1F1B").check_blocks(3)
    with pytest.raises(PlanError, match="no `blocks`|has none"):
        Plan(pp=2).check_blocks(None)
    with pytest.raises(PlanError, match="multiple of 4"):
        Plan(dp=4).check_batch(6)
    with pytest.raises(PlanError, match="microbatches"):
        Plan(dp=2, pp=2, microbatches=4).check_batch(4)


def test_stage_boundaries() -> None:
    assert equal_stages(5, 2) == [range(0, 3), range(3, 5)]
    assert equal_stages(4, 4) == [range(i, i + 1) for i in range(4)]
    assert check_stages([range(0, 1), range(1, 4)], 4, 2) == [range(0, 1), range(1, 4)]
    with pytest.raises(PlanError, match="one range of block indices per stage"):
        check_stages([range(0, 4)], 4, 2)
    with pytest.raises(PlanError, match="contiguous"):
        check_stages([range(0, 2), range(3, 4)], 4, 2)
    with pytest.raises(PlanError, match="must end at 4"):
        check_stages([range(0, 1), range(1, 3)], 4, 2)


def test_default_tp_plan_for_transformer_blocks() -> None:
    with torch.device("meta"):
        model = MODEL()
    plan = default_tp_plan(model)
    assert {k: v for k, v in plan.items() if k.startswith("blocks.0.")} == {
        "blocks.0.attn.q": "colwise", "blocks.0.attn.k": "colwise", "blocks.0.attn.v": "colwise", "blocks.0.attn.o": "rowwise",
        "blocks.0.mlp.up": "colwise", "blocks.0.mlp.down": "rowwise"}
    assert plan["tok_emb"] == "embedding" and plan["head"] == "head"
    check_tp(model, plan, 2)
    with pytest.raises(PlanError, match="tp=3 does not divide blocks.0.attn.q.out_features = 32"):
        check_tp(model, plan, 3)
    with pytest.raises(PlanError, match="tp=8 does not divide the 4 attention heads"):
        check_tp(model, plan, 8)

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4))])

    with pytest.raises(PlanError, match="Plan\\(tp_plan="):
        default_tp_plan(Odd())


def test_a_stage_keeps_the_full_models_names() -> None:
    with torch.device("meta"):
        model = MODEL()
    cut_to_stage(model, range(2, 4), first=False, last=True)
    names = {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("blocks") else "") for n, _ in model.named_parameters()}
    assert names == {"blocks.2", "blocks.3", "norm", "head"}
    assert model.tok_emb is None and model.blocks[0] is None


def test_plan_too_large_for_the_procs_fails_before_spawning(spawn_procs: Any) -> None:
    procs = spawn_procs(per_host={"gpus": 2})
    with pytest.raises(PlanError, match="needs dp\\*fsdp\\*tp\\*pp .* = 4 procs, but the proc mesh has 2"):
        spawn_trainer(procs, MODEL, lm_loss, SGD, Plan(dp=2, tp=2))


def test_importing_the_packages_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, actormesh.parallel, actormesh.spmd; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -------------------------------------------------------------- distributed


@pytest.mark.timeout(420)
def test_every_plan_matches_the_single_process_reference(spawn_procs: Any) -> None:
    """Same seed, same data: each plan's losses match a plain single-process loop."""
    data = batches()
    ref, _ = reference(MODEL, SGD, data)
    procs = spawn_procs(per_host={"gpus": 4})
    plans: list[tuple[Plan, dict[str, Any], str]] = [
        (Plan(dp=4), {}, "DistributedDataParallel"),
        (Plan(fsdp=4), {}, "FSDPGPT"),
        (Plan(dp=2, tp=2), {}, "FSDPGPT"),  # replication beside TP: FSDP2's replicate dim
        (Plan(dp=2, pp=2), {}, "FSDPGPT"),
        (Plan(fsdp=2, tp=2), {}, "FSDPGPT"),
        (Plan(pp=2, fsdp=2), {"stages": [range(0, 1), range(1, 4)]}, "FSDPGPT"),  # a partitioner's uneven split
        (Plan(pp=2, tp=2, pp_schedule="GPipe", microbatches=4), {}, "GPT"),
        (Plan(pp=2, dp=2, pp_schedule="Interleaved1F1B"), {}, "FSDPGPT"),
    ]
    report, worst = [], 0.0
    for plan, kw, wrapper in plans:
        losses, info = run_plan(procs, plan, data, **kw)
        diff = max(abs(a - b) for a, b in zip(losses, ref))
        worst = max(worst, diff)
        report.append(f"{plan!s:>60}: max |loss - reference| = {diff:.2e}")
        assert info[0]["wrappers"] == [wrapper], f"{plan}: {info[0]['wrappers']}"
        if plan.pp > 1:
            assert {s for i in info for s in i["stages"]} == set(range(plan.n_stages))
    print("\n".join(report))
    assert worst < TOL, "\n".join(report)
    assert ref[0] != ref[-1]  # the model did train


@pytest.mark.timeout(300)
def test_checkpoint_saved_under_one_plan_resumes_under_another(spawn_procs: Any, tmp_path: Any) -> None:
    data = batches(4)
    ref, _ = reference(MODEL, ADAMW, data)
    _, ref_model_2 = reference(MODEL, ADAMW, data[:2])
    procs = spawn_procs(per_host={"gpus": 4})
    first = spawn_trainer(procs, MODEL, lm_loss, ADAMW, Plan(fsdp=2, tp=2), timeout=240)
    try:
        before = [first.step.call(b).get(timeout=120).values()[0] for b in data[:2]]
        first.save.call(str(tmp_path / "ckpt")).get(timeout=120)
        weights = gather_state_dict(first)
    finally:
        first.stop().get(timeout=60)
    expected = ref_model_2.state_dict()
    assert set(weights) == set(expected)
    for k in expected:  # Adam divides by sqrt(v): rounding-level gradient noise moves weights ~1e-5
        torch.testing.assert_close(weights[k], expected[k], atol=1e-4, rtol=1e-4)

    for plan in (Plan(dp=2, pp=2), Plan(pp=4, pp_schedule="GPipe")):
        second = spawn_trainer(procs, MODEL, lm_loss, ADAMW, plan, timeout=240)
        try:
            assert second.load.call(str(tmp_path / "ckpt")).get(timeout=120).values() == [2] * 4
            after = [second.step.call(b).get(timeout=120).values()[0] for b in data[2:]]
        finally:
            second.stop().get(timeout=60)
        losses = before + after
        assert max(abs(a - b) for a, b in zip(losses, ref)) < TOL, (plan, losses, ref)

    # Another world size: two procs, tensor parallel.
    two = spawn_procs(per_host={"gpus": 2})
    fourth = spawn_trainer(two, MODEL, lm_loss, ADAMW, Plan(tp=2), timeout=240)
    try:
        assert fourth.load.call(str(tmp_path / "ckpt")).get(timeout=120).values() == [2, 2]
        after = [fourth.step.call(b).get(timeout=120).values()[0] for b in data[2:]]
    finally:
        fourth.stop().get(timeout=60)
    assert max(abs(a - b) for a, b in zip(before + after, ref)) < TOL

    # Full weights in, under yet another plan: continue from the reference's step-2 model.
    third = spawn_trainer(procs, MODEL, lm_loss, SGD, Plan(dp=4), timeout=240)
    try:
        third.load_state_dict.call(expected).get(timeout=120)
        assert gather_state_dict(third)["head.weight"].equal(expected["head.weight"])
    finally:
        third.stop().get(timeout=60)


class MixerBlock(nn.Module):
    """Not a standard transformer block: its layers need a user-supplied TP plan."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc_in = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x: Any) -> Any:
        return x + self.fc_out(torch.relu(self.fc_in(self.norm(x))))


class Mixer(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, n: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MixerBlock(d) for _ in range(n))
        self.out = nn.Linear(d, vocab)

    def forward(self, x: Any) -> Any:
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            if block is not None:
                x = block(x)
        return self.out(x) if self.out is not None else x


@pytest.mark.timeout(300)
def test_user_tp_plan_and_errors_found_in_the_model(spawn_procs: Any) -> None:
    procs = spawn_procs(per_host={"gpus": 2})
    data = batches()
    user = {"blocks.*.fc_in": "colwise", "blocks.*.fc_out": "rowwise"}
    ref, _ = reference(Mixer, SGD, data)
    losses, _ = run_plan(procs, Plan(tp=2, tp_plan=user), data, model_fn=Mixer)
    assert max(abs(a - b) for a, b in zip(losses, ref)) < TOL

    with pytest.raises(PlanError, match="default tensor-parallel plan found no"):
        spawn_trainer(procs, Mixer, lm_loss, SGD, Plan(tp=2), timeout=120)
    with pytest.raises(PlanError, match="tp=2 does not divide the 3 attention heads"):
        spawn_trainer(procs, partial(gpt, 64, 24, 3, 2, 16), lm_loss, SGD, Plan(tp=2), timeout=120)
    with pytest.raises(PlanError, match="needs 2 pipeline stages .* only 1 blocks"):
        spawn_trainer(procs, partial(gpt, 64, 32, 4, 1, 16), lm_loss, SGD, Plan(pp=2), timeout=120)
    trainer = spawn_trainer(procs, MODEL, lm_loss, SGD, Plan(fsdp=2), timeout=120)
    try:
        x, y = data[0]
        with pytest.raises(PlanError, match="multiple of 2"):
            trainer.step.call((x[:3], y[:3])).get(timeout=60)
        assert trainer.step.call(data[0]).get(timeout=60).values()[0] == pytest.approx(ref[0], abs=0.5)  # still usable
    finally:
        trainer.stop().get(timeout=60)


@pytest.mark.timeout(420)
def test_compile_and_activation_checkpointing_keep_the_numbers(spawn_procs: Any) -> None:
    procs = spawn_procs(per_host={"gpus": 2})
    data = batches(2)
    ref, model = reference(MODEL, SGD, data)
    for plan in (Plan(fsdp=2, compile=True, activation_checkpointing=True), Plan(tp=2, compile=True, activation_checkpointing=True)):
        trainer = spawn_trainer(procs, MODEL, lm_loss, SGD, plan, timeout=240)
        try:
            losses = [trainer.step.call(b).get(timeout=240).values()[0] for b in data]
            names = set(gather_state_dict(trainer))
        finally:
            trainer.stop().get(timeout=60)
        assert max(abs(a - b) for a, b in zip(losses, ref)) < TOL, (plan, losses, ref)
        assert names == set(model.state_dict())  # no wrapper/compile prefixes in checkpoints
