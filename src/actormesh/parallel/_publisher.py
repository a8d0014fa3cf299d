"""A trainer rank's side of publishing its weights: in place (live) where it can, else a copy.

Two paths, chosen per rank and per publication (:mod:`._publish` has the
reader's side and the copy path's theory of operation, :mod:`._live` the
live path's):

- **live** (:meth:`Publisher.publish_chunks` with a :class:`ChangeCounter`):
  every piece is a contiguous CPU tensor whose memory is a parameter's or
  buffer's own (FSDP2 and TP local shards, plain tensors). Nothing is copied:
  the pieces' memory was registered once (one buffer per piece) and the
  publication names it with the change counter's value. Readers can read it
  until the next change of the weights (exact) or read the trainer's newest
  weights at any later time (latest).
- **copy** (everything else: :meth:`Publisher.publish` of a state dict, a
  Publisher without a counter, weights on a GPU, a piece that is not
  contiguous or whose memory is not the model's, e.g. a state-dict
  conversion's copy): the pieces are copied into the older of two flat
  registered buffers, stamped. Readable until the rank has published twice
  more, whatever the trainer does meanwhile.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from ._live import ChangeCounter, LiveSource, register_live
from ._publish import _ALIGN, _HEADER, Layout

__all__ = ["Publisher", "changing"]

Piece4 = tuple[str, Any, tuple[int, ...], tuple[int, ...]]  #: name, local tensor, global shape, global offset
Reply = tuple[Any, Layout, int]  #: (RDMABuffer or LiveSource, layout, stamp)


def _local(t: Any) -> Any:
    """A DTensor's shard on this rank (without to_local()'s autograd call: this only reads its address), else ``t``."""
    local = getattr(t, "_local_tensor", None)
    if local is None and hasattr(t, "to_local"):
        local = t.to_local()
    return t if local is None else local


def _select(state: dict[str, Any], first_copy: bool, coords: Mapping[str, int] | None = None) -> list[Piece4]:
    """The pieces this rank publishes: its shards, and its plain tensors if it holds their first copy."""
    from torch.distributed.tensor import DTensor

    return [p for p in _pieces(state, coords or {}) if first_copy or isinstance(state[p[0]], DTensor)]


def _pieces(state: dict[str, Any], coords: Mapping[str, int]) -> list[Piece4]:
    """``(name, local tensor, global shape, global offset)`` of what this rank publishes (first holders only).

    ``coords``: this rank's place along the trainer's mesh dimensions (``{"tp": 1, ...}``). A DTensor
    is the same on every rank along a dimension its own mesh lacks (FSDP's shard of a norm weight
    under FSDP x TP lives on the ``dp_shard`` mesh and is repeated along ``tp``): only coordinate 0 publishes it.
    """
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = []
    for name, tensor in state.items():
        if not isinstance(tensor, DTensor):
            out.append((name, tensor, tuple(tensor.shape), (0,) * tensor.dim()))
            continue
        mesh, placements = tensor.device_mesh, tensor.placements
        own = mesh.mesh_dim_names or ()
        if any(c != 0 for dim, c in coords.items() if dim not in own):
            continue
        coord = mesh.get_coordinate() or []
        # along a replicated mesh dimension every rank holds the same piece: the first one publishes it
        if any(isinstance(p, Replicate) and c != 0 for p, c in zip(placements, coord)):
            continue
        local = tensor.to_local()
        _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
        out.append((name, local, tuple(tensor.shape), tuple(offset)))
    return out


def _layout(pieces: list[Piece4], packed: bool) -> tuple[Layout, int]:
    """Each piece's entry, and the flat buffer's size: packed after the stamp, or each at 0 of its own buffer."""
    layout: Layout = []
    offset = _HEADER
    for name, local, shape, global_offset in pieces:
        nbytes = local.numel() * local.element_size()
        dtype = str(local.dtype).removeprefix("torch.")
        layout.append((name, dtype, shape, tuple(local.shape), global_offset, offset if packed else 0, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return layout, offset


class Publisher:
    """One rank's publications: live where :meth:`live_ok` says so (with a counter), else copied.

    Not thread-safe: one publication at a time per rank, on the thread that
    changes the weights (a publication is never made mid-change).
    """

    def __init__(self, counter: ChangeCounter | None = None) -> None:
        self.counter = counter
        self._slots: list[tuple[Any, Any]] = []  #: (RDMABuffer, flat uint8 tensor), at most two
        self._turn = 0  # the slot the next copy overwrites
        self._fence = threading.Lock()  # acquired between the stamp and the bytes: a full memory barrier
        self._memo: tuple[Any, Any] | None = None  #: (signature of the chunks' tensors, their sharded state dict)
        self._live: tuple[Any, LiveSource, Layout] | None = None  #: (signature, registrations, layout)
        self._chunks: list[Any] = []  #: the chunks of the last live publication
        self.buffers_live = False  #: the live publication holds buffers (a forward pass may change them) as well as parameters
        self.path = "none"  #: the path the last publication took: "live" or "copy" (for tests and figures)
        if counter is not None:
            counter.on_end.append(self._forget_if_moved)

    def publish_chunks(self, chunks: list[Any], first_copy: bool = True, coords: Mapping[str, int] | None = None) -> Reply | None:
        """Publish the chunks' weights by the full model's names (DTensors stay sharded: nothing is gathered).

        ``first_copy`` and ``coords`` say which copies this rank publishes (see :meth:`publish`, :func:`_pieces`).

        torch's sharded state dict (and each shard's place in its tensor) is
        worked out once and reused while the chunks hold the same tensors in
        the same memory (an optimizer step changes values in place, not that).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        signature = _signature(chunks)
        key = (signature, first_copy, sorted((coords or {}).items()))
        if self._memo is None or self._memo[0] != key:
            state: dict[str, Any] = {}
            for chunk in chunks:
                state.update(get_model_state_dict(chunk, options=StateDictOptions(full_state_dict=False)))
            self._memo = (key, _select(state, first_copy, coords))
        pieces = self._memo[1]
        if self.counter is not None and pieces and self.live_ok(pieces, signature):
            self._chunks = list(chunks)
            params = {_local(p).data_ptr() for chunk in chunks for p in chunk.parameters()}
            self.buffers_live = any(local.numel() and local.data_ptr() not in params for _, local, _, _ in pieces)
            return self._publish_live(pieces, key)
        return self._write(pieces)

    def publish(self, state: dict[str, Any], first_copy: bool = True) -> Reply | None:
        """Copy this rank's pieces of ``state`` (tensors or DTensors): ``(buffer, layout, stamp)``, or None.

        ``first_copy``: this rank holds the first copy of its plain
        (not DTensor) tensors (e.g. data-parallel rank 0); others skip them.
        """
        return self._write(_select(state, first_copy))

    @staticmethod
    def live_ok(pieces: list[Piece4], signature: list[tuple[int, int]]) -> bool:
        """Whether every piece can be read in place: a contiguous CPU tensor in the model's own memory.

        CPU only: a GPU's writes (an optimizer step's kernels) finish after the
        call that queued them, so the counter would go even too early, and a
        same-host peer cannot read device memory with process_vm_readv anyway.
        """
        own = {ptr for _, ptr in signature}
        return all(local.device.type == "cpu" and local.is_contiguous() and (local.numel() == 0 or local.data_ptr() in own)
                   for _, local, _, _ in pieces)

    def _publish_live(self, pieces: list[Piece4], key: Any) -> Reply:
        assert self.counter is not None
        if self._live is None or self._live[0] != key:
            self._drop_live()
            layout, _ = _layout(pieces, packed=False)
            self._live = (key, LiveSource(self.counter.buffer, register_live([p[1] for p in pieces])), layout)
        self.path = "live"
        return self._live[1], self._live[2], self.counter.value

    def _forget_if_moved(self) -> None:
        """At the end of a change: if it gave a registered piece new memory, drop the stale registrations
        (their readers then fail with BufferDroppedError instead of reading memory the weights left)."""
        if self._live is not None and _signature(self._chunks) != self._live[0][0]:
            self._drop_live()
            self._memo = None

    def close(self) -> None:
        """Drop every registration (parameters, copy buffers, counter): readers then get BufferDroppedError,
        and the memory is free once the trainer lets go of it. Idempotent."""
        self._drop_live()
        for buf, _ in self._slots:
            buf.drop()
        self._slots.clear()
        self._memo = None
        if self.counter is not None:
            self.counter.buffer.drop()

    def _drop_live(self) -> None:
        if self._live is not None:
            for buf in self._live[1].buffers:
                if buf is not None:
                    buf.drop()
            self._live = None

    def _write(self, pieces: list[Piece4]) -> Reply | None:
        import torch

        if not pieces:
            return None
        layout, size = _layout(pieces, packed=True)
        buffer, flat = self._slot(size)
        stamp_word = flat[:8].view(torch.int64)
        stamp_word.fill_(0)  # readers of the publication this slot held now fail their check
        with self._fence:
            pass
        for (_, local, _, _), (*_, start, nbytes) in zip(pieces, layout):
            flat[start:start + nbytes].copy_(local.detach().reshape(-1).cpu().view(torch.uint8))
        stamp = int.from_bytes(os.urandom(8), "little") >> 1 | 1  # positive int64, odd, never 0
        with self._fence:
            pass
        stamp_word.fill_(stamp)
        self.path = "copy"
        return buffer, layout, stamp

    def _slot(self, nbytes: int) -> tuple[Any, Any]:
        """The slot to overwrite, reallocated when the size changed (a new model or plan)."""
        import torch

        from ..rdma import RDMABuffer

        turn, self._turn = self._turn, 1 - self._turn
        if turn < len(self._slots) and self._slots[turn][1].numel() == nbytes:
            return self._slots[turn]
        flat = torch.empty(nbytes, dtype=torch.uint8)
        # Registered before its first write: registration asks for huge pages, which only
        # memory faulted in later gets (and a same-host reader copies from those twice as fast).
        slot = (RDMABuffer(flat), flat)
        if turn < len(self._slots):
            self._slots[turn][0].drop()
            self._slots[turn] = slot
        else:
            self._slots.append(slot)
        return slot


def changing(publisher: Publisher | None, forward: bool = False) -> AbstractContextManager[None]:
    """What a trainer wraps a change of its weights in: its live publisher's counter's ``changing()``, or nothing
    (before its first publication nobody reads the weights). ``forward=True``: a whole training step, which
    changes published weights only when buffers are published (a forward pass may update them)."""
    if publisher is None or publisher.counter is None or (forward and not publisher.buffers_live):
        return nullcontext()
    return publisher.counter.changing()


def _signature(chunks: list[Any]) -> list[tuple[int, int]]:
    """Which tensors the chunks hold and where their memory is: a change of either invalidates what was worked out."""
    return [(id(t), _local(t).data_ptr()) for chunk in chunks for t in (*chunk.parameters(), *chunk.buffers())]
