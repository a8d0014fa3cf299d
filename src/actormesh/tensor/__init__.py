"""Tensor engine: torch code on the controller runs on every proc of a mesh.

``with procs.activate():`` records each torch op as a command for the mesh and
returns a distributed :class:`Tensor` at once; ``fetch_shard``/``inspect``
bring a shard back. This is the only layer that imports torch.
"""

from ._activate import activate, get_active_mesh, no_mesh
from ._fetch import fetch_shard, inspect, show
from ._process_group import RemoteProcessGroup
from ._ranks import rank_tensor
from ._coalescing import coalescing
from ._grad import grad_function, grad_generator
from ._opaque import OpaqueRef
from ._reduce import MeshSliceTensor, reduce, reduce_, slice_mesh, to_mesh
from ._remote import Remote, call_on_shard_and_fetch, remote
from ._selection import NDSlice, Selection
from ._stream import Borrow, Stream, get_active_stream
from ._tensor import Tensor
from ._mesh_engine import MESH_ENGINE
from ..mesh import use_tensor_engine as _use_tensor_engine

_use_tensor_engine(MESH_ENGINE)  # procs.activate() and friends reach this layer through it

__all__ = ["activate", "get_active_mesh", "no_mesh", "fetch_shard", "inspect", "show", "rank_tensor", "Tensor", "RemoteProcessGroup",
           "reduce", "reduce_", "slice_mesh", "to_mesh", "MeshSliceTensor", "remote", "Remote", "call_on_shard_and_fetch",
           "Stream", "Borrow", "get_active_stream", "grad_generator", "grad_function",
           "coalescing", "OpaqueRef", "NDSlice", "Selection", "MESH_ENGINE"]
