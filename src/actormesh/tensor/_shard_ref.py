"""A distributed tensor inside an actor message: each member receives its own
proc's shard, as a plain ``torch.Tensor``, once the tensor commands issued
before the message have run there."""

from __future__ import annotations

from typing import Any

__all__ = ["shard_ref_for", "local_shard"]

#: An actor message waits at most this long for the engine to catch up with it.
WAIT_S = 600.0
#: ... and this long for the engine to exist on its proc (spawned with the first activate()).
SPAWN_WAIT_S = 30.0


def shard_ref_for(t: Any) -> tuple[Any, ...]:
    view = t._view
    if t.__dict__.get("_dropped"):
        raise TypeError("DROPPED: a tensor deleted with t.drop() cannot be sent to an actor")
    seq = view.client.flush()
    return (local_shard, (view.client.key, t._ref.id, seq))


def local_shard(key: str, ref: int, seq: int) -> Any:
    """Unpickled on the receiving proc (in the actor's thread)."""
    from ._engine import Failed, engine_for

    engine = engine_for(key, SPAWN_WAIT_S)
    if engine is None:
        raise RuntimeError(f"a distributed tensor of mesh {key} was sent to an actor on a proc outside that mesh; "
                           "send it to actors spawned on the tensor's own procs, or move it with t.to_mesh()")
    if engine.done < seq:
        engine.wait_for(seq, WAIT_S)
    value = engine.table.get(ref)
    if value is None:
        raise RuntimeError(f"tensor ref {ref} is not defined on rank {engine.rank}: the tensor's mesh does not include this proc")
    if type(value) is Failed:
        raise value.as_exception()
    return value
