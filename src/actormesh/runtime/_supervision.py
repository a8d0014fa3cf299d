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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _messages as M
from ._actor import MeshFailure

log = logging.getLogger("actormesh.supervision")

__all__ = ["MeshRecord", "install", "default_fault_hook", "CLIENT_NAME"]

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
    import _thread

    _fatal.set()
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
        for addr in record.addresses:
            runtime.send(addr, (M.STOP_ACTOR, record.name, (runtime.address, port.port_id)))
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

    def deliver(record: MeshRecord, rank: int, cause: str, actor: str) -> None:
        if rank in record.reported or record.stopped is not None:
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
        _, owner, mesh_name, rank, cause, display = env
        record = runtime.owned_meshes.get(mesh_name)
        if record is None:
            log.warning("failure of unknown mesh %s rank %s: %s", mesh_name, rank, cause)
            return
        deliver(record, rank, cause, display)

    def on_peer_lost(address: str, reason: str) -> None:
        for record in list(runtime.owned_meshes.values()):
            for rank, addr in enumerate(record.addresses):
                if addr == address:
                    deliver(record, rank, reason, f"{record.display}{{rank {rank}}}")

    runtime.on_failure = on_failure
    runtime.on_peer_lost.append(on_peer_lost)
    runtime.reply_kinds = M
