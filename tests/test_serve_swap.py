"""A service-wide weight swap (``LLMService.update_weights``) on real procs.

Two one-proc replicas of a tiny Llama behind one ``LLMService``. Bad weights
swap nowhere; a swap under steady load loses no request and afterwards every
replica's greedy output is Hugging Face ``generate`` with the new weights; a
replica killed after the swap comes back with the new weights. The tests share
one service and run in file order (each starts from the previous one's weights).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import wait_for  # noqa: E402

from actormesh.parallel.hf import hf_causal_lm  # noqa: E402
from actormesh.serve import LLMServerClient, LLMService, ReplicaFailed, SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(240)
CONFIG = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  tie_word_embeddings=False)
MODEL = partial(hf_causal_lm, CONFIG, "LlamaForCausalLM")
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [100, 50, 20, 10, 11, 12, 13], [42, 43]]
T = 120  # bound of every wait


def hf_model(seed: int, config: Any = CONFIG) -> Any:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, T))


async def collect(gen: Any, prompt: list[int], n: int) -> list[int]:
    return [t async for t in gen.generate(prompt, SamplingParams(max_tokens=n))]


async def drain(stream: Any) -> list[int]:
    return [t async for t in stream]


def each_replica_greedy(llm: LLMService, prompt: list[int], n: int) -> dict[int, list[int]]:
    """Greedy output of every healthy replica, asked directly (not through the router)."""
    out = {}
    for info in llm.service.replicas():
        client = LLMServerClient(info.mesh, token_timeout_s=T)
        try:
            out[info.slot] = run(collect(client, prompt, n))
        finally:
            client.close()
    return out


@pytest.fixture(scope="module")
def llm() -> Iterator[LLMService]:
    service = LLMService(MODEL, replicas=2, weights=hf_model(0).state_dict(), max_slots=4, token_timeout_s=T,
                         build_timeout_s=T)
    try:
        service.ready(timeout_s=T)
        wait_for(lambda: len(service._set_up) == 2, timeout=T)
        yield service
    finally:
        service.stop()


def test_replicas_on_one_host_share_its_cores(llm: LLMService) -> None:
    """Two replicas on this host: each proc's torch kernels take half the cores, not all of
    them (threads spinning for cores the other replica holds cost 10-20x under load)."""
    infos = [i for r in llm.service.replicas() for i in r.mesh.info.call().get(timeout=T).values()]
    want = int(os.environ["OMP_NUM_THREADS"]) if "OMP_NUM_THREADS" in os.environ else max(1, (os.cpu_count() or 1) // 2)
    assert [i["torch_threads"] for i in infos] == [want, want]


def test_bad_weights_swap_nowhere(llm: LLMService) -> None:
    bad = hf_model(1).state_dict()
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="refused by replica 0 .*no replica was swapped") as info:
        llm.update_weights(bad)
    assert "up_proj" in str(info.value)  # the cause names the tensor that does not fit
    with pytest.raises(TypeError, match="state dict or a path"):
        llm.update_weights(None)
    want = hf_greedy(hf_model(0), PROMPTS[0], 6)
    assert each_replica_greedy(llm, PROMPTS[0], 6) == {0: want, 1: want}


def test_swap_under_load_loses_no_request(llm: LLMService, tmp_path: Any) -> None:
    path = tmp_path / "new.pt"
    torch.save(hf_model(1).state_dict(), path)  # a path each replica reads (HF names, converted on load)
    n = 40

    async def load_then_swap() -> tuple[list[list[int]], dict[int, str]]:
        streams = [llm.generate(p, SamplingParams(max_tokens=n)) for p in PROMPTS * 2]
        firsts = [[await s.__anext__()] for s in streams]  # all 8 running, on both replicas
        swap = asyncio.create_task(asyncio.to_thread(llm.update_weights, str(path)))
        rests = await asyncio.gather(*(drain(s) for s in streams))
        return [f + r for f, r in zip(firsts, rests, strict=True)], await swap

    outputs, outcomes = run(load_then_swap())
    assert outcomes == {0: "swapped", 1: "swapped"}
    assert [len(o) for o in outputs] == [n] * len(outputs)  # every request in flight finished
    new = hf_model(1)
    for prompt in PROMPTS[:2]:
        want = hf_greedy(new, prompt, 8)
        assert each_replica_greedy(llm, prompt, 8) == {0: want, 1: want}
        assert run(collect(llm, prompt, 8)) == want  # and through the service's router


def test_a_replica_rebuilt_after_the_swap_has_the_new_weights() -> None:
    config = transformers.LlamaConfig(**{**CONFIG.to_dict(), "max_position_embeddings": 2048})
    model_fn = partial(hf_causal_lm, config, "LlamaForCausalLM")
    old, new, newer = (hf_model(seed, config) for seed in (0, 2, 3))
    # its own one-replica service: the rebuilt procs belong to this test, which stops them
    with LLMService(model_fn, replicas=1, weights=old.state_dict(), max_slots=2, token_timeout_s=T) as llm:
        llm.ready(timeout_s=T)
        wait_for(llm.healthy, timeout=T)
        assert llm.update_weights(new.state_dict(), drain=True) == {0: "swapped"}
        kill_replica_and_wait(llm)
        want = hf_greedy(new, PROMPTS[2], 8)
        assert each_replica_greedy(llm, PROMPTS[2], 8) == {0: want}
        assert run(collect(llm, PROMPTS[2], 8)) == want

        async def swap_that_times_out() -> dict[int, str]:
            # a drain that cannot finish in time (a 2000-token request runs): the replica is restarted
            stream = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2000))
            await stream.__anext__()
            outcomes = await asyncio.to_thread(llm.update_weights, newer.state_dict(), True, 0.2)
            try:  # it finishes if it outran the restart, else its caller is told (may or may not have run)
                assert len(await drain(stream)) == 2000 - 1
            except ReplicaFailed:
                pass
            return outcomes

        generation = llm.service.replicas()[0].generation
        outcomes = run(swap_that_times_out())
        assert outcomes[0].startswith("restarted") and "TimeoutError" in outcomes[0], outcomes
        wait_for(lambda: set_up_after(llm, generation), timeout=T)
        assert each_replica_greedy(llm, PROMPTS[2], 8) == {0: hf_greedy(newer, PROMPTS[2], 8)}


def set_up_after(llm: LLMService, generation: int) -> bool:
    """Whether replica 0 has an incarnation newer than ``generation`` that is set up."""
    return any(i.generation > generation and (0, i.generation) in llm._set_up for i in llm.service.replicas())


def kill_replica_and_wait(llm: LLMService) -> None:
    (info,) = llm.service.replicas()
    os.kill(info.mesh.info.call().get(timeout=T).values()[0]["pid"], signal.SIGKILL)
    wait_for(lambda: set_up_after(llm, info.generation), timeout=T)
