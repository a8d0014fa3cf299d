"""Runtime layer: one process's actors, mailboxes, ports, futures, supervision and
child procs. Knows nothing of meshes; the mesh layer builds on what is exported here."""

from . import _launch as launch
from . import _messages as messages
from ._actor import (
    Actor,
    Context,
    EndpointProperty,
    Instance,
    MeshFailure,
    check_actor_class,
    concurrent_endpoint,
    endpoint,
    endpoints_of,
    ProcView,
    use_proc_view,
)
from ._attached import attach_gateway
from ._cast import CastPlan
from ._channel import Channel, Port, PortReceiver
from ._context import context, current_actor_name, current_runtime, enable_transport, runtime_started, set_runtime, shutdown_context
from ._future import Future, Promise, gather, when_done
from ._gateway import serve_gateway
from ._ids import ChannelTransport, ProcId, Uid
from ._returns_future import returns_future
from ._ports import GatherPort, OnePort, QueuePort, StreamPort, pick_random
from ._handlers import Handlers
from ._proc import ProcRuntime
from ._selfwait import mark_if_self_call
from ._spawn import ChildProc, kill_all_children, spawn_children, stop_children
from ._stats import DashboardStarter, gather_stats, serve_telemetry, stats_snapshot, telemetry_wanted, use_dashboard
from ._supervision import (CLIENT_NAME, STOP_MARGIN_S, MeshRecord, RestartPolicy, default_fault_hook, fault_hook, kill_proc,
                           set_fault_hook, stop_mesh)

__all__ = [
    "messages",
    "launch",
    "Actor",
    "Context",
    "EndpointProperty",
    "Instance",
    "MeshFailure",
    "check_actor_class",
    "concurrent_endpoint",
    "endpoint",
    "endpoints_of",
    "ProcView",
    "use_proc_view",
    "Channel",
    "Port",
    "PortReceiver",
    "context",
    "current_actor_name",
    "current_runtime",
    "runtime_started",
    "set_runtime",
    "enable_transport",
    "attach_gateway",
    "serve_gateway",
    "shutdown_context",
    "Future",
    "Promise",
    "gather",
    "when_done",
    "ChannelTransport",
    "ProcId",
    "Uid",
    "returns_future",
    "GatherPort",
    "CastPlan",
    "OnePort",
    "QueuePort",
    "StreamPort",
    "pick_random",
    "Handlers",
    "ProcRuntime",
    "mark_if_self_call",
    "ChildProc",
    "gather_stats",
    "stats_snapshot",
    "telemetry_wanted",
    "serve_telemetry",
    "DashboardStarter",
    "use_dashboard",
    "spawn_children",
    "kill_all_children",
    "stop_children",
    "CLIENT_NAME",
    "MeshRecord",
    "RestartPolicy",
    "default_fault_hook",
    "fault_hook",
    "set_fault_hook",
    "kill_proc",
    "stop_mesh",
    "STOP_MARGIN_S",
]
