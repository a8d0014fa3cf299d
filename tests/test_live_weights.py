"""Weights published in place (the live path): a seqlock over the parameters' own memory.

Every race is driven by hand: the change counter is moved at chosen points
of a read (inside the read's own calls), so each outcome is certain. The
trainer end to end (FSDP shards, an optimizer step after publishing) is in
test_rl.py.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch

import actormesh.rdma
from actormesh.parallel import PublishedWeights
from actormesh.parallel import _publish
from actormesh.parallel._live import ChangeCounter
from actormesh.parallel._publisher import Publisher, changing
from actormesh.rdma import BufferDroppedError, RDMATimeoutError


class Rank:
    """One trainer rank in this process: a model (its layers named ``<prefix>0``, ``<prefix>1``), its publisher."""

    def __init__(self, prefix: str = "") -> None:
        layers = (torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))  # a 1 MiB weight, then small ones
        self.model = torch.nn.Sequential(OrderedDict((f"{prefix}{i}", layer) for i, layer in enumerate(layers)))
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()
        self.publisher = Publisher(ChangeCounter())

    def publish(self) -> Any:
        return self.publisher.publish_chunks([self.model])

    def step(self, value: float) -> None:
        """An optimizer step: every parameter set to ``value``, in place, inside a change."""
        with changing(self.publisher), torch.no_grad():
            for p in self.model.parameters():
                p.fill_(value)

    def begin(self) -> AbstractContextManager[None]:
        """A change left open: the caller ends it with ``.__exit__(None, None, None)``."""
        change = changing(self.publisher)
        change.__enter__()
        return change


def published(version: int, *ranks: Rank) -> PublishedWeights:
    return PublishedWeights.from_replies(version, [r.publish() for r in ranks])


def values(state: dict[str, torch.Tensor]) -> set[float]:
    """The distinct values in a state dict (one value: one version)."""
    return {float(x) for t in state.values() for x in t.unique()}


class DuringRead:
    """``actions`` run in the middle of the next reads of the pieces (one per read: after the first piece
    moved, before the others); ``reads`` counts the reads made."""

    def __init__(self) -> None:
        self.actions: list[Any] = []
        self.reads = 0


@pytest.fixture
def during_read(monkeypatch: pytest.MonkeyPatch) -> DuringRead:
    hooks = DuringRead()
    real = actormesh.rdma.read_scattered

    def read(reads: Any, *, timeout: float = 60) -> Any:
        hooks.reads += 1
        if not hooks.actions:
            return real(reads, timeout=timeout)
        real(reads[:1], timeout=timeout).get(timeout=timeout)
        hooks.actions.pop(0)()
        return real(reads[1:], timeout=timeout)

    monkeypatch.setattr(actormesh.rdma, "read_scattered", read)
    return hooks


def test_the_parameters_are_published_in_place_and_registered_once() -> None:
    rank = Rank()
    first = published(1, rank)
    assert rank.publisher.path == "live"
    assert first.stamps == (0,)  # even: the weights were still
    weight = rank.model[0].weight
    source = first.parts[0][0]
    assert source.buffers[0]._handle.address == weight.data_ptr()  # the parameter's own memory: nothing copied
    rank.step(3.0)
    second = published(2, rank)
    assert second.stamps == (2,) and second.parts[0][0].buffers == source.buffers  # the same registrations, reused
    assert values(second.fetch()) == {3.0}


def test_an_exact_read_fails_once_the_weights_changed_and_a_late_reader_gets_the_current_ones() -> None:
    rank = Rank()
    old = published(1, rank)
    rank.step(1.0)
    dests = {k: torch.zeros_like(v) for k, v in rank.model.state_dict().items()}
    with pytest.raises(BufferDroppedError, match="changed the weights after publishing them.*fetch"):
        old.read_into(dests)
    assert values(dests) == {0.0}  # refused before a byte was read
    rank.step(2.0)
    # a replica rebuilt later holds only the old handle: it reads the trainer's weights as they are now
    assert values(old.fetch()) == {2.0}
    old.read_into(dests, latest=True)
    assert values(dests) == {2.0}


def test_a_read_a_change_overlapped_is_read_again_never_returned_mixed(during_read: DuringRead) -> None:
    rank = Rank()
    handle = published(1, rank)
    rank.step(1.0)
    during_read.actions.append(lambda: rank.step(2.0))  # the first piece read holds 1.0, the others will hold 2.0
    state = handle.fetch()
    assert values(state) == {2.0} and during_read.reads == 2  # the torn read was thrown away and done again
    exact = published(2, rank)
    during_read.actions.append(lambda: rank.step(3.0))
    with pytest.raises(BufferDroppedError, match="version 2.*changed the weights"):
        exact.read_into({k: torch.empty_like(v) for k, v in state.items()})


def test_a_latest_read_waits_out_a_change_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    rank = Rank()
    handle = published(1, rank)
    change = rank.begin()
    with torch.no_grad():
        rank.model[0].weight.fill_(5.0)  # half done: the other tensors still hold the old values
    waits: list[float] = []

    def pause(seconds: float) -> None:  # the reader's pause: the change ends while it waits
        waits.append(seconds)
        with torch.no_grad():
            for p in rank.model.parameters():
                p.fill_(5.0)
        change.__exit__(None, None, None)

    monkeypatch.setattr(_publish.time, "sleep", pause)
    assert values(handle.fetch()) == {5.0} and len(waits) == 1


def test_a_change_that_never_ends_is_a_timeout_naming_the_counters() -> None:
    rank = Rank()
    handle = published(1, rank)
    change = rank.begin()
    try:
        with pytest.raises(RDMATimeoutError, match=r"changing for all of 0.05s.*at change 1"):
            handle.fetch(timeout_s=0.05)
    finally:
        change.__exit__(None, None, None)


def test_ranks_at_different_changes_are_never_read_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 finished step k+1 while rank 0 has not begun it: both still, but two versions."""
    ranks = [Rank("a"), Rank("b")]
    handle = published(1, *ranks)
    ranks[1].step(7.0)

    def pause(seconds: float) -> None:  # rank 0 catches up while the reader waits
        ranks[0].step(7.0)

    monkeypatch.setattr(_publish.time, "sleep", pause)
    state = handle.fetch()
    assert sorted(state) == [f"{p}{i}.{k}" for p in "ab" for i in range(2) for k in ("bias", "weight")]
    assert values(state) == {7.0}


def test_a_change_that_moves_the_parameters_drops_the_registrations() -> None:
    rank = Rank()
    old = published(1, rank)
    with changing(rank.publisher), torch.no_grad():  # a load that assigns new tensors (load_state_dict(assign=True))
        rank.model[0].weight = torch.nn.Parameter(torch.full((512, 512), 4.0))
    with pytest.raises(BufferDroppedError):
        old.fetch()  # never the memory the weight left
    new = published(2, rank)
    assert new.parts[0][0].buffers[0]._handle.address == rank.model[0].weight.data_ptr()
    assert torch.equal(new.fetch()["0.weight"], rank.model[0].weight.detach())


def test_what_cannot_be_read_in_place_is_copied_and_outlives_a_change() -> None:
    """A piece whose memory is not the model's (a state-dict conversion's copy) sends the rank down the copy path."""
    rank = Rank()
    model = rank.model
    model.register_buffer("scale", torch.ones(4))
    model._register_state_dict_hook(lambda module, state, prefix, local: state.update(scale=state["scale"] * 2))
    handle = published(1, rank)
    assert rank.publisher.path == "copy"
    rank.step(9.0)
    state = handle.fetch()  # a copied version stays readable after the weights change (until published over twice)
    assert torch.equal(state["scale"], torch.full((4,), 2.0)) and float(state["0.weight"][0, 0]) != 9.0
    handle.read_into({k: torch.empty_like(v) for k, v in state.items()})


def test_a_buffer_a_forward_pass_updates_widens_the_change_to_the_whole_step() -> None:
    """As the trainer's step does it: a bracket from the forward pass, the optimizer step's nested in it. A rank
    that publishes buffers and one that does not (FSDP: plain buffers from rank 0 only) both move by one change."""
    with_buffers, plain = Rank(), Rank()
    with_buffers.model.append(torch.nn.BatchNorm1d(8))  # its running statistics change in a training forward pass
    published(1, with_buffers)
    published(1, plain)
    assert with_buffers.publisher.buffers_live and not plain.publisher.buffers_live
    for rank, odd_in_forward in ((with_buffers, True), (plain, False)):
        counter = rank.publisher.counter
        assert counter is not None
        with changing(rank.publisher, forward=True):
            assert counter.value % 2 == odd_in_forward  # forward: changing only where buffers are published
            with changing(rank.publisher):  # the optimizer step
                assert counter.value == 1
        assert counter.value == 2


def test_a_closed_publisher_drops_its_registrations_and_its_readers_fail_clearly() -> None:
    """A trainer that stops drops its registrations (they hold the parameters' memory)."""
    rank = Rank()
    handle = published(1, rank)
    rank.publisher.close()
    rank.publisher.close()  # idempotent
    with pytest.raises(BufferDroppedError, match="dropped"):
        handle.fetch()
