"""Typed seams through which the runtime reaches the mesh layer without importing it.

The mesh layer installs these at import (``actormesh.mesh`` does it); a process
that has not imported it gets a clear error instead of an ImportError cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _missing(*_: Any, **__: Any) -> Any:
    raise RuntimeError("the actormesh.mesh layer is not loaded in this process; import actormesh.actor first")


#: ``proc_mesh_for(runtime) -> ProcMesh`` of that one process
proc_mesh_for: Callable[..., Any] = _missing
#: ``on_mesh_failure(runtime, failure) -> None``: record a failed rank on owned mesh state
on_mesh_failure: Callable[..., Any] = lambda *a, **k: None
#: ``on_runtime(runtime) -> None``: called once a process's runtime exists
on_runtime: Callable[..., Any] = lambda *a, **k: None
