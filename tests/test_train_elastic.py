"""Training that survives a lost proc: SIGKILL a rank mid-run, the run goes on with the same losses;
user errors and exhausted restarts stop with a clear error and leave nothing running."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_train_data import ADAMW, MODEL, shards  # noqa: E402

from actormesh.parallel import Plan, Recovery, TrainingFailed, TrainOptionsError, spawn_elastic_trainer, spawn_trainer  # noqa: E402
from actormesh.parallel.models import lm_loss  # noqa: E402

STEPS, KILL_AFTER = 20, 7
_calls = {"n": 0}


def loss_failing_on_rank_1(outputs: Any, targets: Any, at_call: int = 3) -> Any:
    """lm_loss, except that rank 1 raises on its ``at_call``-th call (user code failing)."""
    _calls["n"] += 1
    if os.environ.get("RANK") == "1" and _calls["n"] >= at_call:
        raise ValueError("labels out of range on this shard")
    return lm_loss(outputs, targets)


def pid_of(trainer: Any, rank: int) -> int:
    return int(trainer.mesh.info.call().get(timeout=60).values()[rank]["pid"])


def test_recovery_options_are_checked() -> None:
    with pytest.raises(TrainOptionsError, match="checkpoint_every=0"):
        Recovery("/tmp/x", checkpoint_every=0)
    with pytest.raises(TrainOptionsError, match="max_restarts=-1"):
        Recovery("/tmp/x", max_restarts=-1)
    with pytest.raises(TypeError, match="recovery must be an actormesh.parallel.Recovery"):
        spawn_elastic_trainer(MODEL, lm_loss, ADAMW, Plan(dp=2), recovery={"checkpoint_dir": "/tmp"})  # type: ignore[arg-type]


@pytest.mark.timeout(150)
def test_a_rank_killed_at_step_7_of_20_costs_nothing_but_time(spawn_procs: Any, tmp_path: Any, faults: Any) -> None:
    procs = spawn_procs(per_host={"gpus": 2})
    plain = spawn_trainer(procs, MODEL, lm_loss, ADAMW, Plan(fsdp=2), data=shards, timeout=120)
    try:
        expected = [plain.step.call().get(timeout=60).values()[0] for _ in range(STEPS)]
    finally:
        plain.stop().get(timeout=60)

    recovery = Recovery(str(tmp_path), checkpoint_every=5, max_restarts=1)
    with spawn_elastic_trainer(MODEL, lm_loss, ADAMW, Plan(fsdp=2), data=shards, recovery=recovery, timeout=120) as trainer:
        figures = [trainer.step_figures() for _ in range(KILL_AFTER)]
        victim = pid_of(trainer, 1)
        os.kill(victim, signal.SIGKILL)
        figures += [trainer.step_figures() for _ in range(STEPS - KILL_AFTER)]
        assert pid_of(trainer, 1) != victim
    losses = [f.loss for f in figures]
    after = figures[KILL_AFTER]
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-6, (losses, expected, after.recovery)
    assert after.restarts == 1 and after.recovery is not None, after
    assert "rank 1 lost at step 8" in after.recovery and "restored step 5 from checkpoint" in after.recovery, after.recovery
    assert "replayed 2 step(s)" in after.recovery and "Killed(sig=9)" in after.recovery, after.recovery
    assert all(f.recovery is None for i, f in enumerate(figures) if i != KILL_AFTER)
    assert sorted(os.listdir(tmp_path)) == ["step_00000020"]  # older checkpoints removed once the next is complete
    assert faults.failures == []  # handled by the trainer, not escalated to the controller


@pytest.mark.timeout(120)
def test_user_code_failing_stops_with_the_rank_and_cause_and_never_restarts(tmp_path: Any) -> None:
    recovery = Recovery(str(tmp_path), checkpoint_every=2, max_restarts=3)
    with spawn_elastic_trainer(MODEL, loss_failing_on_rank_1, ADAMW, Plan(dp=2), data=shards, recovery=recovery, timeout=120) as trainer:
        trainer.step()
        trainer.step()
        with pytest.raises(TrainingFailed, match=r"stopped at step 3: user code raised on rank 1: ValueError: labels out of range") as caught:
            trainer.step()
        assert caught.value.rank == 1 and trainer.restarts == 0


@pytest.mark.timeout(120)
def test_past_max_restarts_the_run_stops_naming_the_rank(tmp_path: Any) -> None:
    recovery = Recovery(str(tmp_path), checkpoint_every=2, max_restarts=0)
    with spawn_elastic_trainer(MODEL, lm_loss, ADAMW, Plan(dp=2), data=shards, recovery=recovery, timeout=120) as trainer:
        trainer.step()
        os.kill(pid_of(trainer, 0), signal.SIGKILL)
        with pytest.raises(TrainingFailed, match=r"rank 0 lost at step 2 \(.*Killed\(sig=9\).*\), and all 0 restarts are used"):
            trainer.step()


@pytest.mark.timeout(120)
def test_batches_sent_by_the_controller_are_replayed_when_no_checkpoint_exists_yet(tmp_path: Any) -> None:
    """Killed before the first checkpoint: the initial weights again, and the sent batches since then replayed."""
    from test_train_data import global_batches

    data = global_batches(4)
    torch.manual_seed(0)
    model = MODEL()
    opt = ADAMW(model.parameters())
    expected = []
    for x, y in data:  # the same training in this process
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    recovery = Recovery(str(tmp_path), checkpoint_every=100, max_restarts=1)
    with spawn_elastic_trainer(MODEL, lm_loss, ADAMW, Plan(dp=2), recovery=recovery, timeout=120) as trainer:
        losses = [trainer.step(b) for b in data[:2]]
        os.kill(pid_of(trainer, 1), signal.SIGKILL)
        figures = [trainer.step_figures(b) for b in data[2:]]
    assert figures[0].recovery is not None and "restored step 0 from the initial weights (no checkpoint yet), replayed 2 step(s)" in figures[0].recovery
    losses += [f.loss for f in figures]
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-5, (losses, expected)


@pytest.mark.timeout(120)
def test_a_new_controller_resumes_from_the_newest_complete_checkpoint(tmp_path: Any) -> None:
    recovery = Recovery(str(tmp_path), checkpoint_every=3, max_restarts=0)
    with spawn_elastic_trainer(MODEL, lm_loss, ADAMW, Plan(dp=2), data=shards, recovery=recovery, timeout=120) as first:
        whole = [first.step() for _ in range(5)]
    os.makedirs(tmp_path / "step_00000009")  # a save that never completed (no .metadata): skipped
    resumed = Recovery(str(tmp_path), checkpoint_every=3, max_restarts=0, resume=True)
    with spawn_elastic_trainer(MODEL, lm_loss, ADAMW, Plan(fsdp=2), data=shards, recovery=resumed, timeout=120) as second:
        assert second.steps == 3 and second.last_checkpoint == str(tmp_path / "step_00000003")
        again = [second.step() for _ in range(2)]
    assert max(abs(a - b) for a, b in zip(again, whole[3:])) < 1e-5, (again, whole)
