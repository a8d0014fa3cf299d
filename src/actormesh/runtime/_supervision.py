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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _messages as M
from ._actor import MeshFailure
from ._triage import Action, Decision, FailureTriage, MeshRecord, RestartPolicy

if TYPE_CHECKING:
    from ._proc import ProcRuntime

log = logging.getLogger("actormesh.supervision")

__all__ = ["MeshRecord", "RestartPolicy", "install", "default_fault_hook", "fault_hook", "set_fault_hook", "stop_owned", "stop_mesh",
           "CLIENT_NAME", "STOP_MARGIN_S"]

CLIENT_NAME = "client"

#: Seconds an owner waits past ``cleanup_timeout`` for a stopping member before it kills the proc.
STOP_MARGIN_S = 1.0


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


_fault_hook: Callable[[MeshFailure], Any] | None = None


def fault_hook() -> Callable[[MeshFailure], Any]:
    """The hook a client's unhandled failures go to (``actormesh.actor.unhandled_fault_hook``)."""
    return _fault_hook or default_fault_hook


def set_fault_hook(hook: Callable[[MeshFailure], Any] | None) -> None:
    """Replace the hook (None: the default, which reports and ends the program)."""
    global _fault_hook
    if hook is not None and not callable(hook):
        raise TypeError(f"unhandled_fault_hook must be a callable taking a MeshFailure (or None), got {hook!r}")
    _fault_hook = hook


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

    def __init__(self, runtime: ProcRuntime, record: MeshRecord, timeout_s: float) -> None:
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

    def deliver(self, env: M.Reply, payload: Any) -> None:
        self._tick([env.slot])

    def deliver_many(self, env: M.ReplyMulti, payload: Any) -> None:
        self._tick([index for index, _, _ in env.entries])

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


def kill_proc(runtime: ProcRuntime, address: str) -> None:
    """End the proc at ``address`` on purpose (its loss reaches no supervision hook).

    A proc this process spawned is SIGKILLed; any other is told to stop (it
    exits within ``cleanup_timeout`` + ``STOP_MARGIN_S``, see ``worker.py``).
    """
    if address == runtime.address:
        log.error("an actor of this very process (%s) did not stop in time; it cannot kill itself", address)
        return
    child = runtime.children.get(address)
    if child is not None and child.popen is not None:
        child.stopping = True  # its exit is reported as "the proc was stopped", not a failure
        try:
            child.popen.kill()
        except OSError:
            pass
        return
    runtime.expect_gone(address)
    runtime.stop_proc(address)


def stop_mesh(runtime: ProcRuntime, record: MeshRecord, reason: str) -> Any:
    """Stop every member of an owned actor mesh; the Future completes within
    ``cleanup_timeout`` + ``STOP_MARGIN_S`` (members still running then have
    their procs killed). Any thread."""
    from ..config import get_config

    record.stopped = reason
    waiter = _StopWaiter(runtime, record, get_config().cleanup_timeout + STOP_MARGIN_S)
    reply = (runtime.address, waiter.port_id)
    for i, addr in enumerate(waiter.addresses):
        runtime.stop_actor(addr, record.name, reply, i)

    def arm() -> None:
        runtime.loop.call_later(waiter.timeout_s, waiter.expire)

    if runtime.in_loop():
        arm()
    else:
        runtime.loop.call_soon_threadsafe(arm)
    return waiter.future


def stop_owned(runtime: ProcRuntime, owner: str, reason: str) -> None:
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
    children = [c for c in runtime.children.values() if c.owner == owner]
    if children:
        futures.append(stop_children(runtime, children, runtime.config.stop_timeout))
    deadline = time.monotonic() + runtime.config.stop_timeout
    for fut in futures:
        try:
            fut.get(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:
            pass


def install(runtime: ProcRuntime) -> None:
    """Attach owner-side supervision to a runtime: a :class:`FailureTriage`
    decides (loop thread), this shell restarts members and delivers reports."""
    triage = FailureTriage(time.monotonic)

    def act(action: Action) -> None:
        record, rank = action.record, action.rank
        if action.decision is Decision.RESTART:
            log.warning("restarting %s after: %s", record.member(rank), action.cause.splitlines()[-1] if action.cause else action.cause)
            try:
                record.respawn(rank)  # type: ignore[misc]
                return
            except Exception:
                log.exception("restart of %s failed", record.member(rank))
                action = triage.restart_failed(action)
        if action.decision is Decision.REPORT:
            if action.why and record.restart is not None:
                log.warning("%s failed again (%s), escalating", record.member(rank), action.why)
            assert action.failure is not None
            _report(runtime, record, action.failure)

    def on_failure(env: M.Failure) -> None:
        mesh_name, rank, cause = env.mesh_name, env.rank, env.cause
        record = runtime.owned_meshes.get(mesh_name)
        if record is None:
            log.warning("failure of unknown mesh %s rank %s: %s", mesh_name, rank, cause)
            return
        act(triage.on_failure(record, rank, cause, env.source, env.display))

    def on_peer_lost(address: str, reason: str) -> None:
        for action in triage.on_peer_lost(list(runtime.owned_meshes.values()), address, reason):
            act(action)

    runtime.handlers.failure = on_failure
    runtime.handlers.peer_lost.append(on_peer_lost)


def _report(runtime: ProcRuntime, record: MeshRecord, failure: MeshFailure) -> None:
    """Deliver a failure to the mesh's owner (loop thread)."""
    if record.owner == CLIENT_NAME:
        # The hook is chosen now, before any caller's future fails for this cause;
        # it runs off the loop thread: a user hook may block or call back into meshes.
        hook = fault_hook()
        runtime.threads.start(_call_fault_hook, hook, failure, name="actormesh-fault-hook")
        return
    cell = runtime.actors.get(record.owner)
    if cell is not None:
        cell.supervise(failure)
