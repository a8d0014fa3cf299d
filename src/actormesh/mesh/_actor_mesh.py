"""ActorMesh: a view over the actors one ``spawn`` created, one per proc."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from ..errors import Cause, CauseKind, SupervisionError, supervision_error
from ..runtime import EndpointProperty, Future, MeshRecord, RestartPolicy, current_runtime, stop_mesh
from ._endpoint import Endpoint, NotAnEndpoint
from ._shape import Extent, MeshTrait, Point, Shape

__all__ = ["ActorMesh", "RESERVED_NAMES"]

T = TypeVar("T")


class ActorMesh(MeshTrait, Generic[T]):
    """The actors of one spawn. Endpoints are attributes: ``mesh.method.call(...)``.

    Slicing (``mesh.slice(gpus=0)``) gives a view that casts only to those
    members. A mesh is picklable: a copy received elsewhere is a reference that
    can be called (its owner stays the spawner).
    """

    def __init__(self, cls: type, name: str, mesh_name: str, addresses: list[str], shape: Shape, display: str, spawn_extent: Extent, record: MeshRecord | None = None, initialized: Future[Any] | None = None) -> None:
        self._class = cls
        self._name = name
        self._mesh_name = mesh_name
        self._addresses = addresses
        self.__dict__["_shape"] = shape
        self._display = display  # prefix; see member_display
        self._spawn_extent = spawn_extent
        self._record = record
        self._initialized = initialized

    @staticmethod
    def _runtime() -> Any:
        return current_runtime()

    def _new_with_shape(self, shape: Shape) -> ActorMesh[T]:
        return ActorMesh(self._class, self._name, self._mesh_name, self._addresses, shape, self._display, self._spawn_extent, self._record, self._initialized)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_class", "_shape"):
            raise AttributeError(name)
        attr = getattr(self._class, name, None)
        if isinstance(attr, EndpointProperty):
            ep: Endpoint[..., Any] = Endpoint(self, attr)
            self.__dict__[name] = ep  # next access skips __getattr__
            return ep
        if callable(attr):
            return NotAnEndpoint(self, name)
        raise AttributeError(f"actor mesh of {self._class.__qualname__} has no endpoint {name!r}")

    def _status_error(self, what: str, indices: list[int] | None = None) -> SupervisionError | None:
        """The error a call of ``what`` on these members fails with at once, if the
        owner knows it cannot succeed: MeshStoppedError for a stopped mesh, the
        failed member's error (ActorDiedError, ...) for a failed one; else None."""
        record = self._record
        if record is None:
            record = self._runtime().owned_meshes.get(self._mesh_name)
            if record is None:
                return None
        if record.stopped is not None:
            cause = Cause.of(record.stopped, CauseKind.STOPPED)
            text = f"The actor mesh {self._name} has status: stopped: {record.stopped}"
            return supervision_error(f"Endpoint call {what}() failed, {text}", cause, endpoint=what, actor=self._name)
        failed = record.failed
        if not failed:
            return None
        shape = self._shape
        for i in indices if indices is not None else range(len(shape)):
            g = shape.rank_at(i)
            if g in failed:
                who = member_display(self._display, g, self._spawn_extent)
                text = f"The actor {who} and all its descendants have failed:\n  {failed[g]}"
                return supervision_error(f"Endpoint call {what}() failed, {text}", failed[g], endpoint=what, actor=who, rank=i)
        return None

    def _member(self, rank: int) -> str:
        """Qualified name of the member at spawn rank ``rank`` (for error messages)."""
        return member_display(self._display, rank, self._spawn_extent)

    def restart_policy(self, max_restarts: int = 3, within_s: float = 60.0) -> ActorMesh[T]:
        """Restart failed members automatically (owner only); returns the mesh.

        At most ``max_restarts`` restarts in any ``within_s`` seconds, then the
        failure goes to the owner as usual. Example::

            loaders = procs.spawn("loader", DataLoader).restart_policy(max_restarts=5, within_s=30)
        """
        if self._record is None:
            raise NotImplementedError("restart_policy() is only available on the mesh its spawner holds")
        self._record.restart = RestartPolicy(max_restarts, within_s)
        return self

    @property
    def initialized(self) -> Future[Any]:
        """Completes when every member has run ``__init__`` (owner only).

        Raises the error of the first member (in rank order) whose ``__init__``
        raised, as an ``ActorError`` that is also an instance of the original
        exception's class; the owner's supervision heard of it first.
        """
        if self._initialized is None:
            return Future.completed(None)
        return self._initialized

    def stop(self, reason: str = "stopped by client") -> Future[None]:
        """Stop every actor of the mesh (``__cleanup__`` runs); later calls fail at once.

        Bounded: completes within ``cleanup_timeout`` + ``STOP_MARGIN_S`` (1 s).
        A member still busy then (an endpoint that never returns, a ``__cleanup__``
        that hangs) has its proc killed; that is logged as the stop's outcome and
        is not a failure (no supervision event). See docs/supervision.md, "Deadlines".
        """
        record = self._record
        if record is None:
            raise NotImplementedError("stop() is only available on the mesh its spawner holds, not on a reference")
        if record.stopped is not None:
            return Future.completed(None)
        return stop_mesh(self._runtime(), record, reason)

    async def __aenter__(self) -> ActorMesh[T]:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._record is not None:
            await self.stop()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self._class, self._name, self._mesh_name, self._addresses, self._shape, self._display, self._spawn_extent))

    def __len__(self) -> int:
        return len(self._shape)

    def __repr__(self) -> str:
        return f"<ActorMesh {self._name} of {self._class.__qualname__} {self._shape.extent}>"


def _rebuild(cls: type, name: str, mesh_name: str, addresses: list[str], shape: Shape, display: str, extent: Extent) -> ActorMesh[Any]:
    return ActorMesh(cls, name, mesh_name, addresses, shape, display, extent)


def member_display(prefix: str, rank: int, extent: Extent) -> str:
    """Monarch's qualified name of one member: ``<root>.<mod.Cls name{'gpus': 0/2}>``."""
    return f"{prefix}{Point(rank, extent) if len(extent) else ''}>"


# Endpoint names that would shadow mesh attributes are refused at spawn.
RESERVED_NAMES = frozenset(
    n for n in set(dir(ActorMesh)) | {"initialized", "stop", "slice", "split", "flatten", "rename", "size", "sizes", "extent"} if not n.startswith("_")
)
