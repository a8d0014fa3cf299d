"""Weights published by a trainer's ranks over RDMA, read by whoever needs them (generators): the reader's side.

Why: pushing new weights to generator replicas through the controller copies
every byte through it (gathered in, sent out to each replica). Here every
trainer rank publishes the pieces of the weights it holds (its FSDP and TP
shards; a whole tensor where it is not sharded) as memory registered with
:class:`actormesh.rdma.RDMABuffer`: no gather, no communication between the
ranks. Only the small handles and the layout (each piece's name, global
shape and offset) travel, as a :class:`PublishedWeights`; a reader pulls
every rank's pieces straight from its memory into the rows of the full
tensors they belong to (a scatter copy by the kernel on one host, a bulk
stream across hosts). A piece held by several ranks (data-parallel replicas,
replicated placements) is published by one of them only.

A rank's part is one of two kinds (:mod:`._publisher` says which a rank
takes): *live*, the parameters' own memory guarded by a change counter
(:mod:`._live`, a seqlock; nothing copied), or *copied* into the older of
two flat buffers (below).

Theory of operation (copied parts): a rank keeps two flat buffers and
publishes into them in turn, so the previous publication stays readable
while the next one is announced, and no memory is allocated (or
page-faulted) after the first two. Each buffer starts with a header word,
the *stamp* of the publication it holds. Before a buffer is overwritten its
stamp is set to 0; after the copy, to the new publication's random stamp.

Reading (both kinds): a reader reads every part's stamp (a live part's
counter), the pieces, then the stamps again. *Exact* (``read_into``'s
default: the version published, e.g. a sync to every replica): every stamp
must be the published one before and after, else ``BufferDroppedError``
(the trainer changed or republished the weights), never a mix of two
versions. *Latest* (``fetch()``, and ``read_into(latest=True)``: a replica
built after the sync): when every part is live, the read takes the
trainer's weights as they are now, at least as new as published: it waits
while a change is in progress (counters odd or unequal across ranks) and
retries a read a change overlapped, until ``timeout_s`` (then
``RDMATimeoutError``). With a copied part there is no newer version to
take: latest is exact.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._live import LiveSource

__all__ = ["PublishedWeights", "resolve_weights"]

_ALIGN = 64  # each piece starts on a multiple of this many bytes (any dtype can view it)
_HEADER = _ALIGN  # the stamp (int64) at offset 0, then the pieces

#: name, dtype, global shape, this piece's shape, its offset in the global tensor, byte offset, nbytes
Piece = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...], int, int]
Layout = list[Piece]


@dataclass(frozen=True)
class PublishedWeights:
    """Handles to a full model's weights in a trainer's memory: picklable, a few KiB.

    ``fetch()`` reads every part and returns the full state dict;
    ``read_into(dests)`` reads them straight into tensors the caller owns.
    ``nbytes`` is the size of what a fetch reads. ``stamps`` (one per part:
    a copied part's stamp, a live part's change counter when published) let
    a reader check that no part changed while it read (see the module's docstring).
    """

    version: int
    parts: tuple[tuple[Any, Layout], ...]  #: (RDMABuffer or LiveSource, layout) per publishing rank
    stamps: tuple[int, ...] = ()

    @classmethod
    def from_replies(cls, version: int, replies: list[Any]) -> PublishedWeights:
        """From the ranks' :meth:`Publisher.publish` results (``None`` from a rank with nothing to publish)."""
        kept = [r for r in replies if r is not None]
        return cls(version, tuple((buf, layout) for buf, layout, _ in kept), tuple(stamp for _, _, stamp in kept))

    @property
    def nbytes(self) -> int:
        return sum(source.size() for source, _ in self.parts)

    def keys(self) -> list[str]:
        """The weights' names (without reading them)."""
        return sorted({piece[0] for _, layout in self.parts for piece in layout})

    def meta(self) -> dict[str, Any]:
        """Every weight as a tensor on the meta device (name, shape, dtype; no bytes), for checks before a read."""
        import torch

        out: dict[str, Any] = {}
        for _, layout in self.parts:
            for name, dtype, shape, *_ in layout:
                out.setdefault(name, torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))
        return out

    def fetch(self, timeout_s: float = 300.0, latest: bool = True) -> dict[str, Any]:
        """The weights here, in new tensors (:meth:`read_into`): by default the trainer's latest, at least
        this version, whole (``latest=False``: this version only). RDMAError (OwnerGoneError, ...) if a
        publishing rank is gone, BufferDroppedError if a copied part was published over twice since (or,
        exact, anything changed), RDMATimeoutError if the weights kept changing for ``timeout_s``."""
        import torch

        out = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in self.meta().items()}
        self.read_into(out, timeout_s, latest)
        return out

    def read_into(self, dests: Mapping[str, Any], timeout_s: float = 300.0, latest: bool = False) -> None:
        """Read the weights named in ``dests`` into them (full-shape CPU tensors; other weights are not read).

        ``latest=False``: exactly this version, else BufferDroppedError (the
        trainer changed or republished the weights since); ``latest=True``:
        the trainer's weights as they are when read, at least this version
        (see the module's docstring). Either way never a mix of two versions.
        A piece of the same dtype that fills whole rows of its tensor (an FSDP
        or row-wise shard, or the whole tensor) lands in place with no copy of
        our own; any other piece goes through a temporary. Raises ValueError
        (before reading) for a name that was not published or a shape that
        differs, or if the pieces do not cover a tensor; RDMAError if a rank
        is gone (OwnerGoneError) or the read ran out of time (RDMATimeoutError).
        """
        meta = self.meta()
        for name, dst in dests.items():
            if name not in meta:
                raise ValueError(f"{name!r} was not published (published: {len(meta)} weights, e.g. {sorted(meta)[:3]})")
            if tuple(dst.shape) != tuple(meta[name].shape):
                raise ValueError(f"{name!r} was published with shape {tuple(meta[name].shape)}, the destination's is {tuple(dst.shape)}")
        plans = [_plan_reads(layout, dests) for _, layout in self.parts]
        _check_covered(dests, [covered for _, _, covered in plans])
        loose = latest and all(isinstance(source, LiveSource) for source, _ in self.parts)
        deadline = time.monotonic() + timeout_s
        pause_s = 0.001
        while True:
            before = self._stamps_now(deadline)
            if not self._readable(before, loose):
                if time.monotonic() + pause_s > deadline:
                    raise self._still_changing(before, timeout_s)
                time.sleep(pause_s)  # a change is in progress on a rank (an optimizer step): it ends on its own
                pause_s = min(pause_s * 2, 0.05)
                continue
            self._read_parts([ranges for ranges, _, _ in plans], deadline)
            after = self._stamps_now(deadline)
            if after == before:
                break
            if not loose:
                self._readable(after, loose)  # raises: the version was changed or published over during the read
            if time.monotonic() > deadline:  # latest: a change overlapped every read so far
                raise self._still_changing(after, timeout_s)
            # latest: a change overlapped the read: read again
        for _, later, _ in plans:
            for temp, dst, index, dtype, shape in later:
                dst[index].copy_(temp.view(dtype).view(shape))

    def _stamps_now(self, deadline: float) -> list[int]:
        """Every part's stamp word (a live part's change counter) as it is now."""
        import torch

        words = []
        for source, _ in self.parts:
            word = torch.zeros(1, dtype=torch.int64)
            buf = source.counter if isinstance(source, LiveSource) else source
            buf.read_ranges([(0, word.view(torch.uint8))], timeout=_left(deadline)).get(timeout=_left(deadline) + 5)
            words.append(int(word))
        return words

    def _readable(self, stamps: list[int], loose: bool) -> bool:
        """Whether the pieces can be read now; exact reads raise BufferDroppedError once a stamp moved."""
        from ..rdma import BufferDroppedError

        if loose:  # every rank still (even) and at the same change: one version
            return all(s % 2 == 0 for s in stamps) and len(set(stamps)) <= 1
        for (source, _), now, stamp in zip(self.parts, stamps, self.stamps):
            if now == stamp:
                continue
            if isinstance(source, LiveSource):
                why = ("changed the weights after publishing them (an optimizer step or a load): publish again, "
                       "or fetch() the latest weights")
            else:
                why = ("published newer weights over them (a reader must finish before the trainer publishes twice more); "
                       "read the newer version")
            raise BufferDroppedError(f"weights version {self.version}: {source.owner} {why}", owner=source.owner)
        return True

    def _still_changing(self, stamps: list[int], timeout_s: float) -> Exception:
        from ..rdma import RDMATimeoutError

        owners = ", ".join(f"{source.owner} at change {s}" for (source, _), s in zip(self.parts, stamps))
        return RDMATimeoutError(f"weights version {self.version}: the trainer's weights were changing for all of {timeout_s}s "
                                f"(an odd count is a change in progress; ranks must be at the same one): {owners}")

    def _read_parts(self, ranges: list[list[tuple[int, int, Any]]], deadline: float) -> None:
        """Every part's pieces into place, as one transfer (:func:`actormesh.rdma.read_scattered`): on this
        host one scatter copy per rank, one rank after another (several readers at once, the other replicas,
        already fill the cores: more threads only contend; measured 0.043 s against 0.063 s for two replicas
        reading 440 MB each); across hosts the ranks stream at once."""
        from ..rdma import read_scattered

        reads = []  # (buffer, offset, dst)
        for (source, _), part in zip(self.parts, ranges):
            for i, start, dst in part:
                if dst.numel():
                    reads.append((source.buffers[i] if isinstance(source, LiveSource) else source, start, dst))
        read_scattered(reads, timeout=_left(deadline)).get(timeout=_left(deadline) + 5)


def _left(deadline: float) -> float:
    """Seconds to ``deadline``, at least a little (an RDMA timeout must be positive; a late read then times out)."""
    return max(deadline - time.monotonic(), 0.001)


def _plan_reads(layout: Layout, dests: Mapping[str, Any]) -> tuple[list[Any], list[Any], dict[str, int]]:
    """One part's reads: ``(piece index, offset, dst bytes)`` ranges, the pieces to copy in afterwards, elements covered per name."""
    import torch

    ranges: list[tuple[int, int, Any]] = []
    later: list[Any] = []
    covered: dict[str, int] = {}
    for i, (name, dtype_name, shape, piece_shape, offset, start, nbytes) in enumerate(layout):
        dst = dests.get(name)
        if dst is None:
            continue
        dtype = getattr(torch, dtype_name)
        covered[name] = covered.get(name, 0) + _numel(piece_shape)
        rows = all(o == 0 for o in offset[1:]) and tuple(piece_shape[1:]) == tuple(shape[1:])
        if rows and dst.dtype == dtype and dst.is_contiguous() and nbytes:
            row = _numel(shape[1:]) if len(shape) > 1 else 1
            first = offset[0] * row if shape else 0
            ranges.append((i, start, dst.view(-1)[first:first + _numel(piece_shape)].view(torch.uint8)))
            continue
        temp = torch.empty(nbytes, dtype=torch.uint8)
        ranges.append((i, start, temp))
        later.append((temp, dst, tuple(slice(o, o + n) for o, n in zip(offset, piece_shape)), dtype, piece_shape))
    return ranges, later, covered


def _check_covered(dests: Mapping[str, Any], covered: list[dict[str, int]]) -> None:
    for name, dst in dests.items():
        got = sum(c.get(name, 0) for c in covered)
        if got != dst.numel():
            raise ValueError(f"the published pieces of {name!r} hold {got} of its {dst.numel()} elements (a rank's part is missing)")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def resolve_weights(weights: Any) -> Any:
    """A state dict from what a caller may give: a state dict, a path (read), or :class:`PublishedWeights` (fetched)."""
    from ._replica import read_weights

    if isinstance(weights, (str, os.PathLike)):
        return read_weights(weights)
    if isinstance(weights, PublishedWeights):
        return weights.fetch()
    return weights
