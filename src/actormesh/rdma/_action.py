"""``RDMAAction``: a batch of transfers submitted together (Monarch's API).

Operations on buffers of the same owner run one after another in the order
they were added; different owners proceed concurrently. Overlapping local
ranges within one batch are allowed for reads only (a write overlapping
anything is a ValueError, as in Monarch, since the order would be a race).
"""

from __future__ import annotations

import threading
from typing import Any

from ..runtime import Future
from ._buffer import RDMABuffer, _check_timeout
from ._memory import region_of

__all__ = ["RDMAAction"]


class RDMAAction:
    """Collect ``read_into``/``write_from`` operations, then ``submit()`` them at once.

    Example::

        RDMAAction().read_remote(local_a, buf_a).write_remote(buf_b, local_b).submit().get()

    ``read_into(src, dst)`` / ``write_from(src, dst)`` are the earlier spellings of the same.
    """

    def __init__(self) -> None:
        self._ops: list[tuple[str, RDMABuffer, Any]] = []
        self._ranges: list[tuple[int, int, str]] = []

    def _claim(self, local: Any, op: str, role: str) -> int:
        region = region_of(local, role=role, allow_empty=(op == "read"))
        start, end = region.address, region.address + region.nbytes
        for s, e, other in self._ranges:
            # A read writes its local memory; a write only reads it: two writes may share a source.
            if start < e and s < end and (op == "read" or other == "read"):
                raise ValueError(f"the local memory of this {op} overlaps a {other} already in the batch")
        self._ranges.append((start, end, op))
        return region.nbytes

    def read_into(self, src: RDMABuffer, dst: Any) -> RDMAAction:
        """Add a read of all of ``src`` into ``dst`` (ValueError if ``dst`` is too small)."""
        if isinstance(dst, list):
            raise NotImplementedError("list destinations are not supported")
        if self._claim(dst, "read", "dst") < src.size():
            raise ValueError(f"dst is too small for the RDMA buffer of {src.size()} bytes")
        self._ops.append(("read", src, dst))
        return self

    def write_from(self, src: RDMABuffer, dst: Any) -> RDMAAction:
        """Add a write of local ``dst`` into the buffer ``src`` (Monarch's argument names)."""
        if isinstance(dst, list):
            raise NotImplementedError("list sources are not supported")
        if self._claim(dst, "write", "src") > src.size():
            raise ValueError(f"the local memory is larger than the RDMA buffer of {src.size()} bytes")
        self._ops.append(("write", src, dst))
        return self

    def read_remote(self, dst: Any, src: RDMABuffer) -> RDMAAction:
        """Monarch 0.7.0's name: queue a read of the RDMA buffer ``src`` into local memory ``dst``."""
        return self.read_into(src, dst)

    def write_remote(self, dst: RDMABuffer, src: Any) -> RDMAAction:
        """Monarch 0.7.0's name: queue a write of local memory ``src`` into the RDMA buffer ``dst``."""
        return self.write_from(dst, src)

    def fetch_add(self, src: RDMABuffer, dst: Any, add: int) -> RDMAAction:
        """Atomic fetch-and-add: not supported by any backend yet."""
        raise NotImplementedError("fetch_add is not supported yet")

    def compare_and_swap(self, src: RDMABuffer, dst: Any, compare: int, swap: int) -> RDMAAction:
        """Atomic compare-and-swap: not supported by any backend yet."""
        raise NotImplementedError("compare_and_swap is not supported yet")

    def submit(self, *, timeout: float = 60) -> Future[None]:
        """Start every operation; the future completes when all are done (first error wins).

        May be called again to run the same batch again.
        """
        timeout = _check_timeout(timeout)
        done: Future[None] = Future._create()
        by_owner: dict[str, list[tuple[str, RDMABuffer, Any]]] = {}
        for op in self._ops:
            by_owner.setdefault(op[1].owner, []).append(op)
        if not by_owner:
            done._set_result(None)
            return done
        left = [len(by_owner)]
        lock = threading.Lock()

        def finished(fut: Future[Any]) -> None:
            exc = fut.exception(0)
            if exc is not None:
                done._set_exception(exc)
                return
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                done._set_result(None)

        for ops in by_owner.values():
            _chain(ops, 0, timeout, finished)
        return done


def _chain(ops: list[tuple[str, RDMABuffer, Any]], i: int, timeout: float, finished: Any) -> None:
    """Run ``ops[i:]`` one after another through callbacks (no thread waits)."""
    kind, buf, local = ops[i]
    try:
        fut = buf.read_into(local, timeout=timeout) if kind == "read" else buf.write_from(local, timeout=timeout)
    except Exception as exc:
        finished(Future._failed(exc))
        return
    if i + 1 == len(ops):
        fut._add_done_callback(finished)
        return

    def next_one(f: Future[Any]) -> None:
        if f.exception(0) is not None:
            finished(f)
        else:
            _chain(ops, i + 1, timeout, finished)

    fut._add_done_callback(next_one)
