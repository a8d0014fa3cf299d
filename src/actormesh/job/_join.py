"""Waiting for host agents to dial the controller (JOIN) and matching them to hosts.

An agent started with ``--controller ADDR`` dials the controller and announces
``(address, hostname, pid)``; the runtime calls ``on_join`` hooks on its loop
thread. :class:`JoinWaiter` queues those announcements (the hook only does a
``put``) and :meth:`JoinWaiter.wait` assigns them to the expected hosts, with a
deadline, a liveness check of whatever started the agents, and an error that
names every host that did not join.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._errors import JobError
from ._progress import Progress

log = logging.getLogger("actormesh.job")

__all__ = ["Slot", "JoinWaiter", "host_of", "by_pid", "by_host_name"]


def host_of(address: str) -> str:
    """The host part of ``tcp:HOST:PORT`` (brackets of IPv6 removed); '' for others."""
    if not address.startswith("tcp:"):
        return ""
    return address[4:].rsplit(":", 1)[0].strip("[]")


Matcher = Callable[[str, str, int], bool]


def by_pid(pid: int) -> Matcher:
    """Matches the agent with this pid (agents that are our own children)."""
    return lambda address, hostname, agent_pid: agent_pid == pid


def by_host_name(name: str) -> Matcher:
    """Matches an agent whose host name, or address host, has ``name`` as its first label."""
    short = name.split(".")[0]
    return lambda address, hostname, pid: short in (hostname.split(".")[0], host_of(address).split(".")[0])


@dataclass
class Slot:
    """One expected host: ``label`` names it in messages; ``matches(address, hostname, pid)``
    tells whether an announcement comes from it."""

    label: str
    matches: Matcher
    address: str | None = None
    hostname: str | None = None


class JoinWaiter:
    """Collects agent announcements on ``runtime`` from construction until :meth:`close`.

    Create it *before* starting the agents so that no announcement is missed.
    """

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime
        self._joins: queue.Queue[tuple[str, str, int]] = queue.Queue()
        self._hook = lambda address, hostname, pid: self._joins.put((address, hostname, pid))
        runtime.handlers.join.append(self._hook)

    def close(self) -> None:
        """Stop listening (idempotent)."""
        try:
            self._runtime.handlers.join.remove(self._hook)
        except ValueError:
            pass

    def wait(
        self,
        slots: Sequence[Slot],
        timeout_s: float,
        *,
        what: str,
        check: Callable[[], str | None] | None = None,
        details: Callable[[list[Slot]], str] | None = None,
        any_order: bool = False,
        poll_s: float = 0.2,
    ) -> list[Slot]:
        """Block until every slot has an agent; return the slots (addresses filled in).

        ``check()`` runs every ``poll_s`` while waiting and returns a reason to
        give up early (an agent process exited, the scheduler failed the job).
        With ``any_order``, an announcement no slot matches fills the first
        empty slot (for hosts whose names cannot be predicted). Raises
        :class:`JobError` naming the hosts still missing, plus ``details(missing)``.
        """
        deadline = time.monotonic() + timeout_s
        missing = [s for s in slots if s.address is None]
        with Progress(f"waiting for the hosts of {what}") as progress:
            while missing:
                progress.update(f"{len(slots) - len(missing)}/{len(slots)} joined; waiting for {_names(missing)}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._error(f"{len(missing)} of {len(slots)} host(s) did not join within {timeout_s:g}s", what, missing, details)
                try:
                    address, hostname, pid = self._joins.get(timeout=min(poll_s, remaining))
                except queue.Empty:
                    reason = check() if check is not None else None
                    if reason:
                        raise self._error(reason, what, missing, details) from None
                    continue
                slot = next((s for s in missing if s.matches(address, hostname, pid)), None)
                if slot is None and any_order and missing:
                    slot = missing[0]
                if slot is None:
                    log.warning("%s: ignoring a host agent that no expected host matches: %s (host %s, pid %d)", what, address, hostname, pid)
                    continue
                slot.address, slot.hostname = address, hostname
                missing.remove(slot)
        return list(slots)

    @staticmethod
    def _error(reason: str, what: str, missing: list[Slot], details: Callable[[list[Slot]], str] | None) -> JobError:
        message = f"{what}: not joined: {_names(missing)} ({reason})"
        extra = details(missing) if details is not None else ""
        return JobError(message + (f"\n{extra}" if extra else ""))


def _names(slots: list[Slot], limit: int = 8) -> str:
    names = [s.label for s in slots[:limit]]
    more = len(slots) - limit
    return ", ".join(names) + (f" and {more} more" if more > 0 else "")
