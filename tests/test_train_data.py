"""Data read on the ranks: each data-parallel rank builds its iterator from a factory, steps carry no data.

The factories below are deterministic in their arguments, so a factory-fed
run must give the same losses as the controller sending the global batches,
and a run resumed from a checkpoint the same losses as one never stopped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from conftest import module_procs  # noqa: E402

from actormesh.parallel import Plan, TrainDataError, spawn_trainer  # noqa: E402
from actormesh.parallel.models import GPTConfig, gpt, lm_loss, synthetic_batches  # noqa: E402

CFG = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_blocks=2, seq_len=16)
MODEL = partial(gpt, CFG.vocab_size, CFG.d_model, CFG.n_heads, CFG.n_blocks, CFG.seq_len)
ADAMW = partial(torch.optim.AdamW, lr=1e-2)
BATCH, TOL = 8, 1e-5


@pytest.fixture(scope="module")
def procs() -> Iterator[Any]:
    yield from module_procs({"gpus": 2})


def global_batches(n: int, seed: int = 1) -> list[tuple[Any, Any]]:
    return [b for _, b in zip(range(n), synthetic_batches(CFG, BATCH, seed=seed))]


def shards(dp_rank: int, dp_size: int, start_step: int, seed_by_rank: bool = False) -> Iterator[tuple[Any, Any]]:
    """This data-parallel rank's contiguous share of each global batch, from batch ``start_step`` on.

    ``seed_by_rank``: a factory that would give every *rank* (not data-parallel
    rank) other data, to show that tensor/pipeline peers get their leader's batch.
    """
    seed = 1 + (100 * int(os.environ["RANK"]) if seed_by_rank else 0)
    n = BATCH // dp_size
    for i, (x, y) in enumerate(synthetic_batches(CFG, BATCH, seed=seed)):
        if i >= start_step:
            yield x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]


def broken(dp_rank: int, dp_size: int, start_step: int) -> Iterator[Any]:
    if dp_rank == 1:
        raise ValueError("no shard file for dp_rank 1")
    return shards(dp_rank, dp_size, start_step)


def one_batch(dp_rank: int, dp_size: int, start_step: int) -> Iterator[Any]:
    return iter([next(shards(dp_rank, dp_size, start_step))])


def losses_of(trainer: Any, steps: int, batches: list[Any] | None = None) -> list[float]:
    out = []
    for i in range(steps):
        per_rank = trainer.step.call(*([batches[i]] if batches else [])).get(timeout=120).values()
        assert len(set(per_rank)) == 1, per_rank
        out.append(per_rank[0])
    return out


def train(procs: Any, plan: Plan, steps: int, batches: list[Any] | None = None, **kw: Any) -> list[float]:
    trainer = spawn_trainer(procs, MODEL, lm_loss, ADAMW, plan, timeout=120, **kw)
    try:
        return losses_of(trainer, steps, batches)
    finally:
        trainer.stop().get(timeout=60)


@pytest.mark.timeout(120)
def test_ranks_read_their_shards_and_match_batches_sent_by_the_controller(procs: Any) -> None:
    sent = train(procs, Plan(dp=2), 3, batches=global_batches(3))
    for plan in (Plan(dp=2), Plan(fsdp=2)):
        assert max(abs(a - b) for a, b in zip(train(procs, plan, 3, data=shards), sent)) < TOL, plan


@pytest.mark.timeout(120)
def test_tensor_and_pipeline_peers_see_their_leaders_batch(procs: Any) -> None:
    """Every rank's factory would read other data; the peers train on the leader's (rank 0's) batches."""
    sent = train(procs, Plan(tp=2), 3, batches=global_batches(3))
    for plan in (Plan(tp=2), Plan(pp=2)):
        got = train(procs, plan, 3, data=partial(shards, seed_by_rank=True))
        assert max(abs(a - b) for a, b in zip(got, sent)) < TOL, (plan, got, sent)


@pytest.mark.timeout(120)
def test_a_failing_factory_is_reported_once_with_rank_and_traceback(procs: Any) -> None:
    trainer = spawn_trainer(procs, MODEL, lm_loss, ADAMW, Plan(dp=2), data=broken, timeout=120)
    try:
        with pytest.raises(TrainDataError) as caught:
            trainer.step.call().get(timeout=60)
        text = str(caught.value)
        assert "the data factory failed on rank 1 (dp_rank 1 of 2) at batch 0: ValueError: no shard file for dp_rank 1" in text
        assert "traceback on rank 1" in text and "in broken" in text, text
        assert text.count("the data factory failed") == 1 and text.count("traceback on rank") == 1, text  # once, not per rank
        # Neither rank is stuck in a collective: a batch from the controller still trains.
        assert losses_of(trainer, 1, global_batches(1))[0] > 0
    finally:
        trainer.stop().get(timeout=60)


@pytest.mark.timeout(120)
def test_an_ended_iterator_and_a_step_without_data_are_clear_errors(procs: Any) -> None:
    trainer = spawn_trainer(procs, MODEL, lm_loss, ADAMW, Plan(dp=2), data=one_batch, timeout=120)
    try:
        trainer.step.call().get(timeout=60)
        with pytest.raises(TrainDataError, match="at batch 1: its iterator has no more batches"):
            trainer.step.call().get(timeout=60)
    finally:
        trainer.stop().get(timeout=60)
    trainer = spawn_trainer(procs, MODEL, lm_loss, ADAMW, Plan(dp=2), timeout=120)
    try:
        with pytest.raises(TypeError, match=r"step\(\) without a batch reads the data on the ranks: pass spawn_trainer\(..., data=factory\)"):
            trainer.step.call().get(timeout=60)
    finally:
        trainer.stop().get(timeout=60)
    with pytest.raises(TypeError, match="data must be a factory"):
        spawn_trainer(procs, MODEL, lm_loss, ADAMW, Plan(dp=2), data=[1, 2])  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_the_data_position_is_checkpointed_and_resumes_exactly(procs: Any, tmp_path: Any) -> None:
    whole = train(procs, Plan(dp=2), 4, data=shards)
    first = spawn_trainer(procs, MODEL, lm_loss, ADAMW, Plan(dp=2), data=shards, timeout=120)
    try:
        before = losses_of(first, 2)
        first.save.call(str(tmp_path / "ckpt")).get(timeout=60)
    finally:
        first.stop().get(timeout=60)
    second = spawn_trainer(procs, MODEL, lm_loss, ADAMW, Plan(fsdp=2), data=shards, timeout=120)
    try:
        assert second.load.call(str(tmp_path / "ckpt")).get(timeout=60).values() == [2, 2]
        after = losses_of(second, 2)
    finally:
        second.stop().get(timeout=60)
    assert max(abs(a - b) for a, b in zip(before + after, whole)) < TOL, (before + after, whole)
