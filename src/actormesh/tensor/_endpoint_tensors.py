"""Actor endpoints whose per-proc return becomes a distributed tensor:
``actors.method.rref(*args)`` and ``as_endpoint(actors.method, propagate=fn).rref(*args)``.

The call is one tensor-engine command (kind 11): each proc's engine calls its
own member of the actor mesh at that point of the command stream and stores
what it returns, so it is ordered with the tensor ops around it. Distributed
tensor arguments reach the actor as that proc's shard (the engine's own tensor:
in-place changes are seen by later ops). The output shapes come from the
endpoint's ``propagate`` (a callable given fake tensors, as in Monarch; with
``"inspect"`` the endpoint returns no tensors and ``rref`` returns None).

The engine waits for the actor's answer: a later *direct* call to the same
actor that was issued after the rref is not ordered after it (it may run first).
"""

from __future__ import annotations

from typing import Any

from ..mesh import shape_of
from ._remote import make_outputs, scan_args, spec_from_fake
from ._tensor import _where

__all__ = ["endpoint_rref"]


def endpoint_rref(actors: Any, prop: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Record ``actors.<prop>(*args, **kwargs)`` as a tensor command; distributed results."""
    name = getattr(prop, "name", "?")
    what = f"endpoint {name}.rref()"
    prop.bind_check(args, kwargs)
    propagate = getattr(prop, "propagate", None)
    if propagate in (None, "cached"):
        raise NotImplementedError(
            f"{what}: an actor endpoint has no cached propagation (the controller cannot run the actor); "
            f"declare its result with @endpoint(propagate=fn) or as_endpoint(actors.{name}, propagate=fn), "
            "where fn maps fake arguments to fake results, or propagate='inspect' if it returns no tensors")
    if propagate == "mocked":
        raise NotImplementedError(f"{what}: propagate='mocked' is not supported (nor by Monarch); give propagate=fn")
    call = scan_args(what, args, kwargs)
    view = call.view
    mine, theirs = shape_of(actors), view.shape
    if (mine.labels, mine.sizes) != (theirs.labels, theirs.sizes):
        raise ValueError(f"{what}: the actor mesh {dict(zip(mine.labels, mine.sizes))} and the tensor mesh "
                         f"{dict(zip(theirs.labels, theirs.sizes))} differ; spawn the actors on the active proc mesh "
                         "(procs.spawn(...)) and activate that mesh")
    mutated: list[Any]
    if propagate == "inspect":
        spec, mutated = None, []
    else:
        spec, mutated = spec_from_fake(propagate, call, args, kwargs)
    result, outs, checks = make_outputs(spec, view)
    muts = tuple(call.tensors[i]._ref.id for i in mutated)
    view.client.record((11, actors, name, call.args, call.kwargs, outs, checks, muts, view.sid, _where()))
    return result
