"""Mesh layer: shapes, value meshes, proc/host/actor meshes and endpoint adverbs."""

from ._actor_mesh import ActorMesh
from ._endpoint import Accumulator, Endpoint, NotAnEndpoint, as_endpoint, send
from ._bootstrap import BootstrapCommand, default_bootstrap_cmd
from ._host_agent import serve_agent, shutdown_requested
from ._logs import add_log_tap, remove_log_tap
from ._host_mesh import HostMesh, this_host
from ._proc_mesh import ProcMesh, proc_mesh_for, release_hosts, this_proc
from ._singleton import get_or_spawn_controller
from ._shape import Extent, MeshTrait, Point, Shape
from ._tensor_methods import TensorEngineAPI, tensor_engine, use_tensor_engine
from ._value_mesh import ValueMesh
from ._typed import EndpointProperty, concurrent_endpoint, endpoint
from ._workspace import WorkspaceSync
from ._workspace_store import WORKSPACE_ENV
from ._views import add_cast_hook, addresses_of, mesh_key, remove_cast_hook, root_view, shape_of, with_shape

__all__ = [
    "ActorMesh",
    "Accumulator",
    "Endpoint",
    "NotAnEndpoint",
    "as_endpoint",
    "send",
    "add_log_tap",
    "remove_log_tap",
    "HostMesh",
    "serve_agent",
    "WorkspaceSync",
    "WORKSPACE_ENV",
    "shutdown_requested",
    "BootstrapCommand",
    "default_bootstrap_cmd",
    "ProcMesh",
    "proc_mesh_for",
    "release_hosts",
    "get_or_spawn_controller",
    "this_host",
    "this_proc",
    "Extent",
    "MeshTrait",
    "Point",
    "Shape",
    "ValueMesh",
    "TensorEngineAPI",
    "tensor_engine",
    "use_tensor_engine",
    "EndpointProperty",
    "endpoint",
    "concurrent_endpoint",
    "add_cast_hook",
    "addresses_of",
    "remove_cast_hook",
    "mesh_key",
    "root_view",
    "shape_of",
    "with_shape",
]

