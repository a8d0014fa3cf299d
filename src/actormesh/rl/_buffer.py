"""``ReplayBuffer``: completed groups of samples waiting for the trainer, dropped once too old.

Whole groups go in and come out (advantages are relative to a group, so a
group is never split). A group drawn with weights more than
``max_policy_lag`` versions behind the trainer's is dropped when the
trainer asks for a batch, and counted.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..runtime import Actor, endpoint
from ._grpo import Sample

__all__ = ["ReplayBuffer"]


class ReplayBuffer(Actor):
    """Groups of :class:`Sample` (one prompt's completions), oldest first.

    Endpoints: ``add(group)``, ``take(n_groups, version) -> groups or None``,
    ``stats()``. ``capacity`` bounds the groups held: the oldest are dropped
    first when full.
    """

    def __init__(self, max_policy_lag: int = 1, capacity: int = 1024) -> None:
        if max_policy_lag < 0 or capacity < 1:
            raise ValueError(f"max_policy_lag must be >= 0 and capacity >= 1, got {max_policy_lag}, {capacity}")
        self.max_policy_lag, self.capacity = max_policy_lag, capacity
        self._groups: deque[list[Sample]] = deque()
        self.added = self.taken = self.dropped_stale = self.dropped_full = 0

    @endpoint
    def add(self, group: list[Sample]) -> int:
        """Add one group; returns how many groups are held."""
        if not group:
            raise ValueError("an empty group: a group holds one prompt's completions")
        if len(self._groups) >= self.capacity:
            self._groups.popleft()
            self.dropped_full += 1
        self._groups.append(group)
        self.added += 1
        return len(self._groups)

    @endpoint
    def take(self, n_groups: int, version: int) -> list[list[Sample]] | None:
        """``n_groups`` fresh groups for a trainer at weights ``version``, or None (nothing taken) if fewer are held.

        Groups whose oldest sample is more than ``max_policy_lag`` versions
        behind ``version`` are dropped first.
        """
        self._drop_stale(version)
        if len(self._groups) < n_groups:
            return None
        self.taken += n_groups
        return [self._groups.popleft() for _ in range(n_groups)]

    @endpoint
    def stats(self) -> dict[str, Any]:
        """Counts: held, added, taken, dropped (stale, full)."""
        return {"held": len(self._groups), "added": self.added, "taken": self.taken,
                "dropped_stale": self.dropped_stale, "dropped_full": self.dropped_full}

    def _drop_stale(self, version: int) -> None:
        fresh = [g for g in self._groups if version - min(s.version for s in g) <= self.max_policy_lag]
        self.dropped_stale += len(self._groups) - len(fresh)
        self._groups = deque(fresh)
