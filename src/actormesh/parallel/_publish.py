"""Weights published by a trainer's ranks as RDMA buffers, read by whoever needs them (generators).

Why: pushing new weights to generator replicas through the controller copies
every byte through it twice (pickled in, pickled out to each replica). Here
each rank that holds the first copy of some full tensors (rank 0 of its
pipeline stage: FSDP and TP shards are gathered there by torch's own
``get_model_state_dict(full_state_dict=True)``) packs them into one flat
buffer and registers it with :class:`actormesh.rdma.RDMABuffer`; only the
small handles and the layout travel, as a :class:`PublishedWeights`, and each
reader pulls the bytes straight from the trainer's memory (one kernel copy on
one host, a bulk stream across hosts). A rank keeps its last two
publications alive, so a reader that got the previous handle can still read
it while the next one is being announced.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["PublishedWeights", "Publisher", "resolve_weights"]

_ALIGN = 64  # each tensor starts on a multiple of this many bytes (any dtype can view it)

Layout = list[tuple[str, str, tuple[int, ...], int, int]]  # name, dtype, shape, byte offset, nbytes


@dataclass(frozen=True)
class PublishedWeights:
    """Handles to a full model's weights in a trainer's memory: picklable, a few hundred bytes.

    ``fetch()`` reads every part and returns the state dict (views of one
    buffer per part). ``nbytes`` is the total size.
    """

    version: int
    parts: tuple[tuple[Any, Layout], ...]  #: (RDMABuffer, layout) per publishing rank

    @property
    def nbytes(self) -> int:
        return sum(buf.size() for buf, _ in self.parts)

    def fetch(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Read the weights here; RDMAError (OwnerGoneError, ...) if a publishing rank is gone."""
        import torch

        out: dict[str, Any] = {}
        for buf, layout in self.parts:
            local = torch.empty(buf.size(), dtype=torch.uint8)
            buf.read_into(local, timeout=timeout_s).get(timeout=timeout_s + 5)
            for name, dtype, shape, offset, nbytes in layout:
                out[name] = local[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape)
        return out

    def keys(self) -> list[str]:
        """The weights' names (without reading them)."""
        return [name for _, layout in self.parts for name, *_ in layout]


class Publisher:
    """One rank's side: pack full tensors into a registered buffer; keeps the last two alive."""

    def __init__(self) -> None:
        self._kept: deque[Any] = deque(maxlen=2)

    def publish(self, state: dict[str, Any]) -> tuple[Any, Layout] | None:
        """Register ``state`` (full CPU tensors) as one buffer; its handle and layout (None if empty)."""
        import torch

        from ..rdma import RDMABuffer

        if not state:
            return None
        layout: Layout = []
        offset = 0
        for name, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            layout.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        flat = torch.empty(max(offset, 1), dtype=torch.uint8)
        for (name, _, _, start, nbytes), tensor in zip(layout, state.values()):
            flat[start:start + nbytes] = tensor.detach().contiguous().view(-1).view(torch.uint8)
        buffer = RDMABuffer(flat)
        self._kept.append((buffer, flat))  # the oldest kept one is dropped by the deque (its memory freed)
        return buffer, layout


def resolve_weights(weights: Any) -> Any:
    """A state dict from what a caller may give: a state dict, a path (read), or :class:`PublishedWeights` (fetched)."""
    import os

    from ._replica import read_weights

    if isinstance(weights, (str, os.PathLike)):
        return read_weights(weights)
    if isinstance(weights, PublishedWeights):
        return weights.fetch()
    return weights
