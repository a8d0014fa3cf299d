"""Double-buffered weights for a generation rank: new weights are read beside the live ones, then swapped.

Why: a weight update must not stall decoding for longer than a pointer swap,
and must not cost fresh memory each time. A :class:`WeightStaging` keeps a
spare set of tensors shaped like the rank's parameters. :meth:`stage` reads
published weights (:class:`PublishedWeights`) straight into the spare set,
each trainer rank's shard into the rows it fills, while the live weights go
on serving. :meth:`install`, called between two decode steps, swaps each
parameter's memory with its staged tensor (``param.data = staged``: no copy);
the old memory becomes the spare set for the next update, so after the first
update no memory is allocated and no page is faulted in.

A DTensor (tensor-parallel) parameter, or a staged tensor of another dtype
or device, is copied in instead of swapped (its shard of the full staged
tensor); a full tensor staged for a DTensor is not kept as spare (it is
``tp`` times the rank's shard).

Threads: ``stage`` runs on any thread, ``install`` on the thread that runs
the model's steps. Two stages at once are safe (the second allocates).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ._publish import PublishedWeights
from ._replica import shard_of, weight_targets

__all__ = ["StagedWeights", "WeightStaging"]


class StagedWeights:
    """Weights read into a staging set, ready for :meth:`WeightStaging.install`: name -> full tensor."""

    def __init__(self, owner: WeightStaging, tensors: dict[str, Any]) -> None:
        self.owner = owner
        self.tensors = tensors

    def keys(self) -> list[str]:
        return list(self.tensors)


class WeightStaging:
    """The spare set of one rank's weights (see the module's docstring)."""

    def __init__(self, chunks: Sequence[Any]) -> None:
        self.chunks = list(chunks)
        self._lock = threading.Lock()
        self._spare: dict[str, Any] = {}

    def stage(self, weights: PublishedWeights, timeout_s: float = 300.0) -> StagedWeights | dict[str, Any]:
        """Check ``weights`` against the chunks, then read them into the spare set.

        Raises ValueError naming the first missing or misshapen weight before
        a byte is read (the spare set is left as it was); RDMAError if a
        trainer rank is gone or overwrote the version meanwhile. Weights that
        need renaming (Hugging Face names) are fetched into new memory
        instead: a state dict is returned then.
        """
        import torch

        meta = weights.meta()
        source = {id(t): name for name, t in meta.items()}
        targets = weight_targets(self.chunks, meta)
        if any(id(src) not in source for _, src, _ in targets):  # a tied head copied by the renaming
            return weights.fetch(timeout_s, latest=False)
        with self._lock:
            spare, self._spare = self._spare, {}
        dests: dict[str, Any] = {}  # by published name
        staged: dict[str, Any] = {}  # by the chunk's name
        for name, src, dst in targets:
            published = source[id(src)]
            if published not in dests:
                have = spare.pop(name, None)
                fits = have is not None and have.shape == dst.shape and have.dtype == dst.dtype
                dests[published] = have if fits else torch.empty(tuple(dst.shape), dtype=dst.dtype)
            staged[name] = dests[published]
        try:
            weights.read_into(dests, timeout_s)
        except BaseException:
            self._give_back(staged)
            raise
        return StagedWeights(self, staged)

    def install(self, staged: StagedWeights) -> None:
        """Put staged weights in place of the live ones (between two steps); the old ones become the spare set."""
        import torch
        from torch.distributed.tensor import DTensor

        if staged.owner is not self:
            raise ValueError("these weights were staged for another replica")
        old: dict[str, Any] = {}
        done: set[int] = set()  # a parameter shared by two names (tied weights) is swapped once
        with torch.no_grad():
            for name, _, dst in weight_targets(self.chunks, staged.tensors):
                new = staged.tensors[name]
                if id(dst) in done:
                    continue
                done.add(id(dst))
                if isinstance(dst, DTensor) or new.dtype != dst.dtype or new.device != dst.device:
                    into, src = shard_of(dst, new)
                    into.copy_(src)
                    if not isinstance(dst, DTensor):  # a full tensor per TP rank would cost tp x the shard: not kept
                        old[name] = new
                    continue
                old[name] = dst.data
                dst.data = new
        staged.tensors = {}
        self._give_back(old)

    def _give_back(self, tensors: dict[str, Any]) -> None:
        with self._lock:
            if not self._spare:
                self._spare = tensors
