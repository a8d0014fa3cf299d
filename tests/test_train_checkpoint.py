"""Trainer checkpoints (DCP): model, optimizer, LR schedule and data position, resumed under another plan;
a checkpoint of another model is refused before any tensor is read, naming the first mismatched key."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from conftest import module_procs  # noqa: E402
from test_train_data import shards  # noqa: E402

from actormesh.parallel import CheckpointMismatch, LRSchedule, Plan, TrainOptions, spawn_trainer  # noqa: E402
from actormesh.parallel.models import gpt, lm_loss  # noqa: E402

MODEL = partial(gpt, 64, 32, 4, 2, 16)
ADAMW = partial(torch.optim.AdamW, lr=1e-2)
OPTIONS = TrainOptions(max_grad_norm=1.0, lr_schedule=LRSchedule(warmup_steps=2, total_steps=5, decay="linear"))
TOL = 1e-5


@pytest.fixture(scope="module")
def procs() -> Iterator[Any]:
    yield from module_procs({"gpus": 2})


def figures(trainer: Any, steps: int) -> list[tuple[float, float]]:
    out = []
    for _ in range(steps):
        f = trainer.step_figures.call().get(timeout=120).values()[0]
        out.append((f.loss, f.lr))
    return out


@pytest.mark.timeout(120)
def test_schedule_optimizer_and_data_resume_under_another_plan(procs: Any, tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    whole_trainer = spawn_trainer(procs, MODEL, lm_loss, ADAMW, Plan(fsdp=2), options=OPTIONS, data=shards, timeout=120)
    try:
        whole = figures(whole_trainer, 5)
    finally:
        whole_trainer.stop().get(timeout=60)
    first = spawn_trainer(procs, MODEL, lm_loss, ADAMW, Plan(fsdp=2), options=OPTIONS, data=shards, timeout=120)
    try:
        before = figures(first, 3)
        first.save.call(path).get(timeout=60)
    finally:
        first.stop().get(timeout=60)
    for plan in (Plan(pp=2), Plan(tp=2)):
        second = spawn_trainer(procs, MODEL, lm_loss, ADAMW, plan, options=OPTIONS, data=shards, timeout=120)
        try:
            assert second.load.call(path).get(timeout=60).values() == [3, 3]
            after = figures(second, 2)
        finally:
            second.stop().get(timeout=60)
        got = before + after
        assert [lr for _, lr in got] == pytest.approx([lr for _, lr in whole]), (plan, got, whole)  # schedule resumed mid-decay
        assert max(abs(a[0] - b[0]) for a, b in zip(got, whole)) < TOL, (plan, got, whole)


@pytest.mark.timeout(120)
def test_a_checkpoint_of_another_model_names_the_first_mismatched_key(procs: Any, tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    first = spawn_trainer(procs, MODEL, lm_loss, ADAMW, Plan(dp=2), timeout=120)
    try:
        first.save.call(path).get(timeout=60)
    finally:
        first.stop().get(timeout=60)
    cases = [
        (partial(gpt, 64, 48, 4, 2, 16), r"first mismatched key 'tok_emb.weight' has shape \[64, 32\] in the checkpoint, \[64, 48\] in the model"),
        (partial(gpt, 64, 32, 4, 3, 16), r"first mismatched key 'blocks.2.attn_norm.weight' is in the model but not in the checkpoint"),
        (partial(gpt, 64, 32, 4, 1, 16), r"first mismatched key 'blocks.1.attn_norm.weight' is in the checkpoint but not in the model"),
    ]
    for model_fn, message in cases:
        other = spawn_trainer(procs, model_fn, lm_loss, ADAMW, Plan(fsdp=2), timeout=120)
        try:
            with pytest.raises(CheckpointMismatch, match=message):
                other.load.call(path).get(timeout=60)
            other.step.call((torch.zeros(2, 16, dtype=torch.long),) * 2).get(timeout=60)  # every rank refused alike: none is stuck
        finally:
            other.stop().get(timeout=60)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        trainer = spawn_trainer(procs, MODEL, lm_loss, ADAMW, Plan(dp=2), timeout=120)
        try:
            trainer.load.call(str(tmp_path / "missing")).get(timeout=60)
        finally:
            trainer.stop().get(timeout=60)
