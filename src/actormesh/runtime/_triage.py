"""Supervision decisions, sans-I/O: what an owner does with one failure report.

Theory of operation
-------------------
An owner keeps one :class:`MeshRecord` per actor mesh it spawned. Failures
reach it two ways: the failed actor reports itself (a ``FAILURE`` message:
mesh, rank, cause, the address it ran at), or the owner's process notices that
a peer process is gone (every rank that lived there failed with that cause).
:class:`FailureTriage` turns each into one :class:`Decision` per rank, by these
rules, in order:

1. A stopped mesh reports nothing: its members end on purpose (IGNORE).
2. A rank is reported once: a second report of the same rank, by any path
   (its own report and then its process's loss, say), is a duplicate (IGNORE).
3. A report about an earlier incarnation is stale: once a member was restarted
   on a fresh process, the old process's late report or loss says nothing about
   the new one (IGNORE).
4. With a :class:`RestartPolicy`, a rank is restarted while fewer than
   ``max_restarts`` restarts happened in the last ``within_s`` seconds
   (RESTART; the shell respawns it). A restart that cannot be done is reported
   (:meth:`FailureTriage.restart_failed`).
5. Otherwise the failure is reported to the owner (REPORT, with the
   :class:`MeshFailure` to deliver) and the rank is marked failed, so later
   calls to it fail at once.

The clock is injected, so every rule is tested in virtual time
(``tests/test_triage.py``). The shell (``_supervision.install``) runs it on the
loop thread and does the I/O: respawning, calling ``__supervise__`` or the
fault hook.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ._actor import MeshFailure

__all__ = ["MeshRecord", "RestartPolicy", "Decision", "Action", "FailureTriage"]


@dataclass(frozen=True)
class RestartPolicy:
    """Restart failed members of an actor mesh, like an OTP supervisor.

    At most ``max_restarts`` restarts within any ``within_s`` seconds; one more
    failure inside that window is escalated to the owner as usual. A member whose
    proc died gets a fresh proc at the same rank; calls in flight to the failed
    member fail (at most once), calls made after the restart reach the new one.
    """

    max_restarts: int = 3
    within_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if not self.within_s > 0:
            raise ValueError(f"within_s must be > 0 seconds, got {self.within_s!r}")


@dataclass
class MeshRecord:
    """What the owner knows of one actor mesh it spawned."""

    name: str
    owner: str
    addresses: Sequence[str]
    display: str
    #: rank -> the cause it failed with (later calls to it fail at once with it).
    failed: dict[int, str] = field(default_factory=dict)
    #: Why the mesh was stopped on purpose, or None while it runs.
    stopped: str | None = None
    reported: set[int] = field(default_factory=set)
    #: Qualified name of the member at a rank, for messages.
    describe: Callable[[int], str] | None = None
    #: Restart policy (see RestartPolicy) and how to respawn one rank.
    restart: RestartPolicy | None = None
    respawn: Callable[[int], None] | None = None
    restart_times: list[float] = field(default_factory=list)

    def member(self, rank: int) -> str:
        """Qualified name of the member at ``rank``."""
        return self.describe(rank) if self.describe else f"{self.display} rank {rank}>"


class Decision(enum.Enum):
    """What the owner does with one failed rank."""

    IGNORE = "ignore"
    RESTART = "restart"
    REPORT = "report"


@dataclass(frozen=True)
class Action:
    """One decision of :class:`FailureTriage`, with what the shell needs to act on it."""

    decision: Decision
    record: MeshRecord
    rank: int
    cause: str
    #: Why (for IGNORE and RESTART: a short reason, for logs and tests).
    why: str = ""
    #: For REPORT: the failure to deliver to the owner.
    failure: MeshFailure | None = None


class FailureTriage:
    """The rules above. Not thread-safe: one shell calls it (the loop thread).

    Example (virtual time)::

        >>> now = [0.0]
        >>> triage = FailureTriage(lambda: now[0])
        >>> rec = MeshRecord("m", "client", ["a"], "<m", restart=RestartPolicy(1, 10.0), respawn=lambda r: None)
        >>> triage.on_failure(rec, 0, "boom", "a", "m[0]").decision
        <Decision.RESTART: 'restart'>
        >>> triage.on_failure(rec, 0, "boom again", "a", "m[0]").decision
        <Decision.REPORT: 'report'>
        >>> triage.on_failure(rec, 0, "late", "a", "m[0]").decision
        <Decision.IGNORE: 'ignore'>
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock

    def on_failure(self, record: MeshRecord, rank: int, cause: str, source: str | None, actor: str) -> Action:
        """A member reported its own failure (``source``: the address it ran at)."""
        ignore = self._ignored(record, rank, source)
        if ignore:
            return Action(Decision.IGNORE, record, rank, cause, why=ignore)
        if self._may_restart(record):
            return Action(Decision.RESTART, record, rank, cause, why=f"restart {len(record.restart_times)} of {record.restart.max_restarts}")  # type: ignore[union-attr]
        policy = record.restart
        spent = f"{policy.max_restarts} restarts within {policy.within_s:g}s" if policy is not None and record.respawn is not None else ""
        return self._report(record, rank, cause, actor, why=spent)

    def on_peer_lost(self, records: Sequence[MeshRecord], address: str, cause: str) -> list[Action]:
        """The process at ``address`` is gone: every rank that lived there failed."""
        actions = []
        for record in records:
            for rank, addr in enumerate(record.addresses):
                if addr == address:
                    actions.append(self.on_failure(record, rank, cause, address, record.member(rank)))
        return actions

    def restart_failed(self, action: Action) -> Action:
        """The shell could not restart ``action``'s rank: report the failure instead."""
        return self._report(action.record, action.rank, action.cause, action.record.member(action.rank), why="the restart failed")

    def _ignored(self, record: MeshRecord, rank: int, source: str | None) -> str:
        if record.stopped is not None:
            return "the mesh was stopped"
        if rank in record.reported:
            return "already reported"
        if source is not None and rank < len(record.addresses) and record.addresses[rank] != source:
            return "a report about an earlier incarnation"
        return ""

    def _may_restart(self, record: MeshRecord) -> bool:
        policy = record.restart
        if policy is None or record.respawn is None:
            return False
        now = self._clock()
        record.restart_times[:] = [t for t in record.restart_times if now - t < policy.within_s]
        if len(record.restart_times) >= policy.max_restarts:
            return False
        record.restart_times.append(now)
        return True

    def _report(self, record: MeshRecord, rank: int, cause: str, actor: str, why: str = "") -> Action:
        record.reported.add(rank)
        record.failed.setdefault(rank, cause)
        failure = MeshFailure(mesh_name=record.name, crashed_ranks=[rank], cause=cause, actor=actor)
        return Action(Decision.REPORT, record, rank, cause, why=why, failure=failure)
