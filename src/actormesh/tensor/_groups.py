"""Worker-side process groups for the tensor engine: a rendezvous store, groups made
lazily by their members only, and the rank arithmetic of mesh reductions.

Theory of operation
-------------------
One proc of a mesh starts a ``TCPStore`` master (:func:`start_store`); every proc
connects to it (:func:`connect_store`) and owns one :class:`Groups`. A reduction over
some mesh dims runs in the group of the procs that share the caller's coordinates on
every other dim (:func:`group_ranks`); ``Groups.group(ranks)`` builds that group the
first time it is asked for, by those members alone: no world-wide collective, so a
slice of a mesh can make its groups while the rest of the mesh does something else.

The group is a real ``torch.distributed.ProcessGroup`` (gloo for CPU tensors, plus
NCCL for CUDA tensors when asked for) registered in torch's group tables, so user
code inside a remote function may call ``dist.all_reduce(t, group=pg)``,
``dist.all_gather``, ``dist.broadcast(t, src=<global rank>, group=pg)``,
``dist.get_world_size(pg)`` and the like. torch needs no default group for those;
the few calls that consult it (``dist.get_rank(pg)``, ``dist.new_group``) raise
torch's "Default process group has not been initialized": use ``pg.rank()`` and
``pg.size()`` instead.

Nothing waits forever: the store and every backend carry ``timeout_s``; a member that
never joins, or dies mid-collective, gives a :class:`CollectiveError` naming the
group, the op and the caller's group rank. A group that failed is broken for good
(its peers cannot agree to rebuild it); asking for it again raises at once.
"""

from __future__ import annotations

import datetime
import itertools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroup, TCPStore

from actormesh.errors import TransportError

__all__ = [
    "CollectiveError",
    "Groups",
    "connect_store",
    "fail",
    "group_ranks",
    "start_store",
]

T = TypeVar("T")

# Names registered in torch's group table must be unique per process, even when two
# Groups objects (two meshes) build a group over the same ranks.
_names = itertools.count()
# Names of groups a collective failed on (see fail()); Groups stops handing them out.
_failed: set[str] = set()


class CollectiveError(TransportError):
    """A collective or a group rendezvous failed: a peer died, or did not take part
    within the deadline. ``group`` is the tuple of global ranks, ``op`` the operation."""

    def __init__(self, message: str, *, group: tuple[int, ...] = (), op: str = "") -> None:
        super().__init__(message)
        self.group = group
        self.op = op


def fail(pg: ProcessGroup, op: str, exc: BaseException) -> CollectiveError:
    """The error for ``op`` failing on ``pg`` (a dead or absent peer, or a deadline);
    marks ``pg`` broken so its ``Groups`` builds no more work on it."""
    _failed.add(pg.group_name)
    try:
        ranks = tuple(dist.get_process_group_ranks(pg))
    except (RuntimeError, ValueError, KeyError):
        ranks = ()
    return CollectiveError(
        f"{op} on group {ranks} (group rank {pg.rank()} of {pg.size()}) failed: a peer died, "
        f"or did not take part before the deadline. Cause: {cause(exc)}", group=ranks, op=op)


def cause(exc: BaseException) -> str:
    """The first line of a torch error (the rest is a C++ stack), with its type."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]


def _delta(timeout_s: float) -> datetime.timedelta:
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return datetime.timedelta(seconds=timeout_s)


def start_store(host: str, timeout_s: float = 60.0) -> tuple[str, int, TCPStore]:
    """Start a ``TCPStore`` master on an ephemeral port; return ``(host, port, store)``.

    The server listens on every interface, so other procs reach it at ``host`` (the
    name this proc's own client uses as well). Waits on the store end after
    ``timeout_s``. Keep the returned store alive as long as any group is in use.
    """
    try:
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_delta(timeout_s))
    except (RuntimeError, OSError) as exc:
        raise TransportError(f"could not start a rendezvous store on {host!r}: {cause(exc)}") from exc
    return host, store.port, store


def connect_store(host: str, port: int, timeout_s: float = 60.0) -> TCPStore:
    """Connect to the store started by :func:`start_store`; every wait on it (and the
    connect itself) ends after ``timeout_s`` with a :class:`TransportError`."""
    try:
        return TCPStore(host, port, is_master=False, timeout=_delta(timeout_s))
    except (RuntimeError, OSError) as exc:
        raise TransportError(
            f"could not reach the rendezvous store at {host}:{port} within {timeout_s}s: {cause(exc)}"
        ) from exc


def _register(pg: ProcessGroup, name: str, store: Any, backends: str, ranks: Sequence[int]) -> None:
    """Enter ``pg`` in torch's group tables so ``dist.*(group=pg)`` accepts it and maps
    global ranks (``src=``/``dst=``) to group ranks. The helper is private to torch
    (2.13); without it we fill the same tables by hand, as ``new_group`` does."""
    mapping = {r: i for i, r in enumerate(ranks)}
    register = getattr(dist.distributed_c10d, "_register_pg_in_world", None)
    if register is not None:
        register(pg, backend_name=backends, store=store, group_name=name,
                 backend_config=backends, rank_mapping=mapping)
        return
    world = dist.distributed_c10d._world
    world.pg_map[pg] = (backends, store)
    world.pg_names[pg] = name
    world.pg_backend_config[pg] = backends
    world.pg_group_ranks[pg] = mapping
    world.pg_to_tag[pg] = f"ptd:{name}"
    world.tags_to_pg.setdefault(f"ptd:{name}", []).append(pg)
    dist.distributed_c10d._register_process_group(name, pg)


class Groups:
    """The process groups one proc takes part in, made lazily and cached.

    ``store`` is shared by every member (see :func:`connect_store`); ``my_rank`` is this
    proc's global rank; ``timeout_s`` bounds each rendezvous and each collective.
    Thread-safe: the engine may build groups from more than one thread, but two
    members must ask for their common groups in the same order (a rendezvous blocks
    until every member arrives).
    """

    def __init__(self, store: Any, my_rank: int, timeout_s: float, namespace: str = "am") -> None:
        self.store = store
        self.my_rank = my_rank
        self.timeout_s = timeout_s
        self._timeout = _delta(timeout_s)
        self._namespace = namespace
        self._lock = threading.RLock()
        self._groups: dict[tuple[tuple[int, ...], str], ProcessGroup] = {}
        self._broken: dict[tuple[int, ...], str] = {}
        self._dead: list[ProcessGroup] = []  # failed groups, still to destroy at close()
        self._closed = False

    def group(self, ranks: Sequence[int], device_type: str = "cpu") -> ProcessGroup:
        """The group over exactly ``ranks`` (global ranks; position = group rank).

        The first call builds it, which blocks until every member has called too (at
        most ``timeout_s``, then :class:`CollectiveError`). ``device_type`` "cpu" gives
        a gloo group; "cuda" gives one with NCCL for CUDA tensors and gloo for CPU
        tensors (the engine's poison agreement runs on CPU). Its global ranks are
        ``dist.get_process_group_ranks(pg)``; a group a collective failed on is
        broken, and asking for it again raises :class:`CollectiveError` at once.
        """
        key = (tuple(int(r) for r in ranks), device_type)
        with self._lock:
            if self._closed:
                raise RuntimeError("Groups was closed; make a new one for a new mesh")
            found = self._groups.get(key)
            if found is not None and found.group_name in _failed:
                self._broken.setdefault(key[0], "a collective on it failed")
                self._dead.append(self._groups.pop(key))
            elif found is not None:
                return found
            if key[0] in self._broken:
                raise CollectiveError(
                    f"group {key[0]} is broken by an earlier failure ({self._broken[key[0]]}); "
                    "its members cannot rebuild it", group=key[0], op="group")
            self._check(key)
            pg = self._build(*key)
            self._groups[key] = pg
            return pg

    def _check(self, key: tuple[tuple[int, ...], str]) -> None:
        ranks, device_type = key
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"a group needs distinct global ranks, got {ranks}")
        if self.my_rank not in ranks:
            raise ValueError(
                f"rank {self.my_rank} asked for group {ranks} it is not a member of; "
                "only members build a group")
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
        if device_type == "cuda" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ValueError("a 'cuda' group needs CUDA and NCCL, which this process lacks")

    def _build(self, ranks: tuple[int, ...], device_type: str) -> ProcessGroup:
        me, size = ranks.index(self.my_rank), len(ranks)
        key = f"{self._namespace}/{device_type}/{'.'.join(map(str, ranks))}"
        prefix = PrefixStore(key + "/", self.store)
        pg = ProcessGroup(prefix, me, size)
        gloo_type = ProcessGroup.BackendType.GLOO
        pg._set_default_backend(ProcessGroup.BackendType.NCCL if device_type == "cuda" else gloo_type)

        def make_gloo() -> Any:
            return dist.ProcessGroupGloo(PrefixStore("cpu/", prefix), me, size, self._timeout)

        gloo = self._guard(make_gloo, ranks, "group rendezvous (gloo)", me)
        gloo._set_sequence_number_for_group()
        pg._register_backend(torch.device("cpu"), gloo_type, gloo)
        backends = "cpu:gloo"
        if device_type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self._timeout
            opts.global_ranks_in_group = list(ranks)
            opts.group_name = key
            # NCCL connects lazily, on the first CUDA collective.
            nccl = dist.ProcessGroupNCCL(PrefixStore("cuda/", prefix), me, size, opts)
            nccl._set_sequence_number_for_group()
            pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, nccl)
            backends = "cpu:gloo,cuda:nccl"
        name = f"{key}#{next(_names)}"
        pg._set_group_name(name)
        pg._set_group_desc(f"actormesh group {ranks}")
        _register(pg, name, prefix, backends, ranks)
        return pg

    def _guard(self, fn: Callable[[], T], ranks: Sequence[int], op: str, group_rank: int) -> T:
        """Run ``fn`` (a rendezvous or a blocking wait); turn torch's failure into a
        :class:`CollectiveError` naming the group and op, and mark the group broken."""
        try:
            return fn()
        except (RuntimeError, OSError) as exc:
            ranks = tuple(ranks)
            with self._lock:
                self._broken.setdefault(ranks, f"{op}: {type(exc).__name__}")
                for key in [k for k in self._groups if k[0] == ranks]:
                    self._dead.append(self._groups.pop(key))
            raise CollectiveError(
                f"{op} on group {ranks} (group rank {group_rank} of {len(ranks)}, global rank "
                f"{self.my_rank}) failed within the {self.timeout_s}s deadline: a peer died or "
                f"did not take part. Cause: {cause(exc)}",
                group=ranks, op=op) from exc

    def close(self) -> None:
        """Release every group (abort its backends, drop it from torch's tables).
        Idempotent; later ``group()`` calls raise."""
        with self._lock:
            self._closed = True
            groups, self._groups = list(self._groups.values()) + self._dead, {}
            self._dead = []
        for pg in groups:
            try:
                dist.destroy_process_group(pg)
            except (RuntimeError, ValueError):
                pass  # already torn down by a failure; nothing left to release

    def __enter__(self) -> Groups:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def group_ranks(
    labels: Sequence[str],
    sizes: Sequence[int],
    ranks_row_major: Sequence[int],
    my_rank: int,
    dims: str | Sequence[str],
) -> tuple[int, ...]:
    """Global ranks of ``my_rank``'s group for a reduction over ``dims``.

    The mesh has dims ``labels`` of ``sizes``; ``ranks_row_major[i]`` is the global
    rank of the i-th point in row-major order. The group is the points that share my
    coordinates on every dim not in ``dims``, listed in row-major order of ``dims``
    as they appear in the mesh (so group rank = row-major index over those dims).
    """
    labels, sizes = list(labels), [int(s) for s in sizes]
    wanted = [dims] if isinstance(dims, str) else list(dims)
    if len(labels) != len(sizes):
        raise ValueError(f"labels {labels} and sizes {sizes} differ in length")
    if len(ranks_row_major) != math.prod(sizes):
        raise ValueError(
            f"a mesh of sizes {sizes} has {math.prod(sizes)} points, got {len(ranks_row_major)} ranks")
    unknown = [d for d in wanted if d not in labels]
    if unknown:
        raise KeyError(f"dims {unknown} are not in the mesh, whose dims are {labels}")
    if len(set(wanted)) != len(wanted) or not wanted:
        raise ValueError(f"dims must name distinct mesh dims, at least one, got {wanted}")
    ranks = list(ranks_row_major)
    if my_rank not in ranks:
        raise ValueError(f"rank {my_rank} is not in the mesh {ranks}")
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    index = ranks.index(my_rank)
    mine = [(index // strides[i]) % sizes[i] for i in range(len(sizes))]
    reduced = [i for i, label in enumerate(labels) if label in wanted]
    base = index - sum(mine[i] * strides[i] for i in reduced)
    out = []
    for coords in itertools.product(*(range(sizes[i]) for i in reduced)):
        out.append(ranks[base + sum(c * strides[i] for c, i in zip(coords, reduced))])
    return tuple(out)
