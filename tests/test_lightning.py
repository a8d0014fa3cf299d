"""ActorMeshStrategy: Lightning's Trainer.fit as DDP on real procs, driven from here."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from conftest import module_procs  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from actormesh.actor import ActorError, SupervisionError  # noqa: E402
from actormesh.integrations.lightning import ActorMeshStrategy  # noqa: E402

N_SAMPLES, PER_RANK_BATCH, LR = 64, 8, 0.1


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.3
    return TensorDataset(x, y)


class Regression(L.LightningModule):
    """Linear regression; ``fail_on`` = (rank, step) raises ValueError there, ``die_on`` SIGKILLs the proc."""

    def __init__(self, fail_on: tuple[int, int] | None = None, die_on: tuple[int, int] | None = None) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layer = torch.nn.Linear(4, 1)
        self.fail_on, self.die_on = fail_on, die_on

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_on == (self.global_rank, batch_idx):
            raise ValueError(f"boom on rank {self.global_rank}")
        if self.die_on == (self.global_rank, batch_idx):
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)

    def on_train_epoch_end(self) -> None:
        self.log("world", float(self.trainer.world_size))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def make_trainer(procs: Any, tmp_path: Any, **kw: Any) -> L.Trainer:
    strategy = ActorMeshStrategy(procs, failure_grace_s=kw.pop("failure_grace_s", 20.0), setup_timeout_s=20.0)
    opts: dict[str, Any] = dict(accelerator="cpu", devices=2, max_epochs=2, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    opts.update(kw)
    return L.Trainer(strategy=strategy, **opts)


def loader() -> DataLoader:
    return DataLoader(dataset(), batch_size=PER_RANK_BATCH, shuffle=False)


def reference_weights(epochs: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One process, global batch 2 * PER_RANK_BATCH: what 2-rank DDP must reproduce.

    Lightning gives each rank a ``DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED or 0)``:
    epoch e permutes the indices with seed + e and rank r takes every 2nd from r,
    so step k of both ranks together is the permutation's k-th slice of 16.
    """
    model = Regression()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x_all, y_all = dataset().tensors
    for epoch in range(epochs):
        order = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(seed + epoch))
        for i in range(0, N_SAMPLES, 2 * PER_RANK_BATCH):
            idx = order[i:i + 2 * PER_RANK_BATCH]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model.layer(x_all[idx]), y_all[idx]).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def procs() -> Iterator[Any]:
    yield from module_procs({"gpus": 2})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [None, 5])
def test_fit_matches_single_process_and_brings_back_metrics(procs: Any, tmp_path: Any, seed: int | None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if seed is not None:  # what seed_everything(seed) sets: the procs must see it too
        monkeypatch.setenv("PL_GLOBAL_SEED", str(seed))
    model = Regression()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer(procs, tmp_path)
    trainer.fit(model, train_dataloaders=loader())
    assert not torch.distributed.is_initialized()  # the controller never joined a process group
    expected = reference_weights(epochs=2, seed=seed or 0)
    for name, value in model.state_dict().items():
        assert not torch.equal(value, before[name])
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)
    assert trainer.state.finished and trainer.state.fn == "fit"
    # the fit loop's progress came back: 2 epochs of 64 samples in global batches of 16
    assert (trainer.current_epoch, trainer.global_step) == (2, 8)
    assert set(trainer.callback_metrics) >= {"train_loss", "world"}
    assert trainer.callback_metrics["world"].item() == 2.0
    assert trainer.logged_metrics["world"].item() == 2.0


@pytest.mark.timeout(120)
def test_failing_rank_fails_fit_with_its_exception_and_procs_stay_usable(procs: Any, tmp_path: Any) -> None:
    trainer = make_trainer(procs, tmp_path, max_epochs=1)
    with pytest.raises(ValueError, match="boom on rank 1") as info:
        trainer.fit(Regression(fail_on=(1, 1)), train_dataloaders=loader())
    assert isinstance(info.value, ActorError)
    assert trainer.interrupted
    # both ranks destroyed their process group: the same procs train again
    model = Regression()
    make_trainer(procs, tmp_path, max_epochs=1).fit(model, train_dataloaders=loader())
    assert not torch.equal(model.layer.weight, Regression().layer.weight)


def test_validate_returns_rank_zeros_results_reduced_over_ranks(procs: Any, tmp_path: Any) -> None:
    model = Regression()
    results = make_trainer(procs, tmp_path).validate(model, loader(), verbose=False)
    x, y = dataset().tensors
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(model.layer(x), y).item()
    assert results[0]["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_devices_must_match_the_mesh(procs: Any, tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"devices=3.*2 procs"):
        make_trainer(procs, tmp_path, devices=3)
    with pytest.raises(ValueError, match=r"num_nodes=2.*2 procs"):
        make_trainer(procs, tmp_path, devices=2, num_nodes=2)


def test_fit_twice_on_one_trainer_is_refused(procs: Any, tmp_path: Any) -> None:
    trainer = make_trainer(procs, tmp_path, max_epochs=1)
    trainer.fit(Regression(), train_dataloaders=loader())
    with pytest.raises(NotImplementedError, match="new Trainer"):
        trainer.fit(Regression(), train_dataloaders=loader())


@pytest.mark.timeout(120)
def test_dead_proc_fails_fit_instead_of_hanging(spawn_procs: Any, tmp_path: Any) -> None:
    pm = spawn_procs(per_host={"gpus": 2})
    trainer = make_trainer(pm, tmp_path, max_epochs=1, failure_grace_s=5.0)
    with pytest.raises(SupervisionError):
        trainer.fit(Regression(die_on=(1, 1)), train_dataloaders=loader())
