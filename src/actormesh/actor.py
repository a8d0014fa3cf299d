"""The public actor API, source-compatible with ``monarch.actor``.

Replace ``from monarch.actor import ...`` with ``from actormesh.actor import ...``.
This module only re-exports; the implementation lives in the layers below.

Example::

    from actormesh.actor import Actor, endpoint, this_host

    class Counter(Actor):
        def __init__(self, start: int):
            self.n = start

        @endpoint
        def incr(self) -> int:
            self.n += 1
            return self.n

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    counters = procs.spawn("counters", Counter, 0)
    print(counters.incr.call().get())
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

from . import config
from .debug import debug_controller
from .errors import ActorDiedError, ActorError, ActorUnreachableError, Cause, CauseKind, MeshStoppedError, SupervisionError
from .job import attach, attach_to_workers, hosts_from_config, run_worker_loop_forever, run_worker_loop_until_shutdown, start_worker_loop_forever
from .mesh import (
    Accumulator,
    ActorMesh,
    BootstrapCommand,
    Endpoint,
    Extent,
    HostMesh,
    Point,
    ProcMesh,
    ValueMesh,
    as_endpoint,
    concurrent_endpoint,
    endpoint,
    default_bootstrap_cmd,
    get_or_spawn_controller,
    send,
    this_host,
    this_proc,
)
from .runtime import (
    Actor,
    Channel,
    ChannelTransport,
    Context,
    Future,
    Instance,
    MeshFailure,
    Port,
    PortReceiver,
    ProcId,
    Uid,
    context,
    current_actor_name,
    default_fault_hook,
    enable_transport,
    fault_hook,
    returns_future,
    set_fault_hook,
    shutdown_context,
)
from .telemetry import get_meter, span, traced
from ._standins import install as _install_standins

_install_standins()  # procs.activate() and dashboard_port work without importing those layers

__all__ = [
    "Accumulator",
    "Actor",
    "ActorError",
    "ActorMesh",
    "BootstrapCommand",
    "Channel",
    "ChannelTransport",
    "Context",
    "Endpoint",
    "Extent",
    "Future",
    "HostMesh",
    "Instance",
    "MeshFailure",
    "Point",
    "Port",
    "PortReceiver",
    "ProcId",
    "ProcMesh",
    "SupervisionError",
    "ActorDiedError",
    "ActorUnreachableError",
    "MeshStoppedError",
    "Cause",
    "CauseKind",
    "Uid",
    "ValueMesh",
    "as_endpoint",
    "attach",
    "attach_to_workers",
    "hosts_from_config",
    "run_worker_loop_forever",
    "run_worker_loop_until_shutdown",
    "start_worker_loop_forever",
    "default_bootstrap_cmd",
    "returns_future",
    "concurrent_endpoint",
    "config",
    "context",
    "current_actor_name",
    "current_rank",
    "current_size",
    "debug_controller",
    "enable_transport",
    "endpoint",
    "get_meter",
    "get_or_spawn_controller",
    "send",
    "shutdown_context",
    "span",
    "this_host",
    "this_proc",
    "traced",
    "unhandled_fault_hook",
]


def current_rank() -> Point:
    """The current actor's point in the slice the current message was sent to."""
    return context().message_rank


def current_size() -> dict[str, int]:
    """Sizes of the slice the current message was sent to."""
    return dict(context().message_rank.extent)


#: Called (on a runtime thread) with a MeshFailure nobody handled. Replace it to
#: decide yourself; the default prints the report and ends the program. Reading
#: and assigning it goes to the runtime (see ``_Facade``), which calls it.
unhandled_fault_hook: Callable[[MeshFailure], Any]


class _Facade(types.ModuleType):
    """This module's type: ``unhandled_fault_hook`` reads and sets the runtime's hook.

    Why: Monarch programs assign ``monarch.actor.unhandled_fault_hook = fn``; a
    plain module attribute could only be found by the runtime looking this
    module up, a layer above it.
    """

    @property
    def unhandled_fault_hook(self) -> Callable[[MeshFailure], Any]:
        return fault_hook()

    @unhandled_fault_hook.setter
    def unhandled_fault_hook(self, hook: Callable[[MeshFailure], Any] | None) -> None:
        set_fault_hook(None if hook is default_fault_hook else hook)


sys.modules[__name__].__class__ = _Facade
