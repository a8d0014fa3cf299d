"""Training data read on the ranks: one iterator per data-parallel coordinate, from a user factory.

Theory of operation. The user gives ``spawn_trainer(..., data=factory)``, a
picklable callable; ``factory(dp_rank=, dp_size=, start_step=)`` returns an
iterable of this data-parallel rank's batches ``(inputs, targets)`` (its
``1/dp_size`` share of each global batch), starting at batch ``start_step``.
One batch is drawn per optimizer step (gradient accumulation splits it into
micro-steps), so the loader's position is the number of batches drawn; it is
saved in checkpoints, and a restored trainer calls the factory again with
``start_step`` = that position. A factory that is deterministic in its
arguments therefore resumes exactly.

Ranks that share a data-parallel coordinate (tensor-parallel peers, pipeline
stages) must see the same batch, so only the lowest rank of each such group
(its *leader*) builds an iterator; it broadcasts every batch to its peers.

Failures are agreed before any model collective: after drawing, every rank
joins one all-reduce of "who failed" (0 = nobody). When a leader's factory
raised (or its iterator ended), the failing rank broadcasts its error and
traceback and every rank raises the same :class:`TrainDataError`, so the
controller's call fails once, naming the rank, and no rank is left waiting in
a collective. The step does not happen, the position does not move, and every
leader rebuilds its iterator at the next draw.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["TrainDataError", "RankData", "dp_groups", "rank_data"]

DataFactory = Callable[..., Iterable[Any]]


class TrainDataError(RuntimeError):
    """The data factory (or its iterator) failed on one rank; every rank raises this same error.

    ``rank`` and ``dp_rank`` say where; the message carries the factory's
    exception and traceback from that rank.
    """

    def __init__(self, message: str, rank: int, dp_rank: int) -> None:
        super().__init__(message)
        self.rank, self.dp_rank = rank, dp_rank

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.rank, self.dp_rank))


def dp_groups(mesh: Any) -> list[list[int]]:
    """Global ranks sharing each data-parallel coordinate (the pp x tp ranks at one (dp_replicate, dp_shard))."""
    grid = mesh.mesh  # (pp, dp_replicate, dp_shard, tp) tensor of global ranks
    return [sorted(int(r) for r in grid[:, i, j, :].flatten().tolist())
            for i in range(grid.shape[1]) for j in range(grid.shape[2])]


class RankData:
    """This rank's place in reading the data: leader (builds the iterator) or peer (receives batches).

    :meth:`next_batch` is collective: every rank of the world calls it once per
    step, in the same order as the other collectives.
    """

    def __init__(self, factory: DataFactory, *, rank: int, dp_rank: int, dp_size: int, group: Any, leader: int) -> None:
        self.factory, self.rank, self.dp_rank, self.dp_size = factory, rank, dp_rank, dp_size
        self.group, self.leader = group, leader
        self.position = 0
        self._it: Iterator[Any] | None = None

    @property
    def is_leader(self) -> bool:
        """Whether this rank builds the iterator for its data-parallel coordinate."""
        return self.rank == self.leader

    def seek(self, position: int) -> None:
        """Resume at batch ``position``: the next draw calls the factory with ``start_step=position``."""
        self.position, self._it = int(position), None

    def _draw(self) -> tuple[Any, dict[str, Any] | None]:
        """(batch, None), or (None, failure record) when the factory or its iterator failed here."""
        try:
            if self._it is None:
                self._it = iter(self.factory(dp_rank=self.dp_rank, dp_size=self.dp_size, start_step=self.position))
            batch = next(self._it)
        except StopIteration:
            return None, {"what": "its iterator has no more batches: give an endless iterator or stop the loop sooner", "tb": ""}
        except Exception as exc:
            return None, {"what": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            return None, {"what": f"it yielded a {type(batch).__name__}, not (inputs, targets)", "tb": ""}
        return batch, None

    def next_batch(self) -> Any:
        """This data-parallel rank's next ``(inputs, targets)``; raises :class:`TrainDataError` on every rank if one failed."""
        import torch
        import torch.distributed as dist

        batch, failure = self._draw() if self.is_leader else (None, None)
        if self.group is not None:
            box = [batch]
            dist.broadcast_object_list(box, src=self.leader, group=self.group)
            batch = box[0]
        flag = torch.tensor([self.rank + 1 if failure else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag):
            self._raise_agreed(int(flag) - 1, failure)
        self.position += 1
        return batch

    def _raise_agreed(self, failed_rank: int, failure: dict[str, Any] | None) -> None:
        import torch.distributed as dist

        record = [dict(failure, rank=self.rank, dp_rank=self.dp_rank) if failure else None]
        dist.broadcast_object_list(record, src=failed_rank)
        got = record[0]
        self._it = None  # every leader restarts from the unchanged position
        assert got is not None
        message = (f"the data factory failed on rank {got['rank']} (dp_rank {got['dp_rank']} of {self.dp_size}) "
                   f"at batch {self.position}: {got['what']}")
        if got["tb"]:
            message += f"\n--- traceback on rank {got['rank']} ---\n{got['tb'].rstrip()}"
        raise TrainDataError(message, got["rank"], got["dp_rank"])


def rank_data(factory: DataFactory, mesh: Any, rank: int, dp_rank: int, dp_size: int) -> RankData:
    """This rank's :class:`RankData`; collective (every rank makes the same broadcast groups)."""
    import torch.distributed as dist

    groups = dp_groups(mesh)
    mine = next(g for g in groups if rank in g)
    group = None
    if len(mine) > 1:
        group, _ = dist.new_subgroups_by_enumeration(groups)
    return RankData(factory, rank=rank, dp_rank=dp_rank, dp_size=dp_size, group=group, leader=mine[0])
