"""ActorMeshStrategy(procs, plan=...): Lightning's fit under FSDP2 / tensor parallel on real procs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from conftest import module_procs  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from actormesh.integrations.lightning import ActorMeshModelParallelStrategy, ActorMeshStrategy  # noqa: E402
from actormesh.parallel import Plan, PlanError  # noqa: E402
from actormesh.parallel.models import GPTConfig, gpt, lm_loss, synthetic_batches  # noqa: E402

CFG = GPTConfig(vocab_size=32, d_model=16, n_heads=2, n_blocks=2, seq_len=8)
N_SEQ, GLOBAL_BATCH, LR = 32, 8, 0.5


def dataset() -> TensorDataset:
    tokens, targets = next(synthetic_batches(CFG, batch_size=N_SEQ, seed=3))
    return TensorDataset(tokens, targets)


class TinyLM(L.LightningModule):
    """A GPT held as ``self.model`` (the plan finds its ``blocks``) plus a parameter outside it."""

    def __init__(self, extra_param: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = gpt(vocab_size=CFG.vocab_size, d_model=CFG.d_model, n_heads=CFG.n_heads, n_blocks=CFG.n_blocks,
                         seq_len=CFG.seq_len)
        # Used in training_step, outside the planned module: must still be trained in step on every rank.
        self.temperature = torch.nn.Parameter(torch.ones(1)) if extra_param else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self.model(tokens)
        loss = lm_loss(logits if self.temperature is None else logits * self.temperature, targets)
        self.log("train_loss", loss, sync_dist=True)
        q = self.model.blocks[0].attn.q.weight  # how much of it this rank holds: proof the plan was applied
        local = q.to_local() if isinstance(q, torch.distributed.tensor.DTensor) else q
        self.log("q_held", local.numel() / q.numel())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class SelfShardedLM(TinyLM):
    """Parallelises itself in configure_model, as Lightning's ModelParallelStrategy docs show."""

    def __init__(self) -> None:
        super().__init__(extra_param=False)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        dp_mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self.model, mesh=dp_mesh)


def reference_weights(steps: int, extra_param: bool = True) -> dict[str, torch.Tensor]:
    """One process, the global batch per step: what every plan must reproduce.

    Lightning gives each data-parallel rank a ``DistributedSampler(shuffle=True, seed=0)``:
    epoch 0 permutes with seed 0 and rank r takes every d-th index from r, so step k
    of all ranks together is the permutation's k-th slice of GLOBAL_BATCH.
    """
    model = TinyLM(extra_param)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    tokens, targets = dataset().tensors
    order = torch.randperm(N_SEQ, generator=torch.Generator().manual_seed(0))
    for k in range(steps):
        s = order[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        logits = model.model(tokens[s])
        lm_loss(logits if model.temperature is None else logits * model.temperature, targets[s]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit(procs: Any, tmp_path: Any, model: L.LightningModule, plan: Plan, **strategy_kw: Any) -> L.Trainer:
    strategy = ActorMeshStrategy(procs, plan=plan, failure_grace_s=20.0, setup_timeout_s=20.0, **strategy_kw)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=len(procs), max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    per_rank = GLOBAL_BATCH // (plan.dp * plan.fsdp)  # tensor-parallel ranks share their batch
    trainer.fit(model, train_dataloaders=DataLoader(dataset(), batch_size=per_rank, shuffle=False))
    return trainer


@pytest.fixture(scope="module")
def procs() -> Iterator[Any]:
    yield from module_procs({"gpus": 2})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("plan", [Plan(fsdp=2), Plan(tp=2), Plan(dp=2), Plan(fsdp=2, activation_checkpointing=True)],
                         ids=str)
def test_fit_under_a_plan_matches_one_process(procs: Any, tmp_path: Any, plan: Plan) -> None:
    model = TinyLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = fit(procs, tmp_path, model, plan)
    expected_type = ActorMeshModelParallelStrategy if plan.fsdp > 1 or plan.tp > 1 else ActorMeshStrategy
    assert type(trainer.strategy) is expected_type
    assert not torch.distributed.is_initialized()
    expected = reference_weights(steps=N_SEQ // GLOBAL_BATCH)
    got = model.state_dict()
    assert set(got) == set(expected)
    for name, value in got.items():
        assert not isinstance(value, torch.distributed.tensor.DTensor), name
        assert not torch.equal(value, before[name]), f"{name} did not train"
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert "train_loss" in trainer.callback_metrics
    assert trainer.callback_metrics["q_held"].item() == 1 / (plan.fsdp * plan.tp)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("plan", [Plan(fsdp=2, tp=2), Plan(dp=2, fsdp=2)], ids=str)
def test_two_dimensional_plans_on_four_procs(spawn_procs: Any, tmp_path: Any, plan: Plan) -> None:
    procs = spawn_procs(per_host={"gpus": 4})
    model = TinyLM()
    trainer = fit(procs, tmp_path, model, plan)
    expected = reference_weights(steps=N_SEQ // GLOBAL_BATCH)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert trainer.callback_metrics["q_held"].item() == 1 / (plan.fsdp * plan.tp)


@pytest.mark.timeout(180)
def test_a_configure_model_that_shards_itself_is_left_alone(procs: Any, tmp_path: Any) -> None:
    model = SelfShardedLM()
    fit(procs, tmp_path, model, Plan(fsdp=2))
    expected = reference_weights(steps=N_SEQ // GLOBAL_BATCH, extra_param=False)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_plans_lightning_cannot_run_are_refused_up_front(procs: Any) -> None:
    with pytest.raises(PlanError, match="pipeline"):
        ActorMeshStrategy(procs, plan=Plan(pp=2))
    with pytest.raises(PlanError, match="needs 4 procs.*has 2"):
        ActorMeshStrategy(procs, plan=Plan(fsdp=2, tp=2))
    with pytest.raises(PlanError, match="configure_model"):
        ActorMeshStrategy(procs, plan=Plan(dp=2, compile=True))
    with pytest.raises(TypeError, match="Plan"):
        ActorMeshStrategy(procs, plan={"fsdp": 2})


@pytest.mark.timeout(180)
def test_sharded_checkpoints_save_and_resume(procs: Any, tmp_path: Any) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(epochs: int) -> L.Trainer:
        return L.Trainer(strategy=ActorMeshStrategy(procs, plan=Plan(fsdp=2), setup_timeout_s=20.0), accelerator="cpu",
                         devices=2, max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt")], default_root_dir=str(tmp_path))

    data = DataLoader(dataset(), batch_size=GLOBAL_BATCH // 2, shuffle=False)
    first = trainer(1)
    first.fit(TinyLM(), train_dataloaders=data)
    path = first.checkpoint_callback.best_model_path
    assert path and (tmp_path / "ckpt").is_dir()
    assert any((tmp_path / "ckpt").rglob("*.distcp")), "expected one shard file per rank (a distributed checkpoint)"
    resumed = TinyLM()
    with torch.no_grad():  # other weights than the checkpoint's: only a real restore can match below
        for p in resumed.parameters():
            p.add_(1.0)
    second = trainer(2)
    second.fit(resumed, train_dataloaders=data, ckpt_path=path)
    assert second.state.finished
    # epoch 1 continued from epoch 0's weights: the same as two epochs straight through
    straight = TinyLM()
    trainer(2).fit(straight, train_dataloaders=data)
    for name, value in resumed.state_dict().items():
        torch.testing.assert_close(value, straight.state_dict()[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
