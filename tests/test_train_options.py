"""Trainer options: clipping by global norm, accumulation, LR schedules, mixed precision, per-step figures.

Each plan runs the same seeded model and data as a plain single-process
loop using torch's own ``clip_grad_norm_`` and ``LambdaLR``; the losses and
gradient norms must match it, which is what "the norm over all shards, not
per rank" means. One module-scoped mesh of 2 procs serves every test.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from conftest import module_procs  # noqa: E402

from actormesh.parallel import LRSchedule, Plan, PlanError, StepFigures, TrainOptions, TrainOptionsError, spawn_trainer  # noqa: E402
from actormesh.parallel.models import GPTConfig, gpt, lm_loss, synthetic_batches  # noqa: E402

CFG = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_blocks=2, seq_len=16)
MODEL = partial(gpt, CFG.vocab_size, CFG.d_model, CFG.n_heads, CFG.n_blocks, CFG.seq_len)
SGD = partial(torch.optim.SGD, lr=0.5)
SCHEDULE = LRSchedule(warmup_steps=1, total_steps=3, decay="cosine", min_lr_ratio=0.1)
MAX_NORM = 0.5  # below the model's gradient norms (~0.55), so every step clips
BATCH, STEPS, TOL = 8, 3, 1e-5


@pytest.fixture(scope="module")
def procs() -> Iterator[Any]:
    yield from module_procs({"gpus": 2})


def batches(n: int = STEPS) -> list[tuple[Any, Any]]:
    return [b for _, b in zip(range(n), synthetic_batches(CFG, BATCH, seed=1))]


def reference(data: list[Any], max_norm: float | None = MAX_NORM) -> tuple[list[float], list[float], list[float]]:
    """One process, torch's own clipping and scheduler: losses, gradient norms, learning rates."""
    torch.manual_seed(0)
    model = MODEL()
    opt = SGD(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, SCHEDULE.factor)
    losses, norms, lrs = [], [], []
    for x, y in data:
        loss = lm_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm is not None else float("inf"))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
        norms.append(float(norm))
    return losses, norms, lrs


def run(procs: Any, plan: Plan, options: TrainOptions, data: list[Any]) -> list[StepFigures]:
    trainer = spawn_trainer(procs, MODEL, lm_loss, SGD, plan, options=options, timeout=120)
    try:
        out = []
        for batch in data:
            per_rank = trainer.step_figures.call(batch).get(timeout=120).values()
            assert len({(f.loss, f.grad_norm, f.lr) for f in per_rank}) == 1, f"{plan}: ranks disagree: {per_rank}"
            out.append(per_rank[0])
        return out
    finally:
        trainer.stop().get(timeout=60)


# ------------------------------------------------------------------ no procs


@pytest.mark.parametrize("kwargs, message", [
    ({"max_grad_norm": -1.0}, r"max_grad_norm=-1.0\) must be a positive finite number"),
    ({"max_grad_norm": 0}, "max_grad_norm"),
    ({"max_grad_norm": float("inf")}, "max_grad_norm"),
    ({"grad_accum_steps": 0}, r"grad_accum_steps=0\) must be an int >= 1"),
    ({"grad_accum_steps": 2.0}, "grad_accum_steps"),
    ({"lr_schedule": "cosine"}, "must be an LRSchedule or a factory"),
    ({"param_dtype": "int8"}, "not a floating point dtype"),
    ({"flops_per_token": -5}, "flops_per_token"),
    ({"peak_flops": "fast"}, "peak_flops"),
])
def test_options_refuse_nonsense(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TrainOptionsError, match=message):
        TrainOptions(**kwargs)


def test_options_normalise_dtypes_and_schedules_check_their_length() -> None:
    assert TrainOptions(param_dtype=torch.bfloat16, reduce_dtype="fp32").param_dtype == "bfloat16"
    assert TrainOptions(reduce_dtype="fp32").reduce_dtype == "float32"
    with pytest.raises(TrainOptionsError, match="needs total_steps > warmup_steps=10"):
        LRSchedule(warmup_steps=10, total_steps=5)
    with pytest.raises(TrainOptionsError, match="decay"):
        LRSchedule(decay="step", total_steps=5)
    with pytest.raises(TrainOptionsError, match="min_lr_ratio"):
        LRSchedule(total_steps=5, min_lr_ratio=2)
    s = LRSchedule(warmup_steps=2, total_steps=6, decay="linear", min_lr_ratio=0.0)
    assert [s.factor(i) for i in range(7)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])
    c = LRSchedule(warmup_steps=0, total_steps=2, decay="cosine", min_lr_ratio=0.2)
    assert [c.factor(i) for i in range(3)] == pytest.approx([1.0, 0.6, 0.2])
    assert LRSchedule(decay="constant").factor(100) == 1.0


def test_spawn_trainer_refuses_options_of_the_wrong_type(procs: Any) -> None:
    with pytest.raises(TypeError, match="options must be an actormesh.parallel.TrainOptions"):
        spawn_trainer(procs, MODEL, lm_loss, SGD, Plan(dp=2), options={"max_grad_norm": 1.0})  # type: ignore[arg-type]


# -------------------------------------------------------------- distributed


@pytest.mark.timeout(180)
def test_clipping_accumulation_and_schedule_match_one_process_under_every_plan(procs: Any) -> None:
    """The global norm (all shards, all stages) is clipped: losses, norms and lrs equal torch's single-process loop."""
    data = batches()
    ref_losses, ref_norms, ref_lrs = reference(data)
    assert all(n > MAX_NORM for n in ref_norms)  # clipping did something at every step
    options = TrainOptions(max_grad_norm=MAX_NORM, grad_accum_steps=2, lr_schedule=SCHEDULE)
    report = []
    for plan in (Plan(dp=2), Plan(fsdp=2), Plan(tp=2), Plan(pp=2)):
        figures = run(procs, plan, options, data)
        losses, norms = [f.loss for f in figures], [f.grad_norm for f in figures]
        report.append(f"{plan}: losses {losses} norms {norms}")
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL, report[-1]
        assert norms == pytest.approx(ref_norms, rel=1e-4), report[-1]
        assert [f.lr for f in figures] == pytest.approx(ref_lrs), report[-1]
    print("\n".join(report))


@pytest.mark.timeout(120)
def test_mixed_precision_under_every_plan(procs: Any) -> None:
    """bf16 compute changes the numbers a little (the policy or autocast is in effect) but trains the same model."""
    data = batches(2)
    ref_losses, _, _ = reference(data, max_norm=None)
    bf16 = TrainOptions(param_dtype="bf16", reduce_dtype="fp32", lr_schedule=SCHEDULE)
    ddp = TrainOptions(param_dtype="bf16", reduce_dtype="fp16", lr_schedule=SCHEDULE)
    for plan, options in ((Plan(fsdp=2), bf16), (Plan(dp=2), ddp), (Plan(tp=2), bf16), (Plan(pp=2), bf16)):
        losses = [f.loss for f in run(procs, plan, options, data)]
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        assert 1e-6 < diff < 0.05, (plan, losses, ref_losses)
    with pytest.raises(PlanError, match=r"reduce_dtype='bf16'\) under DDP .* needs CUDA"):
        spawn_trainer(procs, MODEL, lm_loss, SGD, Plan(dp=2), options=TrainOptions(reduce_dtype="bf16"), timeout=120)


@pytest.mark.timeout(120)
def test_figures_and_the_plain_step_endpoint(procs: Any) -> None:
    data = batches(2)
    options = TrainOptions(lr_schedule=partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
                           flops_per_token=1000.0, peak_flops=1e9)
    trainer = spawn_trainer(procs, MODEL, lm_loss, SGD, Plan(fsdp=2), options=options, timeout=120)
    try:
        first = trainer.step_figures.call(data[0]).get(timeout=60).values()[0]
        loss = trainer.step.call(data[1]).get(timeout=60).values()  # the plain endpoint still returns floats
        third = trainer.step_figures.call(data[0]).get(timeout=60).values()[0]
    finally:
        trainer.stop().get(timeout=60)
    assert isinstance(loss[0], float) and len(set(loss)) == 1
    assert (first.step, third.step) == (1, 3)
    assert (first.lr, third.lr) == pytest.approx((0.5, 0.125))  # StepLR halves after each step
    assert first.tokens == data[0][0].numel() and first.tokens_per_s > 0 and first.step_s > 0
    assert first.mfu == pytest.approx(first.tokens_per_s * 1000.0 / (1e9 * 2))
    assert len(first.peak_memory_bytes) == 2 and all(m > 10 * 2**20 for m in first.peak_memory_bytes)
    assert first.memory_kind == "rss_peak" and first.grad_norm > 0
    assert set(first.as_dict()) >= {"loss", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_memory_bytes"}


@pytest.mark.timeout(120)
def test_a_batch_that_does_not_split_into_micro_steps_is_refused_and_the_trainer_goes_on(procs: Any) -> None:
    options = TrainOptions(grad_accum_steps=3, peak_flops="measure")
    trainer = spawn_trainer(procs, MODEL, lm_loss, SGD, Plan(dp=2), options=options, timeout=120)
    try:
        x, y = batches(1)[0]
        with pytest.raises(PlanError, match=r"do not split into grad_accum_steps=3 micro-steps: use a batch size that is a multiple of 6"):
            trainer.step.call((x, y)).get(timeout=60)
        x6, y6 = torch.cat([x, x])[:12], torch.cat([y, y])[:12]
        fig = trainer.step_figures.call((x6, y6)).get(timeout=60).values()[0]
    finally:
        trainer.stop().get(timeout=60)
    assert fig.step == 1 and fig.mfu is not None and 0 < fig.mfu < 1  # against a matmul peak measured on the ranks
