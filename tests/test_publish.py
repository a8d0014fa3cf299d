"""Published weights: scatter reads, versions that never tear, and the double-buffered swap.

The trainer-side end to end (FSDP shards from two ranks) is in test_rl.py;
here the parts are checked one by one, in this process or against one proc.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from actormesh.actor import Actor, endpoint
from actormesh.parallel import PublishedWeights, WeightStaging
from actormesh.parallel._publisher import Publisher
from actormesh.rdma import BufferDroppedError, RDMABuffer, read_scattered


class Holder(Actor):
    """Owns one registered tensor of known bytes."""

    @endpoint
    def make(self, nbytes: int) -> RDMABuffer:
        self.mem = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
        return RDMABuffer(self.mem)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["vm", "shm", "tcp"])
def test_read_ranges_scatters_one_buffer_into_many_tensors(spawn_procs: Any, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    holder = spawn_procs(per_host={"gpus": 1}).spawn("holder", Holder)
    nbytes = (3 << 20) + 5
    buf = holder.make.call_one(nbytes).get(timeout=30)
    expected = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    monkeypatch.setenv("ACTORMESH_RDMA_BACKEND", backend)
    monkeypatch.setenv("ACTORMESH_RDMA_CHUNK_BYTES", str(64 * 1024 + 3))
    ranges = [(0, torch.empty(7, dtype=torch.uint8)), (nbytes - 3, torch.empty(3, dtype=torch.uint8)),
              (4096 + 1, torch.empty(2 << 20, dtype=torch.uint8)), (9, torch.empty(0, dtype=torch.uint8))]
    buf.read_ranges(ranges, timeout=30).get(timeout=40)
    assert buf.backend == backend
    for offset, dst in ranges:
        assert torch.equal(dst, expected[offset:offset + dst.numel()])
    with pytest.raises(ValueError, match="outside"):
        buf.read_ranges([(nbytes - 2, torch.empty(3, dtype=torch.uint8))])
    with pytest.raises(ValueError, match="read-only"):
        buf.read_ranges([(0, memoryview(bytes(4)))])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["vm", "shm", "tcp"])
def test_read_scattered_reads_many_buffers_as_one_transfer(spawn_procs: Any, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    holder = spawn_procs(per_host={"gpus": 1}).spawn("holder", Holder)
    sizes = [(2 << 20) + 1, 5, 3 << 10]
    bufs = [holder.make.call_one(n).get(timeout=30) for n in sizes]
    monkeypatch.setenv("ACTORMESH_RDMA_BACKEND", backend)
    reads = [(bufs[0], 1, torch.empty(2 << 20, dtype=torch.uint8)), (bufs[1], 0, torch.empty(5, dtype=torch.uint8)),
             (bufs[2], 100, torch.empty(7, dtype=torch.uint8)), (bufs[0], 0, torch.empty(2, dtype=torch.uint8))]
    read_scattered(reads, timeout=30).get(timeout=40)
    for buf, offset, dst in reads:
        expected = torch.arange(buf.size(), dtype=torch.int64).remainder(251).to(torch.uint8)
        assert torch.equal(dst, expected[offset:offset + dst.numel()]) and buf.backend == backend
    with pytest.raises(ValueError, match="outside"):
        read_scattered([(bufs[1], 1, torch.empty(5, dtype=torch.uint8))])
    bufs[2].drop().get(timeout=10)
    with pytest.raises(BufferDroppedError):  # one dropped buffer fails the whole read, naming it
        read_scattered([(bufs[1], 0, torch.empty(5, dtype=torch.uint8)), (bufs[2], 0, torch.empty(5, dtype=torch.uint8))]).get(timeout=10)


def publish(publisher: Publisher, version: int, state: dict[str, Any]) -> PublishedWeights:
    return PublishedWeights.from_replies(version, [publisher.publish(state)])


def test_a_publication_is_read_into_place_until_it_is_published_over() -> None:
    publisher = Publisher()
    state = {"w": torch.randn(6, 4), "b": torch.randn(4), "n": torch.tensor(3.0)}
    first = publish(publisher, 1, state)
    dests = {k: torch.zeros_like(v) for k, v in state.items()}
    first.read_into(dests)
    assert all(torch.equal(dests[k], state[k]) for k in state)
    assert sorted(first.fetch()) == sorted(state) == first.keys()
    second = publish(publisher, 2, {k: v + 1 for k, v in state.items()})
    first.read_into(dests)  # the previous version stays readable while the next one is announced
    assert torch.equal(dests["w"], state["w"])
    third = publish(publisher, 3, {k: v + 2 for k, v in state.items()})
    # published over the first one's memory (two buffers in turn, nothing allocated after them)
    assert third.parts[0][0]._handle.address == first.parts[0][0]._handle.address
    with pytest.raises(BufferDroppedError, match="published newer weights"):
        first.read_into(dests)
    second.read_into(dests)
    assert torch.equal(dests["w"], state["w"] + 1)


def test_wrong_names_or_shapes_are_refused_before_a_byte_is_read() -> None:
    published = publish(Publisher(), 1, {"w": torch.randn(6, 4)})
    dst = torch.zeros(6, 4)
    with pytest.raises(ValueError, match="'v' was not published"):
        published.read_into({"w": dst, "v": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"shape \(6, 4\)"):
        published.read_into({"w": torch.zeros(4, 6)})
    assert dst.eq(0).all()


def test_column_pieces_and_other_dtypes_are_assembled_through_a_temporary() -> None:
    full = torch.arange(24, dtype=torch.float32).view(4, 6)
    flat = torch.zeros(256, dtype=torch.uint8)
    left, right = full[:, :3].contiguous(), full[:, 3:].contiguous()
    flat[64:112].view(torch.float32).copy_(left.view(-1))
    flat[128:176].view(torch.float32).copy_(right.view(-1))
    layout = [("w", "float32", (4, 6), (4, 3), (0, 0), 64, 48), ("w", "float32", (4, 6), (4, 3), (0, 3), 128, 48)]
    published = PublishedWeights(1, ((RDMABuffer(flat), layout),))
    out = {"w": torch.zeros(4, 6, dtype=torch.float64)}
    published.read_into(out)
    assert torch.equal(out["w"], full.double())
    with pytest.raises(ValueError, match="hold 12 of its 24 elements"):
        PublishedWeights(1, ((RDMABuffer(flat), layout[:1]),)).read_into({"w": torch.zeros(4, 6)})


def test_staged_weights_are_swapped_in_and_the_old_memory_is_reused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    staging = WeightStaging([model])
    publisher = Publisher()
    new = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    live = {k: v.data_ptr() for k, v in model.state_dict().items()}
    staged = staging.stage(publish(publisher, 1, new))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing changes before install
    staging.install(staged)
    assert all(torch.equal(v, new[k]) for k, v in model.state_dict().items())
    newer = {k: v * 2 for k, v in new.items()}
    staged = staging.stage(publish(publisher, 2, newer))
    # the second update is read into the memory the first one replaced: no allocation, no page faults
    assert {k: t.data_ptr() for k, t in staged.tensors.items()} == live
    staging.install(staged)
    assert all(torch.equal(v, newer[k]) for k, v in model.state_dict().items())
    bad = dict(newer, **{"0.weight": torch.randn(3, 5)})
    with pytest.raises(ValueError, match=r"weights\['0.weight'\] has shape \(3, 5\)"):
        staging.stage(publish(publisher, 3, bad))
    assert all(torch.equal(v, newer[k]) for k, v in model.state_dict().items())


def test_a_read_racing_publications_is_whole_or_refused_never_mixed() -> None:
    """Publications of all-k tensors race a reader: every read it accepts holds one k only."""
    import threading

    publisher = Publisher()
    state = {"w": torch.zeros(1 << 20)}  # 4 MiB: a copy takes long enough to overlap
    handles = [publish(publisher, 0, state)]
    stop = threading.Event()
    outcomes = {"whole": 0, "refused": 0, "mixed": 0}

    def read() -> None:
        dst = {"w": torch.empty(1 << 20)}
        while not stop.is_set():
            older = handles[-2] if len(handles) > 1 else handles[-1]  # its memory is the next one written
            try:
                older.read_into(dst)
            except BufferDroppedError:
                outcomes["refused"] += 1
                continue
            outcomes["whole" if dst["w"].min() == dst["w"].max() else "mixed"] += 1

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for k in range(1, 200):
            state["w"].fill_(float(k))
            handles.append(publish(publisher, k, state))
    finally:
        stop.set()
        reader.join(30)
    assert not reader.is_alive() and outcomes["mixed"] == 0, outcomes
    # how many racing reads were whole or refused depends on the scheduling; a read nothing races is whole
    dst = {"w": torch.empty(1 << 20)}
    handles[-1].read_into(dst)
    assert bool((dst["w"] == 199.0).all())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan", ["tp2", "pp2"])
def test_a_tensor_or_pipeline_parallel_replica_takes_weights_published_under_fsdp(spawn_procs: Any, plan: str) -> None:
    """FSDP shards from two trainer ranks into a replica whose ranks hold TP shards (copied in) or
    pipeline stages (only their own weights read); twice, so the second update reuses the spare set."""
    import asyncio
    from functools import partial

    import transformers

    from actormesh.parallel import Plan, publish_weights, spawn_trainer
    from actormesh.parallel.hf import from_hf_state_dict, hf_causal_lm
    from actormesh.parallel.models import lm_loss
    from actormesh.serve import LLMServerClient, SamplingParams, spawn_llm_server

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    model = partial(hf_causal_lm, config, "LlamaForCausalLM")
    trainer = spawn_trainer(spawn_procs(per_host={"gpus": 2}), model, lm_loss, partial(torch.optim.AdamW, lr=1e-3),
                            Plan(fsdp=2), timeout=120)
    server = spawn_llm_server(spawn_procs(per_host={"gpus": 2}), model, Plan(tp=2) if plan == "tp2" else Plan(pp=2), timeout=120)
    prompt = [5, 6, 7, 8, 9]
    try:
        with LLMServerClient(server) as client:
            for seed in (1, 2):
                torch.manual_seed(seed)
                hf = transformers.LlamaForCausalLM(config).eval()
                trainer.load_state_dict.call(from_hf_state_dict(hf.state_dict())).get(timeout=60)
                client.update_weights(publish_weights(trainer, version=seed), timeout_s=60)
                ids = torch.tensor([prompt])
                want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                   eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()

                async def greedy() -> list[int]:
                    return [t async for t in client.generate(prompt, SamplingParams(max_tokens=8))]

                assert asyncio.run(asyncio.wait_for(greedy(), 60)) == want
    finally:
        server.stop().get(timeout=60)
