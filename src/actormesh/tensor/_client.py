"""The controller's side of one proc mesh's tensor engine: reference numbers,
the queue of recorded commands, and flushing it as one message per proc.

A flush sends the whole queue to every proc of the mesh in one broadcast
(commands name the view they run on; a proc skips the ones not for it), so
every proc sees every batch and batch numbers (``seq``) are a total order an
actor message can wait on. Flushes happen at fetch, before any actor message
(a cast hook of the mesh layer), on leaving ``activate()`` and every
``FLUSH_EVERY`` commands.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from ..errors import RemoteException, SupervisionError
from ..mesh import add_cast_hook, mesh_key, root_view, shape_of
from ..runtime import Future

__all__ = ["EngineClient", "View", "client_for", "flush_all", "FLUSH_EVERY"]

#: Commands queued before a flush is forced (bounds controller memory and latency).
FLUSH_EVERY = 2048

_clients: dict[str, EngineClient] = {}
_engine_meshes: set[str] = set()
_registry_lock = threading.Lock()


class View:
    """One view (slice, rename, ...) of a proc mesh, as commands name it."""

    __slots__ = ("client", "procs", "shape", "sid")

    def __init__(self, client: EngineClient, procs: Any, sid: int) -> None:
        self.client = client
        self.procs = procs
        self.shape = shape_of(procs)
        self.sid = sid

    def __repr__(self) -> str:
        return f"<tensor view {dict(self.procs.sizes)} of {self.client.key}>"


class EngineClient:
    """Commands for the tensor engine of one proc mesh (all its views)."""

    def __init__(self, procs: Any) -> None:
        from ._engine import TensorEngine

        self.key = mesh_key(procs)
        self.root = root_view(procs)
        self.engine = self.root.spawn("tensor_engine", TensorEngine, self.key)
        _engine_meshes.add(mesh_key(self.engine))
        self._refs = itertools.count(1)
        self._pending: list[Any] = []
        self._deletes: list[int] = []
        self._views: dict[Any, View] = {}
        self._new_shapes: dict[int, Any] = {}
        self._lock = threading.RLock()
        self._members: dict[int, Any] = {}
        self.seq = 0
        self.dead: SupervisionError | None = None  # the engine's mesh was stopped or failed

    # -- recording ----------------------------------------------------------------------------
    def view(self, procs: Any) -> View:
        shape = shape_of(procs)
        v = self._views.get(shape)
        if v is None:
            with self._lock:
                v = self._views.get(shape)
                if v is None:
                    v = View(self, procs, len(self._views) + 1)
                    self._new_shapes[v.sid] = v.shape
                    self._views[shape] = v
        return v

    def new_ref(self) -> int:
        return next(self._refs)

    def record(self, cmd: tuple[Any, ...]) -> None:
        pending = self._pending
        pending.append(cmd)
        if len(pending) >= FLUSH_EVERY:
            self.flush()

    def release(self, ref: int) -> None:
        """A handle died: free its shard at the next flush (list.append is atomic: GC-safe)."""
        self._deletes.append(ref)
        if len(self._deletes) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> int:
        """Send what is queued; returns the batch number every proc will have run."""
        with self._lock:
            if not self._pending and not self._deletes:
                return self.seq
            batch, self._pending = self._pending, []
            dels, self._deletes = self._deletes, []
            if dels:
                batch.append((2, dels))
            shapes, self._new_shapes = self._new_shapes, {}
            only_deletes = len(batch) == 1 and batch[0][0] == 2
            if self.dead is not None:
                if only_deletes:  # handles outliving their mesh: their storage went with the procs
                    return self.seq
                raise SupervisionError(f"tensor commands for mesh {self.key}, whose procs are gone: {self.dead}") from self.dead
            try:
                self.engine.run.broadcast(self.seq + 1, shapes, batch)
            except SupervisionError as exc:
                self.dead = exc
                _forget(self)
                if not only_deletes:
                    raise
                return self.seq
            self.seq += 1
            return self.seq

    # -- asking a proc ------------------------------------------------------------------------
    def member(self, rank: int) -> Any:
        m = self._members.get(rank)
        if m is None:
            m = self._members[rank] = self.engine.slice(rank=rank)
        return m

    def fetch(self, view: View, index: int, refs: list[int]) -> Future[list[Any]]:
        """The shards ``refs`` of the proc at ``index`` of ``view``, as local CPU tensors."""
        self.flush()
        rank = view.shape.rank_at(index)
        return self.member(rank).fetch.call_one(refs).then(lambda values: [raise_failed(v) for v in values], local_torch)

    def value_on(self, view: View, index: int, op: str, args: Any, kwargs: Any) -> Any:
        """Run a data-dependent op (``.item()``) on one proc and return its plain result."""
        self.flush()
        rank = view.shape.rank_at(index)
        fut = self.member(rank).value.call_one(op, args, kwargs).then(raise_failed, local_torch)
        return fut.get()


def local_torch() -> Any:
    """Torch runs locally inside (decoding fetched shards inside an active mesh)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def raise_failed(value: Any) -> Any:
    """A worker's answer, or the RemoteException it stands for."""
    failure = getattr(value, "as_exception", None)
    if failure is not None and type(value).__name__ == "Failed":
        raise failure()
    return value


def client_for(procs: Any) -> EngineClient:
    """The engine client of ``procs``'s mesh, spawning its engine on first use."""
    key = mesh_key(procs)
    client = _clients.get(key)
    if client is None:
        with _registry_lock:
            client = _clients.get(key)
            if client is None:
                client = _clients[key] = EngineClient(procs)
                if len(_clients) == 1:
                    add_cast_hook(_before_cast)
    return client


def flush_all() -> None:
    """Flush every engine (before an actor message). A dead mesh's error is kept
    for its own next use, not raised into an unrelated actor call."""
    for client in list(_clients.values()):
        try:
            client.flush()
        except SupervisionError:
            pass


def _forget(client: EngineClient) -> None:
    # A stopped or failed mesh: drop the controller's state for it.
    with _registry_lock:
        if _clients.get(client.key) is client:
            del _clients[client.key]
        _engine_meshes.discard(mesh_key(client.engine))


def _before_cast(mesh: Any) -> None:
    # An actor message: tensor commands issued before it run before it.
    if mesh_key(mesh) not in _engine_meshes:
        flush_all()


__all__ += ["raise_failed", "RemoteException"]
