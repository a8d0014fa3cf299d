"""Weights published in place: a trainer rank's own parameter memory, registered once, guarded by a seqlock.

Why: copying every shard into a publication buffer (:mod:`._publish`'s copy
path) moves every byte once more than a sync needs; readers can take the
bytes straight from the parameters, between two changes of them.

Theory of operation (a seqlock). A rank keeps one *change counter*, an
int64 in a small registered buffer, even while its weights are still and odd
while they change. The trainer wraps every change of the weights in
:meth:`ChangeCounter.changing` (the optimizer step; a whole training step
when the model has buffers in its state dict, which a forward pass may
update; a checkpoint or state-dict load). A live publication names the
parameters' registered memory and the counter's value when it was made
(always even). A reader reads every rank's counter, the bytes, then the
counters again: the read is whole if no counter moved and all were even and
equal across ranks (ranks count the same changes: a rank that stepped ahead
of another is caught, so rank 0 at step k never pairs with rank 1 at k+1).
Asked for the exact version published, a reader fails once a counter
differs from the published one; asked for the latest (a replica rebuilt
later), it waits (bounded) while a change is in progress and retries a
read that a change overlapped.

The registrations are made once and reused while the parameters keep their
memory (an optimizer step writes in place). If a change moves them (a load
that assigns new tensors), the old registrations are dropped before the
change ends, so a stale handle fails with ``BufferDroppedError`` and never
reads memory the parameters left.

Memory the kernel backs with 4 KiB pages is read by ``process_vm_readv`` at
about half the speed of huge pages (it pins every page); the parameters were
faulted in long before they were registered, so registration asks the
kernel to collapse them into huge pages now (``MADV_COLLAPSE``, one copy,
once per registration; best effort, nothing happens where it is refused).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["ChangeCounter", "LiveSource", "register_live", "collapse_huge_pages"]

_HUGE = 2 << 20  # the transparent huge page size on x86-64 and arm64 (4 KiB base pages)
_MADV_COLLAPSE = 25  # Linux 6.1+; older kernels answer EINVAL and nothing happens


@dataclass(frozen=True)
class LiveSource:
    """A rank's live part: its change counter and one registered buffer per piece (``None`` for an empty one),
    in the order of the part's layout; each piece starts at offset 0 of its buffer."""

    counter: Any  #: RDMABuffer over the rank's change counter (int64 at offset 0)
    buffers: tuple[Any, ...]

    @property
    def owner(self) -> str:
        return str(self.counter.owner)

    def size(self) -> int:
        return sum(b.size() for b in self.buffers if b is not None)


class ChangeCounter:
    """One rank's seqlock word over its weights (see the module's docstring).

    ``changing()`` nests: only the outermost level moves the counter.
    ``on_end`` hooks run inside the change, just before the counter is even
    again (where a publisher drops registrations the change made stale).
    Not thread-safe: one thread (the trainer's) changes the weights.
    """

    def __init__(self) -> None:
        import torch

        from ..rdma import RDMABuffer

        self._word = torch.zeros(8, dtype=torch.int64)  # one cache line; the counter is word 0
        self.buffer = RDMABuffer(self._word.view(torch.uint8))
        self._depth = 0
        self._fence = threading.Lock()  # acquiring a lock is a full memory barrier between the word and the bytes
        self.on_end: list[Any] = []

    @property
    def value(self) -> int:
        return int(self._word[0])

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Mark the weights as changing for the block: readers of the current version fail or wait."""
        self._depth += 1
        if self._depth == 1:
            self._bump()  # odd: a reader that started before sees the counter move
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                try:
                    for hook in list(self.on_end):
                        hook()
                finally:
                    self._bump()  # even again: the new version is readable

    def _bump(self) -> None:
        with self._fence:  # the bytes written before (or after) stay on their side of the store
            self._word[0] += 1


def register_live(tensors: list[Any]) -> tuple[Any, ...]:
    """One RDMABuffer per tensor (``None`` for an empty one), its memory collapsed into huge pages first."""
    import torch

    from ..rdma import RDMABuffer

    out: list[Any] = []
    for t in tensors:
        if t.numel() == 0:
            out.append(None)
            continue
        flat = t.detach().view(-1).view(torch.uint8)
        collapse_huge_pages(int(flat.data_ptr()), flat.numel())
        out.append(RDMABuffer(flat))
    return tuple(out)


def collapse_huge_pages(address: int, nbytes: int) -> bool:
    """Ask the kernel to back ``[address, address + nbytes)`` with huge pages now (``MADV_COLLAPSE``).

    The range is widened to whole 2 MiB pages: a tensor smaller than one huge
    page still gets one, shared with its neighbours (their bytes are kept;
    only the page size changes). Returns whether the kernel did it; False
    off Linux, on kernels without it, or where the memory cannot be collapsed.
    """
    if sys.platform != "linux" or nbytes <= 0:
        return False
    start = address // _HUGE * _HUGE
    end = -(-(address + nbytes) // _HUGE) * _HUGE
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_COLLAPSE) == 0)
