"""Owner-side supervision: turning failures into ``__supervise__`` calls.

Every mesh has one owner (the actor or client that spawned it). The owner's
process keeps a record per owned actor mesh; a failure of a rank, reported by
the failed actor itself (``FAILURE``) or noticed as a lost process, marks the
rank failed in the record (later calls fail at once) and is delivered once per
failed rank to the owner: an actor's ``__supervise__`` or, at the client,
``actormesh.actor.unhandled_fault_hook``.

Order: the owner hears first. A lost process reaches :func:`install`'s hook
before any caller's future fails for it (``ProcRuntime.peer_gone``), and the
fault hook is chosen when the failure is delivered, so a program that swaps
``unhandled_fault_hook`` around a call and restores it after seeing the error
gets the failure in the hook it installed.

Stopping a mesh (:func:`stop_mesh`) is bounded: members have
``cleanup_timeout`` to stop, the owner waits ``STOP_MARGIN_S`` more, then
kills the procs of those that did not (an expected exit, not a failure).
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

__all__ = ["MeshRecord", "RestartPolicy", "install", "default_fault_hook", "stop_owned", "stop_mesh", "CLIENT_NAME", "STOP_MARGIN_S"]

CLIENT_NAME = "client"

#: Seconds an owner waits past ``cleanup_timeout`` for a stopping member before it kills the proc.
STOP_MARGIN_S = 1.0


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


def _current_fault_hook() -> Callable[[MeshFailure], None]:
    facade = sys.modules.get("actormesh.actor")
    return getattr(facade, "unhandled_fault_hook", None) or default_fault_hook


def _call_fault_hook(hook: Callable[[MeshFailure], None], failure: MeshFailure) -> None:
    try:
        hook(failure)
    except BaseException:
        log.exception("unhandled_fault_hook raised for %r", failure)


class _StopWaiter:
    """Owner side of stopping one actor mesh: one reply per member, or a deadline.

    Replies (OK, or SUPERVISION for a member already gone) and lost peers tick
    members off. At the deadline (loop thread) the procs of members that have not
    stopped are killed and the future completes: a stop never waits longer.
    """

    def __init__(self, runtime: Any, record: MeshRecord, timeout_s: float) -> None:
        from ._future import Future

        self.runtime = runtime
        self.record = record
        self.addresses = list(record.addresses)
        self.pending = set(range(len(self.addresses)))
        self.future: Any = Future._create()
        self._lock = threading.Lock()
        self._finished = False
        self.timeout_s = timeout_s
        self.port_id = runtime.register_port(self)
        for addr in set(self.addresses):
            runtime.await_peer(addr, self)
        if not self.pending:
            self._finish()

    def deliver(self, env: tuple[Any, ...], payload: Any) -> None:
        self._tick([env[2]])

    def deliver_many(self, env: tuple[Any, ...], payload: Any) -> None:
        self._tick([index for index, _, _ in env[2]])

    def peer_lost(self, address: str, reason: str) -> None:
        self._tick([i for i, a in enumerate(self.addresses) if a == address])

    def _tick(self, indices: list[int]) -> None:
        with self._lock:
            self.pending.difference_update(indices)
            last = not self.pending and not self._finished
        if last:
            self._finish()

    def expire(self) -> None:
        """The deadline passed (loop thread): kill the procs of members still stopping."""
        with self._lock:
            late = sorted(self.pending)
        if not late or self._finished:
            return
        killed = []
        for addr in sorted({self.addresses[i] for i in late}):
            who = ", ".join(self.record.member(i) for i in late if self.addresses[i] == addr)
            log.warning("%s did not stop within %.1fs (cleanup_timeout + %.1fs); killing its proc %s", who, self.timeout_s - STOP_MARGIN_S, STOP_MARGIN_S, addr)
            kill_proc(self.runtime, addr)
            killed.append(who)
        # The stop's outcome, in what later calls on the mesh are told.
        self.record.stopped = f"{self.record.stopped} ({'; '.join(killed)}: did not stop within {self.timeout_s:.1f}s, proc killed)"
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
        self.runtime.unregister_port(self.port_id)
        for addr in set(self.addresses):
            self.runtime.unawait_peer(addr, self)
        self.future._set_result(None)


def kill_proc(runtime: Any, address: str) -> None:
    """End the proc at ``address`` on purpose (its loss reaches no supervision hook).

    A proc this process spawned is SIGKILLed; any other is told to stop (it
    exits within ``cleanup_timeout`` + ``STOP_MARGIN_S``, see ``worker.py``).
    """
    if address == runtime.address:
        log.error("an actor of this very process (%s) did not stop in time; it cannot kill itself", address)
        return
    child = getattr(runtime, "children", {}).get(address)
    if child is not None and child.popen is not None:
        child.stopping = True  # its exit is reported as "the proc was stopped", not a failure
        try:
            child.popen.kill()
        except OSError:
            pass
        return
    runtime.expect_gone(address)
    runtime.send(address, (M.STOP_PROC, None))


def stop_mesh(runtime: Any, record: MeshRecord, reason: str) -> Any:
    """Stop every member of an owned actor mesh; the Future completes within
    ``cleanup_timeout`` + ``STOP_MARGIN_S`` (members still running then have
    their procs killed). Any thread."""
    from ..config import get_config

    record.stopped = reason
    waiter = _StopWaiter(runtime, record, get_config().cleanup_timeout + STOP_MARGIN_S)
    reply = (runtime.address, waiter.port_id)
    for i, addr in enumerate(waiter.addresses):
        runtime.send(addr, (M.STOP_ACTOR, record.name, reply, i))

    def arm() -> None:
        runtime.loop.call_later(waiter.timeout_s, waiter.expire)

    if runtime.in_loop():
        arm()
    else:
        runtime.loop.call_soon_threadsafe(arm)
    return waiter.future


def stop_owned(runtime: Any, owner: str, reason: str) -> None:
    """Stop every actor mesh and proc spawned by ``owner`` and wait (bounded).

    A mesh cannot outlive its owner: this runs before the owner's ``__cleanup__``.
    Runs on the owner's own thread, never on the loop thread.
    """
    from ._spawn import stop_children

    futures = []
    for record in list(runtime.owned_meshes.values()):
        if record.owner != owner or record.stopped is not None:
            continue
        futures.append(stop_mesh(runtime, record, reason))
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
            # The hook is chosen now, before any caller's future fails for this cause;
            # it runs off the loop thread: a user hook may block or call back into meshes.
            hook = _current_fault_hook()
            threading.Thread(target=_call_fault_hook, args=(hook, failure), name="actormesh-fault-hook", daemon=True).start()
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
