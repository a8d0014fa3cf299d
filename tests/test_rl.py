"""Post-training (actormesh.rl): GRPO's arithmetic, the replay buffer, and the loop on real procs.

The loop tests use a tiny random Llama and the toy task of examples/grpo.py
(the letter after a letter); they check the mechanics (versions, weight sync,
recovery of dropped samples, modes, stopping), not learning, which the demo shows.
"""

from __future__ import annotations

import asyncio
import math
import os
from functools import partial
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from actormesh.actor import this_proc  # noqa: E402
from actormesh.parallel import Plan, gather_state_dict, load_weights  # noqa: E402
from actormesh.parallel.hf import hf_causal_lm  # noqa: E402
from actormesh.rl import GRPOConfig, GRPOLoop, ReplayBuffer, Sample, group_advantages, grpo_loss, pack_batch  # noqa: E402
from actormesh.serve import SamplingParams  # noqa: E402

CONFIG = dict(vocab_size=27, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=8, tie_word_embeddings=False)
MODEL = partial(hf_causal_lm, transformers.LlamaConfig(**CONFIG), "LlamaForCausalLM")


def letter_reward(prompt: list[int], completion: list[int]) -> float:
    return 1.0 if completion[:1] == [(prompt[-1] + 1) % 26] else 0.0


def prompts(step: int) -> list[list[int]]:
    return [[26, (step * 5 + i) % 26] for i in range(2)]


# ------------------------------------------------------------------ arithmetic


def test_advantages_are_relative_to_the_group() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], 4)
    assert adv[4:] == [0.0] * 4  # a group that scores alike teaches nothing
    assert adv[0] > 0 > adv[1] and math.isclose(sum(adv[:4]), 0.0, abs_tol=1e-9)
    assert math.isclose(adv[0], 0.75 / (math.sqrt(3) / 4 + 1e-4), rel_tol=1e-6)
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages([1.0, 0.0, 1.0], 4)


def test_the_loss_is_the_clipped_surrogate_plus_the_kl_penalty() -> None:
    torch.manual_seed(0)
    samples = [Sample([26, 3], [4, 5], [-1.0, -2.0], 0, advantage=1.0), Sample([26, 7, 1], [9], [-0.5], 0, advantage=-2.0)]
    inputs, targets = pack_batch(samples)
    assert inputs.tolist() == [[26, 3, 4], [26, 7, 1]]
    assert targets[..., 1].tolist() == [[0, 1, 1], [0, 0, 1]]  # the logits that predict completion tokens
    logits = torch.randn(2, 3, 27, requires_grad=True)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., 0].long()[..., None])[..., 0]
    # old log-probs equal to the current ones: ratio 1, the loss is minus the mean advantage per token
    targets[..., 3] = logp.detach()
    targets[..., 4] = logp.detach()
    assert torch.isclose(grpo_loss(logits, targets), torch.tensor(-(1.0 + 1.0 - 2.0) / 3))
    assert torch.isclose(grpo_loss(logits, targets, norm="sequence"), torch.tensor(-(1.0 - 2.0) / 2))
    assert torch.isclose(grpo_loss(logits, targets, kl_coef=5.0), torch.tensor(0.0))  # the reference agrees: no KL
    # a ratio far above 1 + eps with a positive advantage is clipped: no gradient from it
    targets[0, 1:, 3] = logp[0, 1:].detach() - 1.0
    grpo_loss(logits, targets).backward()
    assert logits.grad[0, 1:].abs().sum() == 0 and logits.grad[1, 2].abs().sum() > 0
    # a reference away from the policy costs KL
    targets[..., 4] = logp.detach() - 0.5
    assert grpo_loss(logits, targets, kl_coef=1.0) > grpo_loss(logits, targets, kl_coef=0.0)


def test_configs_that_make_no_sense_are_refused() -> None:
    with pytest.raises(ValueError, match="group_size must be an int >= 2"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="mode must be"):
        GRPOConfig(mode="eventually")
    with pytest.raises(ValueError, match="norm must be"):
        GRPOConfig(norm="per-batch")
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        GRPOConfig(group_size=4).check_batch(6)


def test_the_buffer_drops_groups_older_than_the_policy_lag() -> None:
    buffer = this_proc().spawn("rl-buffer-test", ReplayBuffer, 1)
    try:
        for version in (0, 1, 2):
            buffer.add.call_one([Sample([1], [2], [-1.0], version), Sample([1], [3], [-1.0], version)]).get(timeout=10)
        assert buffer.take.call_one(3, 2).get(timeout=10) is None  # the version-0 group is too old: 2 left
        groups = buffer.take.call_one(2, 2).get(timeout=10)
        assert [g[0].version for g in groups] == [1, 2]
        assert buffer.stats.call_one().get(timeout=10) | {} == {"held": 0, "added": 3, "taken": 2, "dropped_stale": 1,
                                                                   "dropped_full": 0}
    finally:
        buffer.stop().get(timeout=10)


# ------------------------------------------------------------------ the loop on procs


async def greedy(generator: Any, prompt: list[int]) -> list[int]:
    return [t async for t in generator.generate(prompt, SamplingParams(max_tokens=1))]


def local_greedy(weights: dict[str, Any], prompt: list[int]) -> list[int]:
    model = MODEL().eval()
    load_weights([model], weights)
    with torch.no_grad():
        return [int(model(torch.tensor([prompt]))[0, -1].argmax())]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_loop_trains_syncs_weights_and_survives_a_raising_reward(mode: str) -> None:
    calls = {"n": 0}

    def flaky_reward(prompt: list[int], completion: list[int]) -> float:
        calls["n"] += 1
        if calls["n"] % 7 == 0:
            raise KeyError("no such letter")
        return letter_reward(prompt, completion)

    config = GRPOConfig(group_size=4, prompts_per_step=2, max_tokens=1, kl_coef=0.01, mode=mode, max_policy_lag=1)
    with GRPOLoop(MODEL, flaky_reward, prompts, config, partial(torch.optim.AdamW, lr=1e-2), trainer_plan=Plan(dp=2),
                  generator_replicas=1, max_slots=8, timeout_s=120) as loop:
        reports = list(loop.run(3))
        assert [r.step for r in reports] == [1, 2, 3] and loop.version == 3
        assert all(r.samples >= 2 * 2 and 0 <= r.reward_mean <= 1 and r.policy_lag <= 1 for r in reports)
        assert any(k.startswith("reward raised KeyError") for k in loop.dropped)
        # the generator serves the trainer's weights after the push
        weights = gather_state_dict(loop.trainer)
        for p in prompts(0):
            assert asyncio.run(greedy(loop.generator, p)) == local_greedy(weights, p)
        # weights that do not fit the generators are refused before any replica swaps, naming the mismatch
        bad = dict(weights)
        bad["lm_head.weight"] = torch.zeros(3, 3)
        with pytest.raises(ValueError, match="lm_head.weight"):
            loop.generator.update_weights(bad)
    with pytest.raises(RuntimeError, match="stopped"):
        loop.step()


@pytest.mark.timeout(120)
def test_published_weights_are_read_from_the_trainer_under_fsdp(spawn_procs: Any) -> None:
    from actormesh.parallel import PublishedWeights, publish_weights, spawn_trainer

    procs = spawn_procs(per_host={"gpus": 2})
    trainer = spawn_trainer(procs, MODEL, grpo_loss, partial(torch.optim.AdamW, lr=1e-2), Plan(fsdp=2), timeout=120)
    published = publish_weights(trainer, version=1)
    # each rank publishes its own shards (nothing gathered): two parts of about half the bytes each
    assert isinstance(published, PublishedWeights) and len(published.parts) == 2
    import pickle

    pieces = sum(len(layout) for _, layout in published.parts)
    assert len(pickle.dumps(published)) < 400 * pieces  # a handle and a layout entry per piece: the bytes stay in the trainer
    full = gather_state_dict(trainer)
    fetched = published.fetch()
    assert sorted(fetched) == sorted(full) == sorted(published.keys())
    assert all(torch.equal(fetched[k], full[k]) for k in full)
    total = sum(t.numel() * t.element_size() for t in full.values())
    assert total <= published.nbytes < total * 1.1 and all(source.size() < 0.6 * total for source, _ in published.parts)
    # published in place (FSDP2 local shards on CPU): an optimizer step is a change of the published weights
    samples = [Sample([26, 3], [4, 5], [-1.0, -2.0], 0, advantage=1.0), Sample([26, 7], [8, 9], [-0.5, -1.5], 0, advantage=-1.0)]
    trainer.step.call(pack_batch(samples)).get(timeout=60)
    stepped = gather_state_dict(trainer)
    assert not all(torch.equal(stepped[k], full[k]) for k in full)
    from actormesh.rdma import BufferDroppedError

    with pytest.raises(BufferDroppedError, match="changed the weights after publishing them"):
        published.read_into({k: torch.empty_like(v) for k, v in full.items()})  # version 1 exactly: gone
    # a replica built later (it holds version 1's handle) reads the trainer's weights as they are now, whole
    fetched = published.fetch()
    assert all(torch.equal(fetched[k], stepped[k]) for k in full)
    again = publish_weights(trainer, version=2)
    def registrations(weights: PublishedWeights) -> list[int]:
        return [b._handle.reg_id for source, _ in weights.parts for b in source.buffers if b is not None]

    assert again.stamps == (2, 2) and registrations(again) == registrations(published)  # registered once, reused


@pytest.mark.timeout(180)
def test_published_weights_cover_the_model_once_under_fsdp_and_tp(spawn_procs: Any) -> None:
    """A norm weight FSDP shards but TP does not lives on the dp_shard mesh, repeated along tp: published once."""
    from actormesh.parallel import publish_weights, spawn_trainer
    from actormesh.parallel._live import LiveSource

    model = partial(hf_causal_lm, transformers.LlamaConfig(**dict(CONFIG, vocab_size=28)), "LlamaForCausalLM")  # tp divides it
    trainer = spawn_trainer(spawn_procs(per_host={"gpus": 4}), model, grpo_loss, partial(torch.optim.AdamW, lr=1e-2),
                            Plan(fsdp=2, tp=2), timeout=150)
    published = publish_weights(trainer, version=1)
    assert len(published.parts) == 4 and all(isinstance(source, LiveSource) for source, _ in published.parts)
    full = gather_state_dict(trainer)
    fetched = published.fetch()
    assert sorted(fetched) == sorted(full) and all(torch.equal(fetched[k], full[k]) for k in full)


@pytest.mark.timeout(240)
def test_a_generator_rebuilt_after_the_trainer_moved_on_loads_the_trainers_weights() -> None:
    """The last push was published in place; the trainer has stepped since: a rebuilt replica's setup
    reads that handle's *latest* weights (whole, the trainer's current ones) instead of failing."""
    from conftest import wait_for

    config = GRPOConfig(group_size=4, prompts_per_step=2, max_tokens=1)
    with GRPOLoop(MODEL, letter_reward, prompts, config, partial(torch.optim.AdamW, lr=5e-2), trainer_plan=Plan(fsdp=2),
                  generator_replicas=1, max_slots=8, timeout_s=120) as loop:
        loop.step()  # pushes version 1
        pushed = gather_state_dict(loop.trainer)
        samples = [Sample([26, i], [i + 1], [-1.0], 0, advantage=1.0 if i % 2 else -1.0) for i in range(4)]
        loop.trainer.step.call(pack_batch(samples)).get(timeout=60)  # the trainer moves past version 1
        current = gather_state_dict(loop.trainer)
        assert not all(torch.equal(current[k], pushed[k]) for k in current)
        service = loop.generator.service
        before = service.replicas()[0]
        assert service.restart_replica(before.slot, before.generation, "test: rebuild")
        wait_for(lambda: loop.generator.healthy() and service.replicas()[0].generation > before.generation, timeout=120)
        probes = [[26, i] for i in range(26)]
        assert [asyncio.run(greedy(loop.generator, p)) for p in probes] == [local_greedy(current, p) for p in probes]


def trainer_pid(loop: GRPOLoop, rank: int) -> int:
    infos = loop.trainer.info.call().get(timeout=60).values()
    return next(i["pid"] for i in infos if i["rank"] == rank)


@pytest.mark.timeout(240)
def test_a_lost_trainer_rank_stops_the_loop_or_is_recovered(tmp_path: Any) -> None:
    import signal

    from actormesh.errors import SupervisionError
    from actormesh.parallel import Recovery

    config = GRPOConfig(group_size=4, prompts_per_step=2, max_tokens=1)
    common = dict(trainer_plan=Plan(dp=2), generator_replicas=1, max_slots=8, timeout_s=120)
    with GRPOLoop(MODEL, letter_reward, prompts, config, partial(torch.optim.AdamW, lr=1e-2), **common) as loop:
        loop.step()
        os.kill(trainer_pid(loop, 1), signal.SIGKILL)
        with pytest.raises(SupervisionError) as info:
            loop.step()  # not the surviving rank's gloo error: the death, naming the rank
        assert info.value.rank == 1, info.value
    recovery = Recovery(str(tmp_path / "ckpt"), checkpoint_every=1, max_restarts=1)
    with GRPOLoop(MODEL, letter_reward, prompts, config, partial(torch.optim.AdamW, lr=1e-2), trainer_recovery=recovery,
                  **common) as loop:
        loop.step()
        os.kill(trainer_pid(loop, 1), signal.SIGKILL)
        report = loop.step()  # returns normally, later: the trainer came back from its checkpoint
        assert report.step == 2 and report.figures.recovery, report.figures
        assert loop.step().step == 3 and loop.version == 3
