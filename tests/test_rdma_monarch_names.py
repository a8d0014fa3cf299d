"""Monarch 0.7.0's RDMA spellings: RDMAAction.read_remote/write_remote, get_rdma_backend's
categories, and a batch whose writes share one local source."""

from __future__ import annotations

import pytest

from actormesh.rdma import RDMAAction, RDMABuffer, get_rdma_backend, is_ibverbs_available, same_host_backend


def test_get_rdma_backend_answers_in_monarchs_categories():
    assert get_rdma_backend() in ("ibverbs", "tcp", "none")
    assert get_rdma_backend() == "tcp" and not is_ibverbs_available()
    assert same_host_backend() in ("vm", "shm", "tcp", "local")


def test_read_remote_and_write_remote_move_bytes():
    a, b = bytearray(b"a" * 16), bytearray(16)
    buf_a, buf_b = RDMABuffer(memoryview(a)), RDMABuffer(memoryview(b))
    local = bytearray(16)
    try:
        RDMAAction().read_remote(memoryview(local), buf_a).submit().get(timeout=20)
        assert bytes(local) == b"a" * 16
        RDMAAction().write_remote(buf_b, memoryview(bytearray(b"z" * 16))).submit().get(timeout=20)
        assert bytes(b) == b"z" * 16
    finally:
        for buf in (buf_a, buf_b):
            buf.drop().get(timeout=5)


def test_two_writes_may_share_a_local_source_but_a_read_may_not_overlap():
    x, y = bytearray(8), bytearray(8)
    bx, by = RDMABuffer(memoryview(x)), RDMABuffer(memoryview(y))
    src = memoryview(bytearray(b"s" * 8))
    try:
        RDMAAction().write_remote(bx, src).write_remote(by, src).submit().get(timeout=20)
        assert bytes(x) == bytes(y) == b"s" * 8
        with pytest.raises(ValueError, match="overlaps"):
            RDMAAction().write_remote(bx, src).read_remote(src, by)
    finally:
        for buf in (bx, by):
            buf.drop().get(timeout=5)
