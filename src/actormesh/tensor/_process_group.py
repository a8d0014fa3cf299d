"""``procs.process_group(dims)``: a torch process group over mesh dims, passed to
remote functions, where each proc receives its own group (the procs sharing its
coordinates on the other dims)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._client import client_for

__all__ = ["RemoteProcessGroup", "GroupToken"]


class GroupToken:
    """What a RemoteProcessGroup becomes in a command; the engine resolves it."""

    __slots__ = ("sid", "dims")

    def __init__(self, sid: int, dims: tuple[str, ...]) -> None:
        self.sid, self.dims = sid, dims

    def __reduce__(self) -> tuple[Any, ...]:
        return (GroupToken, (self.sid, self.dims))


class RemoteProcessGroup:
    """A process group over ``dims`` of a proc mesh, for remote functions.

    >>> pg = procs.process_group("gpu")                    # doctest: +SKIP
    >>> @actormesh.remote
    ... def allsum(t, pg):
    ...     torch.distributed.all_reduce(t, group=pg)
    ...     return t
    """

    def __init__(self, procs: Any, dims: str | Sequence[str]) -> None:
        from ._reduce import _ensure_groups

        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        labels = tuple(procs.sizes)
        for d in dims:
            if d not in labels:
                raise KeyError(f"dim {d!r} not found in mesh {dict(procs.sizes)}")
        if not dims or len(set(dims)) != len(dims):
            raise ValueError(f"process_group needs distinct dims of the mesh, got {dims}")
        client = client_for(procs)
        self.view = client.view(procs)
        self.dims = dims
        self.dropped = False
        _ensure_groups(client)

    def size(self) -> int:
        """Procs per group."""
        n = 1
        for d in self.dims:
            n *= self.view.procs.size(d)
        return n

    def __reduce__(self) -> tuple[Any, ...]:
        return (GroupToken, (self.view.sid, self.dims))

    def __repr__(self) -> str:
        return f"RemoteProcessGroup(dims={self.dims}, mesh={dict(self.view.procs.sizes)})"
