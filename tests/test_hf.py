"""actormesh.parallel.hf: Hugging Face causal LMs (built from tiny configs, nothing
downloaded) computing HF's own logits, and trained under several plans to the
same losses as a single process.

The distributed test shares one module-scoped mesh of 4 procs across its
plans (torch and transformers are imported once per proc).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import module_procs  # noqa: E402

from actormesh.parallel import Plan, default_tp_plan, gather_state_dict, spawn_trainer  # noqa: E402
from actormesh.parallel.hf import HFCausalLM, from_hf_state_dict, hf_causal_lm, to_hf_state_dict  # noqa: E402
from actormesh.parallel.models import lm_loss  # noqa: E402

# Grouped-query attention (4 query heads, 2 key/value heads), so TP=2 leaves one KV head per rank.
LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
MODEL = partial(hf_causal_lm, transformers.LlamaConfig(**LLAMA), "LlamaForCausalLM")
SGD = partial(torch.optim.SGD, lr=0.2)
BATCH, SEQ, STEPS, TOL = 8, 16, 3, 1e-5


def batches(n: int = STEPS) -> list[tuple[Any, Any]]:
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, LLAMA["vocab_size"], (BATCH, SEQ + 1), generator=gen) for _ in range(n)]
    return [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seqs]


def reference(data: list[Any], seed: int = 0, state: dict[str, Any] | None = None) -> tuple[list[float], Any]:
    """The same training in this process, no parallelism: losses and the trained model."""
    torch.manual_seed(seed)
    model = MODEL()
    if state is not None:
        model.load_state_dict(state)
    opt = SGD(model.parameters())
    losses = []
    for x, y in data:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


# ------------------------------------------------------------------ no procs


@pytest.mark.parametrize("name, extra", [
    ("Llama", {}),
    ("Qwen2", {}),
    ("Mistral", {"sliding_window": 8}),  # window < sequence: the sliding mask matters
])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_adapter_computes_the_hf_models_logits(name: str, extra: dict[str, Any], attn: str) -> None:
    config = getattr(transformers, f"{name}Config")(**LLAMA, **extra)
    torch.manual_seed(0)
    hf = getattr(transformers, f"{name}ForCausalLM")(config)
    hf.config._attn_implementation = attn
    torch.manual_seed(0)
    model = hf_causal_lm(config, f"{name}ForCausalLM", attn_implementation=attn)
    converted = from_hf_state_dict(hf.state_dict())
    # Same seed, same weights: the adapter initialises exactly as HF does.
    assert all(torch.equal(v, converted[k]) for k, v in model.state_dict().items())
    model.load_state_dict(converted)
    x = torch.randint(0, LLAMA["vocab_size"], (2, SEQ))
    torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=0)
    assert set(to_hf_state_dict(model.state_dict())) == set(hf.state_dict())


def test_adapter_layout_for_the_trainer() -> None:
    with torch.device("meta"):
        model = MODEL()
    assert [n for n, _ in model.named_children()] == ["embed_tokens", "blocks", "norm", "lm_head"]
    plan = default_tp_plan(model)
    assert {k: v for k, v in plan.items() if k.startswith("blocks.0.")} == {
        "blocks.0.self_attn.q_proj": "colwise", "blocks.0.self_attn.k_proj": "colwise",
        "blocks.0.self_attn.v_proj": "colwise", "blocks.0.self_attn.o_proj": "rowwise",
        "blocks.0.mlp.gate_proj": "colwise", "blocks.0.mlp.up_proj": "colwise", "blocks.0.mlp.down_proj": "rowwise"}
    assert plan["embed_tokens"] == "embedding" and plan["lm_head"] == "head"
    assert model.n_heads == 2  # key/value heads: the whole-heads constraint for TP
    # The rotary embedding is not a child (every stage needs it) and is rebuilt after to_empty.
    assert model.rotary_emb.inv_freq.is_meta
    model.to_empty(device="cpu")
    model.init_buffers()
    assert model.rotary_emb.inv_freq.device.type == "cpu"


def test_tied_embeddings_are_refused_and_tied_checkpoints_untied() -> None:
    config = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        hf_causal_lm(config)
    sd = from_hf_state_dict({"model.embed_tokens.weight": torch.ones(2, 2), "model.layers.3.mlp.up_proj.weight": torch.zeros(1)})
    assert set(sd) == {"embed_tokens.weight", "lm_head.weight", "blocks.3.mlp.up_proj.weight"}
    assert sd["lm_head.weight"].equal(sd["embed_tokens.weight"])


def test_hf_module_is_not_imported_by_the_package() -> None:
    import actormesh.parallel as parallel

    assert not hasattr(parallel, "HFCausalLM") and "hf" not in parallel.__all__
    assert isinstance(MODEL(), HFCausalLM)


# -------------------------------------------------------------- distributed


@pytest.fixture(scope="module")
def procs() -> Iterator[Any]:
    yield from module_procs({"gpus": 4})


def run_plan(procs: Any, plan: Plan, data: list[Any], state: dict[str, Any] | None = None) -> tuple[list[float], dict[str, Any]]:
    """Train under ``plan`` (from ``state``'s weights if given); the losses and the final full weights."""
    trainer = spawn_trainer(procs, MODEL, lm_loss, SGD, plan, timeout=120)
    try:
        if state is not None:
            trainer.load_state_dict.call(state).get(timeout=60)
        losses = []
        for batch in data:
            per_rank = trainer.step.call(batch).get(timeout=60).values()
            assert len(set(per_rank)) == 1, f"{plan}: ranks disagree on the loss: {per_rank}"
            losses.append(per_rank[0])
        return losses, gather_state_dict(trainer)
    finally:
        trainer.stop().get(timeout=60)


PLANS = [
    Plan(dp=4),
    Plan(fsdp=4),
    Plan(dp=2, tp=2),
    Plan(fsdp=2, tp=2),
    Plan(pp=2, dp=2),
    Plan(pp=2, fsdp=2),
    Plan(pp=2, tp=2, pp_schedule="GPipe", microbatches=4),
    Plan(pp=2, dp=2, pp_schedule="Interleaved1F1B"),
    Plan(fsdp=2, tp=2, activation_checkpointing=True),
]


@pytest.mark.timeout(240)
def test_plans_match_the_single_process_reference(procs: Any) -> None:
    data = batches()
    ref, _ = reference(data)
    report, worst = [], 0.0
    for plan in PLANS:
        losses, _ = run_plan(procs, plan, data)
        diff = max(abs(a - b) for a, b in zip(losses, ref))
        worst = max(worst, diff)
        report.append(f"{plan!s:>60}: max |loss - reference| = {diff:.2e}")
    print("\n".join(report))
    assert worst < TOL, "\n".join(report)
    assert ref[0] != ref[-1]  # the model did train


@pytest.mark.timeout(120)
def test_hf_weights_in_trained_weights_out(procs: Any) -> None:
    """Start from a HF model's weights (as from a pretrained checkpoint), train, and load the result back into HF."""
    torch.manual_seed(7)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    start = from_hf_state_dict(hf.state_dict())
    data = batches()
    ref, trained = reference(data, state=start)
    losses, weights = run_plan(procs, Plan(fsdp=2, tp=2), data, state=start)
    assert max(abs(a - b) for a, b in zip(losses, ref)) < TOL, (losses, ref)
    hf.load_state_dict(to_hf_state_dict(weights), strict=True)
    x = data[0][0]
    torch.testing.assert_close(hf(x).logits, trained(x), atol=1e-5, rtol=0)
