"""Weights published by a trainer's ranks as RDMA buffers, read by whoever needs them (generators).

Why: pushing new weights to generator replicas through the controller copies
every byte through it (gathered in, sent out to each replica). Here every
trainer rank snapshots the pieces of the weights it holds (its FSDP and TP
shards; a whole tensor where it is not sharded) into one flat buffer of its
own and registers it with :class:`actormesh.rdma.RDMABuffer`: no gather, no
communication between the ranks. Only the small handles and the layout (each
piece's name, global shape and offset) travel, as a
:class:`PublishedWeights`; a reader pulls every rank's buffer straight from
its memory, all ranks at once (one kernel copy each on one host, a bulk
stream across hosts), and assembles the full tensors. A piece held by
several ranks (data-parallel replicas, replicated placements) is published
by one of them only. A rank keeps its last two publications alive, so a
reader that got the previous handle can still read it while the next one is
being announced.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["PublishedWeights", "Publisher", "resolve_weights"]

_ALIGN = 64  # each piece starts on a multiple of this many bytes (any dtype can view it)

#: name, dtype, global shape, this piece's shape, its offset in the global tensor, byte offset, nbytes
Piece = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...], int, int]
Layout = list[Piece]


@dataclass(frozen=True)
class PublishedWeights:
    """Handles to a full model's weights in a trainer's memory: picklable, a few KiB.

    ``fetch()`` reads every part and returns the full state dict. ``nbytes``
    is the size of what a fetch reads.
    """

    version: int
    parts: tuple[tuple[Any, Layout], ...]  #: (RDMABuffer, layout) per publishing rank

    @property
    def nbytes(self) -> int:
        return sum(buf.size() for buf, _ in self.parts)

    def keys(self) -> list[str]:
        """The weights' names (without reading them)."""
        return sorted({piece[0] for _, layout in self.parts for piece in layout})

    def fetch(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Read the weights here (every part at once); RDMAError (OwnerGoneError, ...) if a publishing rank is gone."""
        import torch

        locals_ = [torch.empty(buf.size(), dtype=torch.uint8) for buf, _ in self.parts]
        reads = [buf.read_into(local, timeout=timeout_s) for (buf, _), local in zip(self.parts, locals_)]
        for read in reads:
            read.get(timeout=timeout_s + 5)
        out: dict[str, Any] = {}
        for (_, layout), local in zip(self.parts, locals_):
            for name, dtype, shape, piece_shape, offset, start, nbytes in layout:
                piece = local[start:start + nbytes].view(getattr(torch, dtype)).view(piece_shape)
                if piece_shape == shape:  # a whole tensor: a view of the part, no copy
                    out[name] = piece
                    continue
                full = out.get(name)
                if full is None:
                    full = out[name] = torch.empty(shape, dtype=getattr(torch, dtype))
                full[tuple(slice(o, o + n) for o, n in zip(offset, piece_shape))].copy_(piece)
        return out


def _pieces(state: dict[str, Any]) -> list[tuple[str, Any, tuple[int, ...], tuple[int, ...]]]:
    """``(name, local tensor, global shape, global offset)`` of what this rank publishes (first holders only)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = []
    for name, tensor in state.items():
        if not isinstance(tensor, DTensor):
            out.append((name, tensor, tuple(tensor.shape), (0,) * tensor.dim()))
            continue
        mesh, placements = tensor.device_mesh, tensor.placements
        coords = mesh.get_coordinate() or []
        # along a replicated mesh dimension every rank holds the same piece: the first one publishes it
        if any(isinstance(p, Replicate) and c != 0 for p, c in zip(placements, coords)):
            continue
        local = tensor.to_local()
        _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
        out.append((name, local, tuple(tensor.shape), tuple(offset)))
    return out


class Publisher:
    """One rank's side: snapshot its pieces into a registered buffer; keeps the last two alive."""

    def __init__(self) -> None:
        self._kept: deque[Any] = deque(maxlen=2)

    def publish(self, state: dict[str, Any], first_copy: bool = True) -> tuple[Any, Layout] | None:
        """Register this rank's pieces of ``state`` (tensors or DTensors); the handle and layout, or None.

        ``first_copy``: this rank holds the first copy of its plain
        (not DTensor) tensors (e.g. data-parallel rank 0); others skip them.
        """
        import torch

        from ..rdma import RDMABuffer

        from torch.distributed.tensor import DTensor

        pieces = [p for p in _pieces(state) if first_copy or isinstance(state[p[0]], DTensor)]
        if not pieces:
            return None
        layout: Layout = []
        offset = 0
        for name, local, shape, global_offset in pieces:
            nbytes = local.numel() * local.element_size()
            layout.append((name, str(local.dtype).removeprefix("torch."), shape, tuple(local.shape), global_offset, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        flat = torch.empty(max(offset, 1), dtype=torch.uint8)
        for (_, local, _, _), (*_, start, nbytes) in zip(pieces, layout):
            flat[start:start + nbytes].copy_(local.detach().reshape(-1).cpu().view(torch.uint8))
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
