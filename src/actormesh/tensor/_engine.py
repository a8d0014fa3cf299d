"""The worker's side: one tensor-engine actor per proc, holding the shards in a
table keyed by reference number and running the controller's batches in order.

A command that fails stores a :class:`Failed` under each ref it would have
defined or mutated; a command whose input is Failed passes the same Failed on
without running. So an error stays with the tensors that depend on it, is
raised where one of them is fetched, and the engine keeps serving.
"""

from __future__ import annotations

import gc
import os
import pickle
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ..errors import RemoteException
from ..runtime import Actor, context, endpoint
from ._process_group import GroupToken
from ._tensor import Ref

__all__ = ["TensorEngine", "Failed", "engine_for", "HANDLERS"]

OP, CONST, DEL, SEED, RANK = 0, 1, 2, 3, 4
PIN = 8  # (PIN, ref, ranks): an actor message carrying the shard goes to those procs

#: Extra command kinds (collectives, remote functions, moves): kind -> fn(engine, cmd).
HANDLERS: dict[int, Callable[[TensorEngine, tuple[Any, ...]], None]] = {}

_engines: dict[str, TensorEngine] = {}
_engines_changed = threading.Condition()
_ops: dict[str, Any] = {}


class Failed:
    """What a ref holds when the command that defines it failed."""

    __slots__ = ("rank", "message", "tb", "where")

    def __init__(self, rank: int, message: str, tb: str, where: Any) -> None:
        self.rank, self.message, self.tb, self.where = rank, message, tb, where

    def __reduce__(self) -> tuple[Any, ...]:
        return (Failed, (self.rank, self.message, self.tb, self.where))

    def as_exception(self) -> RemoteException:
        where = f"{self.where[0]}:{self.where[1]}" if self.where else ""
        return RemoteException(self.rank, self.message, self.tb, where)


class Poisoned(Exception):
    """An input of a command is Failed (internal: carries that failure)."""

    def __init__(self, failed: Failed) -> None:
        self.failed = failed


def engine_for(key: str, wait_s: float = 0.0) -> TensorEngine | None:
    """This proc's engine for the mesh ``key`` (None if not spawned here).

    ``wait_s``: how long to wait for one being spawned (an actor message can
    arrive before the engine's ``__init__`` has run on this proc)."""
    engine = _engines.get(key)
    if engine is None and wait_s > 0:
        with _engines_changed:
            _engines_changed.wait_for(lambda: key in _engines, wait_s)
        engine = _engines.get(key)
    return engine


def overload(name: str) -> Any:
    """The OpOverload named ``aten.add.Tensor``."""
    ns, fn, which = name.split(".", 2) if name.count(".") >= 2 else (*name.split("."), "default")
    return getattr(getattr(getattr(torch.ops, ns), fn), which)


def resolve_op(name: str) -> Any:
    op = _ops.get(name)
    if op is None:
        found = overload(name)
        # the C++ callable itself: OpOverload.__call__ is one more Python frame per op
        op = _ops[name] = getattr(found, "_op", None) or found
    return op


class TensorEngine(Actor):
    """Runs the tensor commands of one proc mesh on this proc."""

    def __init__(self, key: str, env: list[dict[str, str]] | None = None) -> None:
        self.key = key
        self.rank: int = context().actor_instance.rank.rank
        if env:
            _set_env(env[self.rank])
        self.table: dict[int, Any] = {}
        self.shapes: dict[int, Any] = {}
        self.index: dict[int, int | None] = {}  # sid -> my index in that view, None: not a member
        self.done = 0
        self.cond = threading.Condition()
        self.extra: dict[str, Any] = {}  # state of HANDLERS (process groups, ...)
        self.pins: dict[int, int] = {}  # ref -> actor messages yet to read it
        self.doomed: set[int] = set()  # deleted by the controller while pinned
        torch.manual_seed(int.from_bytes(os.urandom(7), "little"))  # shards differ unless the program seeds
        # torch's import leaves ~10^5 objects for the cycle collector to rescan as
        # commands allocate: freezing them takes GC from ~9 us to ~1 us per op.
        gc.freeze()
        with _engines_changed:
            _engines[key] = self
            _engines_changed.notify_all()

    # -- argument resolution (hot path) ---------------------------------------------------
    def res(self, x: Any) -> Any:
        t = type(x)
        if t is Ref:
            try:
                v = self.table[x.id]
            except KeyError:
                raise KeyError(f"tensor ref {x.id} is not defined on rank {self.rank} (deleted, or created on another mesh)") from None
            if type(v) is Failed:
                raise Poisoned(v)
            return v
        if t is tuple or t is list:
            return t([self.res(e) for e in x])
        if t is dict:
            return {k: self.res(v) for k, v in x.items()}
        if t is GroupToken:
            from ._reduce_worker import group_for

            return group_for(self, x.sid, x.dims)[0]
        return x

    def fail(self, refs: Any, failed: Failed) -> None:
        for r in refs:
            if r is not None:
                self.table[r] = failed

    def failure(self, what: str, exc: BaseException, where: Any) -> Failed:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return Failed(self.rank, f"{what} failed: {type(exc).__name__}: {exc}", tb, where)

    def member_index(self, sid: int) -> int | None:
        try:
            return self.index[sid]
        except KeyError:
            shape = self.shapes[sid]
            ranks = shape.ranks()
            i = self.index[sid] = ranks.index(self.rank) if self.rank in ranks else None
            return i

    # -- commands --------------------------------------------------------------------------
    def _op(self, cmd: tuple[Any, ...]) -> None:
        _, name, a, k, outs, sid, where = cmd
        index = self.index.get(sid, -1)
        if index is None or (index == -1 and self.member_index(sid) is None):
            return
        table = self.table
        try:
            func = _ops.get(name) or resolve_op(name)
            args = []
            for x in a:  # flat arguments inline: this loop runs once per op per proc
                tx = type(x)
                if tx is Ref:
                    v = table[x.id]
                    if type(v) is Failed:
                        raise Poisoned(v)
                    args.append(v)
                elif tx is tuple or tx is list:
                    args.append(self.res(x))
                else:
                    args.append(x)
            out = func(*args, **self.res(k)) if k else func(*args)
        except Poisoned as p:
            self.fail(outs, p.failed)
            self.fail(_mutated_refs(name, a), p.failed)
            return
        except Exception as exc:
            if isinstance(exc, KeyError) and any(type(x) is Ref and x.id not in table for x in a):
                exc = KeyError(f"an input tensor is not defined on rank {self.rank} (deleted, or created on another mesh)")
            failed = self.failure(name, exc, where)
            self.fail(outs, failed)
            self.fail(_mutated_refs(name, a), failed)
            return
        if len(outs) == 1:
            if outs[0] is not None:
                table[outs[0]] = out
            return
        flat = out if isinstance(out, (tuple, list)) else (out,)
        for r, v in zip(outs, _leaves(flat)):
            if r is not None:
                table[r] = v

    def _run_one(self, cmd: tuple[Any, ...]) -> None:
        kind = cmd[0]
        if kind == CONST:
            if self.member_index(cmd[3]) is not None:
                self.table[cmd[1]] = cmd[2]
        elif kind == DEL:
            pop, pins = self.table.pop, self.pins
            for r in cmd[1]:
                if r in pins:
                    with self.cond:
                        if r in pins:  # an actor has yet to read it: the last unpin frees it
                            self.doomed.add(r)
                            continue
                pop(r, None)
        elif kind == PIN:
            if self.rank in cmd[2]:
                with self.cond:
                    self.pins[cmd[1]] = self.pins.get(cmd[1], 0) + 1
        elif kind == SEED:
            if self.member_index(cmd[2]) is not None:
                torch.manual_seed(cmd[1])
        elif kind == RANK:
            i = self.member_index(cmd[3])
            if i is not None:
                self.table[cmd[1]] = torch.tensor(self.shapes[cmd[3]].point(i)[cmd[2]], dtype=torch.long)
        else:
            HANDLERS[kind](self, cmd)

    @endpoint
    def run(self, seq: int, shapes: dict[int, Any], batch: list[tuple[Any, ...]]) -> None:
        """Run one batch of commands, in order (the controller's ``flush``)."""
        self.shapes.update(shapes)
        if type(batch) is bytes:
            batch = pickle.loads(batch)
        try:
            op, run_one = self._op, self._run_one
            with torch.no_grad():
                for cmd in batch:
                    try:
                        if cmd[0] == OP:
                            op(cmd)
                        else:
                            run_one(cmd)
                    except Exception as exc:  # a handler's own bug must not stop the batch
                        refs = [x for x in cmd[1:] if isinstance(x, int)]
                        self.fail(refs, self.failure(f"command {cmd[0]}", exc, None))
        finally:
            with self.cond:
                self.done = seq
                self.cond.notify_all()

    @endpoint
    def fetch(self, refs: list[int]) -> list[Any]:
        """Copies of shards as CPU tensors (a Failed stands for a failed one)."""
        out = []
        for r in refs:
            v = self.table.get(r)
            if v is None:
                v = Failed(self.rank, f"tensor ref {r} is not defined here (it was deleted)", "", None)
            elif isinstance(v, torch.Tensor):
                v = v.detach().to("cpu", copy=True)
            out.append(v)
        return out

    @endpoint
    def start_store(self) -> tuple[str, int]:
        """Serve the mesh's rendezvous store from this proc; returns (host, port)."""
        from ._reduce_worker import serve_store

        return serve_store(self)

    @endpoint
    def value(self, op: str, args: Any, kwargs: Any) -> Any:
        """A data-dependent op's plain result (``.item()``) on this proc's shards."""
        try:
            with torch.no_grad():
                return resolve_op(op)(*self.res(args), **self.res(kwargs))
        except Poisoned as p:
            return p.failed
        except Exception as exc:
            return self.failure(op, exc, None)

    def unpin(self, ref: int) -> None:
        """An actor has read (or failed to read) a pinned shard (actor thread)."""
        with self.cond:
            left = self.pins.get(ref, 0) - 1
            if left > 0:
                self.pins[ref] = left
                return
            self.pins.pop(ref, None)
            if ref in self.doomed:
                self.doomed.discard(ref)
                self.table.pop(ref, None)

    def wait_for(self, seq: int, timeout: float) -> None:
        """Block until batch ``seq`` has run (an actor message that carries shards)."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.done >= seq, timeout):
                raise TimeoutError(f"tensor engine on rank {self.rank} did not reach batch {seq} within {timeout:.0f} s")

    def __cleanup__(self, exc: Any = None) -> None:
        self.table.clear()
        for closer in self.extra.get("closers", ()):
            closer()
        _engines.pop(self.key, None)


def _set_env(env: dict[str, str]) -> None:
    """Monarch's worker variables; an SPMD setup that came first keeps its own."""
    for k, v in env.items():
        os.environ.setdefault(k, v)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    # CUDA_VISIBLE_DEVICES is read once, when CUDA starts; selecting the device has the same effect later.
    if "CUDA_VISIBLE_DEVICES" not in os.environ and torch.cuda.is_available() and local < torch.cuda.device_count():
        torch.cuda.set_device(local)


def _leaves(xs: Any) -> list[Any]:
    out: list[Any] = []
    for x in xs:
        if isinstance(x, (tuple, list)):
            out.extend(_leaves(x))
        else:
            out.append(x)
    return out


_mutates: dict[str, tuple[int, ...]] = {}


def _mutated_refs(name: str, args: Any) -> list[int]:
    """Refs an in-place op writes (they hold the failure too)."""
    pos = _mutates.get(name)
    if pos is None:
        schema = overload(name)._schema
        pos = _mutates[name] = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
    return [args[i].id for i in pos if i < len(args) and type(args[i]) is Ref]


# Command kinds beyond the core register themselves in HANDLERS when imported:
# 5-9 collectives and moves, 10-19 remote functions and actor calls, 20-29 streams.
# (imports at the end: those modules import this one)
from . import _reduce_worker  # noqa: E402,F401
from . import _remote_worker  # noqa: E402,F401  (kinds 10-11, call_remote/propagate_remote endpoints)
from . import _stream_worker  # noqa: E402,F401  (kinds 20-22: streams and borrows)
