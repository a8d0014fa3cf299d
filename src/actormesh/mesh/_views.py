"""What the layers above need to build on meshes without reaching into them:
the whole mesh behind a view, a view's shape, a view over another shape, and
hooks that run before any endpoint message is cast (the tensor engine flushes
queued tensor commands there, so actor messages keep the order the controller
issued them in)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from ..runtime import CastPlan
from ._shape import Shape

__all__ = ["root_view", "shape_of", "with_shape", "mesh_key", "addresses_of", "cast_plan", "add_cast_hook", "remove_cast_hook",
           "run_cast_hooks"]

#: Views whose cast plan was made, most recently used last (bounded: views are made freely).
_PLANS: OrderedDict[tuple[str, Shape, int], CastPlan] = OrderedDict()
_MAX_PLANS = 256

M = TypeVar("M")

#: Called with the actor mesh (view) about to receive a message, in the caller's thread.
_cast_hooks: list[Callable[[Any], None]] = []


def root_view(mesh: Any) -> Any:
    """The whole proc (or actor) mesh ``mesh`` is a view of, as one dim ``rank``
    over every proc in spawn order: ``root_view(procs.slice(gpus=1))``."""
    n = len(mesh._addresses)
    return mesh._new_with_shape(Shape.row_major(("rank",), (n,)))


def shape_of(mesh: Any) -> Shape:
    """The :class:`Shape` of a mesh view: labels, sizes and the root rank of each point."""
    return mesh._shape


def with_shape(mesh: M, shape: Shape) -> M:
    """A view of ``mesh``'s root over ``shape`` (ranks index the root, as ``shape_of`` gives them)."""
    return mesh._new_with_shape(shape)  # type: ignore[attr-defined]


def addresses_of(mesh: Any) -> list[str]:
    """The proc address of each point of a mesh view, in row-major order."""
    shape, addrs = mesh._shape, mesh._addresses
    return [addrs[shape.rank_at(i)] for i in range(len(shape))]


def cast_plan(mesh: Any, fanout: int) -> CastPlan:
    """The cast tree of an actor mesh view, made once per view (not per cast): casting
    then costs the sender no work per member. Keyed by mesh name and shape, so
    views made anew (``mesh.slice(...)`` each time) share it; a mesh's addresses never change."""
    key = (mesh._mesh_name, mesh._shape, fanout)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = CastPlan(addresses_of(mesh), fanout)
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    elif len(_PLANS) > 1:
        try:
            _PLANS.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile
            pass
    return plan


def mesh_key(mesh: Any) -> str:
    """A name shared by a mesh and all its views, unique in this job."""
    actor_mesh = getattr(mesh, "_mesh_name", None)
    if actor_mesh is not None:
        return actor_mesh
    # proc mesh names repeat ("anon"); a proc belongs to one spawn, so its first proc tells them apart
    return f"{mesh._name}@{mesh._addresses[0]}" if mesh._addresses else mesh._name


def add_cast_hook(hook: Callable[[Any], None]) -> None:
    """Run ``hook(actor_mesh)`` before every endpoint message is encoded and sent."""
    if hook not in _cast_hooks:
        _cast_hooks.append(hook)


def remove_cast_hook(hook: Callable[[Any], None]) -> None:
    """Undo :func:`add_cast_hook` (absent hooks are ignored)."""
    if hook in _cast_hooks:
        _cast_hooks.remove(hook)


def run_cast_hooks(mesh: Any) -> None:
    for hook in _cast_hooks:
        hook(mesh)
