"""Monarch's RDMA warnings: where actormesh issues them (see docs/rdma.md)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import actormesh.rdma._backends as backends
from actormesh.actor import Actor, endpoint
from actormesh.rdma import RDMABuffer, RDMAReadTransferWarning, RDMATcpFallbackWarning, RDMAWriteTransferWarning


class Owner(Actor):
    def __init__(self) -> None:
        self.mem = torch.arange(4096, dtype=torch.uint8)
        self.buf = RDMABuffer(self.mem)

    @endpoint
    def handle(self) -> RDMABuffer:
        return self.buf


@pytest.fixture()
def buf(spawn_procs: Any) -> RDMABuffer:
    return spawn_procs(per_host={"g": 1}).spawn("owner", Owner).handle.call_one().get(timeout=60)


def _unusable(*args: Any, **kwargs: Any) -> None:
    raise backends.Unusable("refused in this test")


def test_a_same_host_transfer_that_falls_back_to_tcp_warns(buf: RDMABuffer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACTORMESH_RDMA_BACKEND", "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same-host fast path: no warning at all
        dst = torch.empty(4096, dtype=torch.uint8)
        buf.read_into(dst).get(timeout=30)
        assert buf.backend != "tcp"
    for name in ("vm", "shm"):
        monkeypatch.setattr(backends.BACKENDS[name], "read", _unusable)
    with pytest.warns(RDMATcpFallbackWarning, match="no same-host path could reach it"):
        buf.read_into(dst).get(timeout=30)
    assert buf.backend == "tcp" and torch.equal(dst, torch.arange(4096, dtype=torch.uint8))


def test_tcp_chosen_on_purpose_does_not_warn(buf: RDMABuffer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACTORMESH_RDMA_BACKEND", "tcp")
    dst = torch.empty(4096, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buf.read_into(dst).get(timeout=30)
        buf.write_from(dst).get(timeout=30)
    assert buf.backend == "tcp"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: GPU memory is what gets staged")
def test_gpu_memory_on_the_calling_side_warns_that_it_is_staged(buf: RDMABuffer) -> None:
    dst = torch.empty(4096, dtype=torch.uint8, device="cuda")
    with pytest.warns(RDMAReadTransferWarning, match="staged through host memory"):
        buf.read_into(dst).get(timeout=60)
    assert torch.equal(dst.cpu(), torch.arange(4096, dtype=torch.uint8))
    with pytest.warns(RDMAWriteTransferWarning, match="staged through host memory"):
        buf.write_from(dst).get(timeout=60)
