"""ProcMesh: processes to spawn actors on (HostMesh, the hosts, is in ``_host_mesh``).

``this_host().spawn_procs(per_host={"gpus": 4})`` starts four worker processes
(non-blocking: messages queue until they are up). ``procs.spawn(name, Cls, ...)``
starts one actor per proc and returns its ActorMesh; the caller owns it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ..errors import Cause, CauseKind, MeshStoppedError
from ..runtime import (
    CLIENT_NAME,
    Actor,
    ChildProc,
    Future,
    GatherPort,
    MeshRecord,
    Promise,
    check_actor_class,
    context,
    current_runtime,
    gather,
    spawn_children,
    stop_children,
    use_proc_view,
    when_done,
)
from ..transport import dumps
from ._actor_mesh import RESERVED_NAMES, ActorMesh, member_display
from ._host_agent import EventPort, agent_mesh
from ._logs import sink
from ._shape import Extent, MeshTrait, Shape
from ._tensor_methods import TensorMethods

if TYPE_CHECKING:
    from ..runtime import ProcRuntime
    from ._host_mesh import HostMesh

__all__ = ["ProcMesh", "this_proc", "proc_mesh_for", "release_hosts"]

T = TypeVar("T")


@dataclass
class _ProcMeshState:
    """Shared by a proc mesh and all its slices."""

    children: list[ChildProc] | None
    stopped: str | None = None
    actor_records: list[MeshRecord] = field(default_factory=list)
    bootstrap: Callable[[], Any] | None = None
    owner: str = CLIENT_NAME
    addresses: list[str] = field(default_factory=list)
    generation: int = 0
    #: For procs on remote hosts: (agent address, proc addresses) per host.
    agents: list[tuple[str, list[str]]] | None = None
    #: How each rank was launched (``HostMesh.spawn_procs(bootstrap_command=, proc_bind=)``); None: the default.
    commands: list[Any] | None = None

    def replace(self, rank: int, dead_address: str) -> str:
        """Start a fresh proc at ``rank`` if it still is ``dead_address``; return its address.

        Runs on the loop thread (from supervision), so it never blocks.
        """
        if self.children is None:
            raise RuntimeError("only procs spawned by this process on its own host can be replaced")
        if self.addresses[rank] != dead_address:
            return self.addresses[rank]  # someone already replaced it
        self.generation += 1
        old = self.children[rank]
        command = [self.commands[rank]] if self.commands else None
        (child,) = spawn_children(current_runtime(), [f"{old.name}.r{self.generation}"], bootstrap=self.bootstrap, owner=self.owner, commands=command)
        self.children[rank] = child
        self.addresses[rank] = child.address
        return child.address


class ProcMesh(MeshTrait, TensorMethods):
    """Processes, one per point; spawn actors on them with :meth:`spawn`."""

    def __init__(self, addresses: list[str], shape: Shape, name: str, state: _ProcMeshState | None = None) -> None:
        self._addresses = addresses
        self._shape = shape
        self._name = name
        self._state = state  # None for a reference received from elsewhere

    def _new_with_shape(self, shape: Shape) -> ProcMesh:
        return ProcMesh(self._addresses, shape, self._name, self._state)

    def spawn(self, name: str, Class: type[T], *args: Any, **kwargs: Any) -> T:
        """Start one ``Class(*args, **kwargs)`` per proc; returns their ActorMesh at once.

        ``__init__`` runs before the first message any member handles. Raises
        ValueError for a class that is not an Actor, TypeError for arguments
        that do not fit ``__init__`` or cannot be pickled.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"spawn() needs a non-empty actor name as first argument, got {name!r}")
        is_async = check_actor_class(Class, RESERVED_NAMES)
        init = Class.__init__
        if init is object.__init__:
            if args or kwargs:
                raise TypeError(f"{Class.__qualname__}() takes no arguments, but spawn() was given some")
        else:
            try:
                inspect.signature(init).bind(None, *args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"bad arguments for {Class.__qualname__}.__init__: {exc}") from None
        self._refuse_if_stopped(name)
        payload = dumps((Class, args, kwargs))
        rt = current_runtime()
        ctx = context()
        me = ctx.actor_instance
        owner_name = me.name if me.is_actor else CLIENT_NAME
        mesh_name = f"{name}-{os.urandom(6).hex()}"
        shape = self._shape
        n = len(shape)
        addresses = [self._addresses[shape.rank_at(i)] for i in range(n)]
        extent = Extent(shape.labels, shape.sizes)
        prefix = f"{me.display}.<{Class.__module__}.{Class.__qualname__} {name}"
        record = MeshRecord(mesh_name, owner_name, addresses, prefix)
        rt.owned_meshes[mesh_name] = record
        if self._state is not None:
            self._state.actor_records.append(record)
        port = GatherPort(rt, f"{name}.__init__", addresses, lambda values: None)
        owner = (rt.address, owner_name)
        reply = (rt.address, port.port_id)
        labels, sizes = shape.labels, shape.sizes
        for i, addr in enumerate(addresses):
            display = member_display(prefix, i, extent)
            rt.spawn_actor(addr, mesh_name, i, labels, sizes, owner, reply, display, is_async, payload)
        record.describe = lambda r: member_display(prefix, r, extent)
        state = self._state
        proc_ranks = [shape.rank_at(i) for i in range(n)]

        def respawn(rank: int) -> None:
            """Restart member ``rank`` (loop thread): on a fresh proc if its proc died."""
            addr = addresses[rank]
            if rt.peer_dead(addr) is not None:
                if state is None or state.children is None:
                    raise RuntimeError(f"cannot restart {record.member(rank)}: its proc is gone and was not spawned here")
                addresses[rank] = state.replace(proc_ranks[rank], addr)
            display = member_display(prefix, rank, extent)
            rt.spawn_actor(addresses[rank], mesh_name, rank, labels, sizes, owner, None, display, is_async, payload)

        record.respawn = respawn
        mesh: ActorMesh[Any] = ActorMesh(Class, name, mesh_name, addresses, Shape.row_major(labels, sizes), prefix, extent, record, port.future)
        return mesh  # type: ignore[return-value]

    def _refuse_if_stopped(self, name: str) -> None:
        if self._state is not None and self._state.stopped is not None:
            stopped = self._state.stopped
            raise MeshStoppedError(f"cannot spawn on proc mesh {self._name}: it was stopped ({stopped})", actor=name,
                                   cause=Cause.of(stopped, CauseKind.STOPPED))

    @property
    def initialized(self) -> Future[bool]:
        """Completes with True once every proc is up (raises if one failed to start)."""
        state = self._state
        if state is None or not state.children:
            return Future.completed(True)
        return gather([c.ready for c in state.children], what="initialized").then(lambda _: True)

    def stop(self, reason: str = "stopped by client") -> Future[None]:
        """Stop every proc (actors' ``__cleanup__`` run, then the processes exit).

        Later spawns and calls on actors here fail at once with a clear error.
        """
        state = self._state
        if state is None:
            raise NotImplementedError("stop() is only available on the proc mesh its spawner holds, not on a reference")
        if state.agents is not None:
            return self._stop_remote(state, reason)
        if state.children is None:
            raise RuntimeError("this_proc() is the current process itself; it cannot be stopped")
        if state.stopped is None:
            state.stopped = reason
            for record in state.actor_records:
                if record.stopped is None:
                    record.stopped = reason
        rt = current_runtime()
        children = state.children
        stopped = stop_children(rt, children, rt.config.stop_timeout)
        done: Promise[None] = Promise()

        def flush() -> None:
            try:
                sink.flush()
            finally:
                done.set_result(None)

        def drain() -> None:
            # stop() flushes: the last lines of every proc are out before it completes.
            pumps = [p for c in children for p in c.pumps]
            when_done(gather(pumps, timeout_s=2.0, call_later=rt.loop_thread.call_later, what="reading the procs' last output"), flush)

        when_done(stopped, drain)
        return done.future

    def _stop_remote(self, state: _ProcMeshState, reason: str) -> Future[None]:
        rt = current_runtime()
        if state.stopped is None:
            state.stopped = reason
            for record in state.actor_records:
                if record.stopped is None:
                    record.stopped = reason
        agents = state.agents or []
        futures = [agent_mesh(agent).stop_procs.call_one(addrs, rt.config.stop_timeout) for agent, addrs in agents]
        stopped = Cause("the proc was stopped", CauseKind.STOPPED)

        def gone() -> None:
            # Whatever the agents answered (one may be gone: its procs died with it),
            # the procs are gone on purpose now.
            for _, addrs in agents:
                for a in addrs:
                    rt.loop.call_soon_threadsafe(functools.partial(rt.peer_gone, a, stopped, expected=True))
            sink.flush()

        every = gather(futures, timeout_s=rt.config.stop_timeout + 10, call_later=rt.loop_thread.call_later, what="stopping remote procs")
        return when_done(every, gone)

    async def logging_option(self, stream_to_client: bool = True, aggregate_window_sec: float | None = 3, level: int = logging.INFO) -> None:
        """Forward every proc's stdout/stderr to this controller, prefixed with
        ``[rank host]``; within ``aggregate_window_sec`` identical lines from many
        procs collapse into one ``[N similar log lines] ...``. ``level`` sets the
        Python logging level in the procs."""
        if aggregate_window_sec is not None and not stream_to_client:
            raise ValueError("aggregate_window_sec needs stream_to_client=True")
        if aggregate_window_sec is not None and not aggregate_window_sec > 0:
            raise ValueError(f"aggregate_window_sec must be > 0, got {aggregate_window_sec!r}")
        sink.configure(stream_to_client, aggregate_window_sec)
        if self._state is not None and (self._state.children or self._state.agents):
            # spawn() is typed to return the actor class (so endpoints type-check); it is an ActorMesh
            await cast("ActorMesh[_LogLevel]", self.spawn("_logging_level", _LogLevel, level)).initialized

    @property
    def host_mesh(self) -> Any:
        """The host these procs run on (a reference: it cannot stop or shut down the host)."""
        from ._host_mesh import HostMesh

        return HostMesh(_owned=False)

    async def __aenter__(self) -> ProcMesh:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._state is not None and self._state.children is not None:
            await self.stop()

    def __reduce__(self) -> tuple[Any, ...]:
        return (ProcMesh, (self._addresses, self._shape, self._name))

    def __len__(self) -> int:
        return len(self._shape)

    def __repr__(self) -> str:
        return f"<ProcMesh {self._name} {self._shape.extent}>"


class _LogLevel(Actor):
    """Sets the Python logging level of the proc it runs in."""

    def __init__(self, level: int) -> None:
        logging.getLogger().setLevel(level)


#: Proc meshes on remote hosts, so that they can be torn down with their hosts.
_remote_states: weakref.WeakValueDictionary[int, _ProcMeshState] = weakref.WeakValueDictionary()


def release_hosts(hosts: HostMesh, reason: str = "its hosts were released") -> None:
    """The hosts of ``hosts`` are going away on purpose (``job.kill()``, a host mesh
    shutdown): call this first. The proc meshes that live only on them are marked
    stopped (later calls fail at once with ``reason``), and the loss of their procs
    and agents is expected: it reaches no ``__supervise__`` and no
    ``unhandled_fault_hook``. Calls in flight to those procs still fail.
    """
    gone = set(hosts._agents or ())
    if not gone:
        return
    rt = current_runtime()
    for state in list(_remote_states.values()):
        mine = [(agent, addrs) for agent, addrs in state.agents or [] if agent in gone]
        if not mine:
            continue
        if len(mine) == len(state.agents or []) and state.stopped is None:
            state.stopped = reason
            for record in state.actor_records:
                if record.stopped is None:
                    record.stopped = reason
        for _, addrs in mine:
            for address in addrs:
                rt.expect_gone(address)
    for agent in gone:
        rt.expect_gone(agent)


_event_ports: dict[int, EventPort] = {}


def _event_port(rt: ProcRuntime) -> Any:
    handler = _event_ports.get(id(rt))
    if handler is None:
        handler = _event_ports[id(rt)] = EventPort(rt)
    return handler.port()


_this_procs: dict[int, ProcMesh] = {}


def this_proc() -> ProcMesh:
    """The current process as a one-proc mesh: actors spawned here share its pid."""
    return proc_mesh_for(current_runtime())


def proc_mesh_for(rt: ProcRuntime) -> ProcMesh:
    """The one-proc mesh of a runtime (cached)."""
    pm = _this_procs.get(id(rt))
    if pm is None:
        pm = ProcMesh([rt.address], Shape.unity(), rt.name, _ProcMeshState(None))
        _this_procs[id(rt)] = pm
    return pm


use_proc_view(proc_mesh_for)  # an actor's context().actor_instance.proc
