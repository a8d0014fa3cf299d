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

import gc
import itertools
import pickle
import threading
from typing import Any

from ..errors import RemoteException, SupervisionError
from ..mesh import add_cast_hook, addresses_of, mesh_key, root_view, shape_of
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
        self.engine = self.root.spawn("tensor_engine", TensorEngine, self.key, worker_env(procs, len(self.root)))
        _engine_meshes.add(mesh_key(self.engine))
        self._refs = itertools.count(1)
        self._pending: list[Any] = []
        self._deletes: list[int] = []
        self._views: dict[Any, View] = {}
        self._new_shapes: dict[int, Any] = {}
        self._lock = threading.RLock()
        self._members: dict[int, Any] = {}
        self.rank_of = {addr: r for r, addr in enumerate(addresses_of(self.root))}
        self.seq = 0
        #: why this mesh's engine can no longer run commands (its procs stopped), once known
        self.gone: str | None = None
        # Objects alive now (torch and the program's setup) are not rescanned by the
        # cycle collector at every burst of op bookkeeping: ~2x cheaper dispatch.
        gc.freeze()

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
        with self._lock:  # a flush in another thread must not swap the queue between read and append
            pending = self._pending
            pending.append(cmd)
            full = len(pending) >= FLUSH_EVERY
        if full:
            self.flush()

    def release(self, ref: int) -> None:
        """A handle died: free its shard at the next flush (list.append is atomic: GC-safe)."""
        if self.gone is not None:
            return
        self._deletes.append(ref)
        if len(self._deletes) >= FLUSH_EVERY:
            try:
                self.flush()
            except SupervisionError:
                pass  # the procs are gone, and their storage with them

    def flush(self) -> int:
        """Send what is queued; returns the batch number every proc will have run."""
        with self._lock:
            if self.gone is not None:
                self._pending, self._deletes = [], []
                raise SupervisionError(f"the tensor commands for proc mesh {self.key} cannot run: {self.gone}")
            if not self._pending and not self._deletes:
                return self.seq
            batch, self._pending = self._pending, []
            dels, self._deletes = self._deletes, []
            if dels:
                batch.append((2, dels))
            shapes, self._new_shapes = self._new_shapes, {}
            self.seq += 1
            try:
                self.engine.run.broadcast(self.seq, shapes, _encode(batch))
            except SupervisionError as exc:
                self.gone = f"its tensor engine is gone ({exc})"
                raise SupervisionError(f"the tensor commands for proc mesh {self.key} cannot run: {self.gone}") from None
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


#: Dim names taken as "the devices of one host" for LOCAL_RANK (else the last dim), as actormesh.spmd.
_LOCAL_DIMS = ("gpus", "gpu", "procs", "local")


def worker_env(procs: Any, n: int) -> list[dict[str, str]]:
    """torchrun's RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE for each root rank."""
    shape = shape_of(procs)
    if len(shape) != n or sorted(shape.ranks()) != list(range(n)):
        return [{"RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(n)} for r in range(n)]
    labels = shape.labels
    local = next((d for d in _LOCAL_DIMS if d in labels), labels[-1] if labels else None)
    out: list[dict[str, str]] = [{} for _ in range(n)]
    for i in range(n):
        point = shape.point(i)
        local_rank = point[local] if local else 0
        local_size = procs.size(local) if local else 1
        out[shape.rank_at(i)] = {"RANK": str(shape.rank_at(i)), "WORLD_SIZE": str(n), "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_size)}
    return out


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
    for client in list(_clients.values()):
        if client.gone is None:
            try:
                client.flush()
            except SupervisionError:
                pass  # that mesh is gone: an actor call to another mesh must not fail for it


def _encode(batch: list[Any]) -> Any:
    """Batches are plain data: the C pickler is ~2x faster than the general codec on
    them; what it cannot pickle (a lambda in a remote call) goes through the codec."""
    try:
        data = pickle.dumps(batch, protocol=5)
    except (pickle.PicklingError, TypeError, AttributeError):
        return batch
    # The C pickler names classes and functions of the user's script as ``__main__.X``,
    # which a worker cannot import: those batches travel by value through the codec.
    return batch if b"__main__" in data else data


#: The procs the actor message being encoded in this thread goes to (see _shard_ref).
destination = threading.local()


def _before_cast(mesh: Any) -> None:
    # An actor message: tensor commands issued before it run before it.
    if mesh_key(mesh) not in _engine_meshes:
        destination.addresses = addresses_of(mesh)
        flush_all()


__all__ += ["raise_failed", "RemoteException"]
