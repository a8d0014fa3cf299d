"""The workers' side of collectives and moves: a rendezvous store on the mesh's
first proc, process groups made lazily by their members, and the commands
GROUPS, REDUCE and MOVE (kinds 5-7).

A failed input must not leave a peer blocked in a collective: every REDUCE first
agrees on which members' inputs failed (a one-byte all-gather) and then either
all run the data collective or all mark the output failed; a MOVE first sends a
one-byte flag per transfer. Collectives have a deadline (COLLECTIVE_TIMEOUT_S),
long because a peer may legitimately be busy with earlier work.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..runtime import current_runtime
from ._collectives import collective, exchange, start_agree
from ._engine import HANDLERS, Failed, TensorEngine
from ._groups import Groups, connect_store, group_ranks, start_store

__all__ = ["serve_store", "COLLECTIVE_TIMEOUT_S"]

GROUPS, REDUCE, MOVE = 5, 6, 7

#: How long a member waits for its peers in one collective (env ACTORMESH_COLLECTIVE_TIMEOUT_S).
COLLECTIVE_TIMEOUT_S = float(os.environ.get("ACTORMESH_COLLECTIVE_TIMEOUT_S", "1800"))


def _my_host() -> str:
    address = current_runtime().address
    if address.startswith("tcp://"):
        return address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return "127.0.0.1"


def serve_store(engine: TensorEngine) -> tuple[str, int]:
    """Start this mesh's rendezvous store here (the engine of root rank 0)."""
    found = engine.extra.get("store_address")
    if found is None:
        host, port, store = start_store(_my_host(), COLLECTIVE_TIMEOUT_S)
        engine.extra["store"] = store
        found = engine.extra["store_address"] = (host, port)
    return found


def _groups(engine: TensorEngine) -> Groups:
    groups = engine.extra.get("groups")
    if groups is None:
        raise RuntimeError("no process groups yet: the controller did not announce the rendezvous store")
    return groups


def _on_groups(engine: TensorEngine, cmd: tuple[Any, ...]) -> None:
    if "groups" in engine.extra:
        return
    _, host, port = cmd
    store = engine.extra.get("store") or connect_store(host, port, COLLECTIVE_TIMEOUT_S)
    groups = engine.extra["groups"] = Groups(store, engine.rank, COLLECTIVE_TIMEOUT_S)
    engine.extra.setdefault("closers", []).append(groups.close)


def group_for(engine: TensorEngine, sid: int, dims: Any, device_type: str = "cpu") -> Any:
    """My process group over ``dims`` of view ``sid`` (made on first use, by its members)."""
    shape = engine.shapes[sid]
    ranks = group_ranks(shape.labels, shape.sizes, shape.ranks(), engine.rank, dims)
    return _groups(engine).group(ranks, device_type), len(ranks)


def _on_reduce(engine: TensorEngine, cmd: tuple[Any, ...]) -> None:
    _, src, dst, sid, dims, reduction, scatter, inplace, device_type, where, size, dtype = cmd
    if engine.member_index(sid) is None:
        return
    outs = [dst, src] if inplace else [dst]
    try:
        pg, n = group_for(engine, sid, dims, device_type)
        value = engine.table.get(src)
        ok = isinstance(value, torch.Tensor)
        agreed = start_agree(pg, ok)
        # every member joins the data collective, a failed one with zeros of the same shape
        data = value if ok else torch.zeros(size, dtype=dtype, device=_device(device_type))
        result = collective(data, pg, n, reduction, scatter, inplace)
        bad = agreed()
        if bad:
            failed = value if isinstance(value, Failed) else Failed(
                engine.rank, f"reduce over {list(dims)}: the input failed on group rank(s) {bad}; fetch that input for its error", "", where)
            engine.fail(outs, failed)
            return
        engine.table[dst] = result
    except Exception as exc:
        engine.fail(outs, engine.failure(f"reduce({reduction}, scatter={scatter}) over {list(dims)}", exc, where))


def _device(device_type: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)


def _on_move(engine: TensorEngine, cmd: tuple[Any, ...]) -> None:
    _, src, dst, pairs, size, dtype, device_type, where = cmd
    me = engine.rank
    sending = [d for s, d in pairs if s == me]
    receiving = [s for s, d in pairs if d == me]
    if not sending and not receiving:
        return
    try:
        groups = _groups(engine)
        value = engine.table.get(src) if sending else None
        ok = isinstance(value, torch.Tensor)
        flag = torch.tensor([1 if ok else 0], dtype=torch.uint8)
        flags = exchange(groups, [(d, flag) for d in sending], [(s, (1,), torch.uint8) for s in receiving])
        got_ok = [(s, f) for s, f in zip(receiving, flags) if int(f[0]) == 1]
        data = exchange(groups, [(d, value) for d in sending] if ok else [], [(s, size, dtype) for s, _ in got_ok], device_type)
        if receiving:
            if data:
                engine.table[dst] = data[0]
            else:
                engine.table[dst] = Failed(me, f"to_mesh: the source shard on rank {receiving[0]} had failed; fetch the source for its error", "", where)
    except Exception as exc:
        if receiving:
            engine.fail([dst], engine.failure("to_mesh", exc, where))


HANDLERS[GROUPS] = _on_groups
HANDLERS[REDUCE] = _on_reduce
HANDLERS[MOVE] = _on_move
