"""Owner-side supervision: turning failures into ``__supervise__`` calls.

Every mesh has one owner (the actor or client that spawned it). The owner's
process keeps a record per owned actor mesh; a failure of a rank, reported by
the failed actor itself (``FAILURE``) or noticed as a lost process, marks the
rank failed in the record (later calls fail at once) and is delivered once per
failed rank to the owner: an actor's ``__supervise__`` or, at the client,
``actormesh.actor.unhandled_fault_hook``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _messages as M
from ._actor import MeshFailure

log = logging.getLogger("actormesh.supervision")

__all__ = ["MeshRecord", "RestartPolicy", "install", "default_fault_hook", "stop_owned", "CLIENT_NAME"]

CLIENT_NAME = "client"


@dataclass
class MeshRecord:
    """What the owner knows of one actor mesh it spawned."""

    name: str
    owner: str
    addresses: Sequence[str]
    display: str
    failed: dict[int, str] = field(default_factory=dict)
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


def default_fault_hook(failure: MeshFailure) -> None:
    """Report an unhandled failure to stderr and end the program with an error.

    Like Monarch, the main thread receives KeyboardInterrupt; the process exits 1.
    """
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    sys.stderr.write(
        f"Unhandled actormesh error on the root actor, hostname={socket.gethostname()}, PID={os.getpid()} at time {stamp}:\n"
        f"{failure.report()}\n"
    )
    sys.stderr.flush()
    import signal

    _fatal.set()
    # A real signal aimed at the main thread wakes it even when it is blocked in
    # Future.get(); Python turns it into KeyboardInterrupt there.
    try:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
    except (OSError, ValueError, AttributeError):
        import _thread

        _thread.interrupt_main()


_fatal = threading.Event()


def _call_fault_hook(failure: MeshFailure) -> None:
    facade = sys.modules.get("actormesh.actor")
    hook = getattr(facade, "unhandled_fault_hook", None) or default_fault_hook
    try:
        hook(failure)
    except BaseException:
        log.exception("unhandled_fault_hook raised for %r", failure)


def stop_owned(runtime: Any, owner: str, reason: str) -> None:
    """Stop every actor mesh and proc spawned by ``owner`` and wait (bounded).

    A mesh cannot outlive its owner: this runs before the owner's ``__cleanup__``.
    Runs on the owner's own thread, never on the loop thread.
    """
    from ._ports import GatherPort
    from ._spawn import stop_children

    futures = []
    for record in list(runtime.owned_meshes.values()):
        if record.owner != owner or record.stopped is not None:
            continue
        record.stopped = reason
        port = GatherPort(runtime, f"{record.name}.stop", record.addresses, lambda values: None)
        for i, addr in enumerate(record.addresses):
            runtime.send(addr, (M.STOP_ACTOR, record.name, (runtime.address, port.port_id), i))
        futures.append(port.future)
    children = [c for c in getattr(runtime, "children", {}).values() if c.owner == owner]
    if children:
        futures.append(stop_children(runtime, children, runtime.config.stop_timeout))
    deadline = time.monotonic() + runtime.config.stop_timeout
    for fut in futures:
        try:
            fut.get(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:
            pass


def install(runtime: Any) -> None:
    """Attach owner-side supervision to a runtime."""
    runtime.owned_meshes = {}

    def try_restart(record: MeshRecord, rank: int, cause: str) -> bool:
        policy = record.restart
        if policy is None or record.respawn is None:
            return False
        now = time.monotonic()
        record.restart_times[:] = [t for t in record.restart_times if now - t < policy.within_s]
        if len(record.restart_times) >= policy.max_restarts:
            log.warning("%s failed again: %d restarts within %.0fs, escalating", record.member(rank), policy.max_restarts, policy.within_s)
            return False
        record.restart_times.append(now)
        log.warning("restarting %s after: %s", record.member(rank), cause.splitlines()[-1] if cause else cause)
        try:
            record.respawn(rank)
        except Exception:
            log.exception("restart of %s failed", record.member(rank))
            return False
        return True

    def deliver(record: MeshRecord, rank: int, cause: str, actor: str, source: str | None = None) -> None:
        if rank in record.reported or record.stopped is not None:
            return
        if source is not None and rank < len(record.addresses) and record.addresses[rank] != source:
            return  # a report about an earlier incarnation of a restarted member
        if try_restart(record, rank, cause):
            return
        record.reported.add(rank)
        record.failed.setdefault(rank, cause)
        failure = MeshFailure(mesh_name=record.name, crashed_ranks=[rank], cause=cause, actor=actor)
        if record.owner == CLIENT_NAME:
            # Off the loop thread: a user hook may block or call back into meshes.
            threading.Thread(target=_call_fault_hook, args=(failure,), name="actormesh-fault-hook", daemon=True).start()
            return
        cell = runtime.actors.get(record.owner)
        if cell is not None:
            cell.supervise(failure)

    def on_failure(env: tuple[Any, ...]) -> None:
        _, owner, mesh_name, rank, cause, display, source = env
        record = runtime.owned_meshes.get(mesh_name)
        if record is None:
            log.warning("failure of unknown mesh %s rank %s: %s", mesh_name, rank, cause)
            return
        deliver(record, rank, cause, display, source)

    def on_peer_lost(address: str, reason: str) -> None:
        for record in list(runtime.owned_meshes.values()):
            for rank, addr in enumerate(record.addresses):
                if addr == address:
                    deliver(record, rank, reason, record.member(rank), address)

    runtime.on_failure = on_failure
    runtime.on_peer_lost.append(on_peer_lost)
    runtime.reply_kinds = M
