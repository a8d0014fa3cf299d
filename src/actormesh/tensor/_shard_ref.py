"""A distributed tensor inside an actor message: each member receives its own
proc's shard, as a plain ``torch.Tensor``, once the tensor commands issued
before the message have run there.

The handle may die right after the call (``actor.f.call(torch.ones(2))``) and
its delete reach the engine before the actor has read the shard; so the
message pins the shard on the procs it goes to (a PIN command flushed before
it), the actor unpins it once read, and a delete of a pinned shard waits for
the last unpin.
"""

from __future__ import annotations

import itertools
from typing import Any

from ._client import destination

__all__ = ["shard_ref_for", "local_shard"]

PIN = 8
_tokens = itertools.count(1)

#: An actor message waits at most this long for the engine to catch up with it.
WAIT_S = 600.0
#: ... and this long for the engine to exist on its proc (spawned with the first activate()).
SPAWN_WAIT_S = 30.0


def shard_ref_for(t: Any) -> tuple[Any, ...]:
    view = t._view
    if t.__dict__.get("_dropped"):
        raise TypeError("DROPPED: a tensor deleted with t.drop() cannot be sent to an actor")
    client = view.client
    token = 0
    addresses = getattr(destination, "addresses", None)
    if addresses is not None:
        ranks = tuple(sorted({client.rank_of[a] for a in addresses if a in client.rank_of}))
        if ranks:
            token = next(_tokens)
            client.record((PIN, t._ref.id, ranks))
    seq = client.flush()
    return (local_shard, (client.key, t._ref.id, seq, token))


def local_shard(key: str, ref: int, seq: int, pinned: int = 0) -> Any:
    """Unpickled on the receiving proc (in the actor's thread)."""
    try:
        return _read_shard(key, ref, seq)
    finally:
        if pinned:
            from ._engine import engine_for

            engine = engine_for(key)
            if engine is not None:
                engine.unpin(ref)


def _read_shard(key: str, ref: int, seq: int) -> Any:
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
