"""HostMesh: hosts to start procs on.

``this_host()`` is the local machine (extent ``{}``); a job's host mesh has a
``hosts`` dimension with one host agent per host. The mesh a job or
``this_host()`` hands out is *owned*: ``stop()`` stops every proc spawned
through it (the hosts stay, ready for more spawns or a later controller) and
``shutdown()`` also ends the hosts' worker loops, after which the mesh refuses
new spawns. Slices and unpickled copies are references: they can spawn, but
only the owned mesh stops or shuts down the hosts (Monarch's rule).
"""

from __future__ import annotations

import math
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from ..runtime import CLIENT_NAME, ChildProc, Future, Promise, context, current_runtime, gather, runtime_started, spawn_children, when_done
from ..transport import dumps
from ._bootstrap import BootstrapSpec, check_proc_bind, check_python, proc_commands
from ._host_agent import agent_mesh
from ._logs import pump, sink
from ._proc_mesh import ProcMesh, _event_port, _ProcMeshState, _remote_states, release_hosts
from ._progress import progress
from ._shape import Extent, MeshTrait, Point, Shape
from ._singleton import install_singleton_handler
from ._workspace import DEFAULT_EXCLUDE, WorkspaceSync, resolve_dirs, sync_workspace
from ._workspace_reload import WorkspaceReloader

if TYPE_CHECKING:
    from ..runtime import ProcRuntime
    from ._actor_mesh import ActorMesh

__all__ = ["HostMesh", "this_host"]


@dataclass
class _HostMeshState:
    """Shared by an owned host mesh and the copies ``with_python_executable`` makes."""

    proc_meshes: list[ProcMesh] = field(default_factory=list)
    shut_down: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class HostMesh(MeshTrait):
    """Hosts to start procs on; see the module docstring for owned vs reference meshes."""

    def __init__(self, shape: Shape | None = None, agents: list[str] | None = None, *, python: str | None = None,
                 _state: _HostMeshState | None = None, _owned: bool = True) -> None:
        self._shape = shape or (Shape.row_major(("hosts",), (len(agents),)) if agents else Shape.unity())
        self._agents = agents
        self._python = python
        self._state = _state if _state is not None else _HostMeshState()
        self._owned = _owned

    def _new_with_shape(self, shape: Shape) -> HostMesh:
        return HostMesh(shape, self._agents, python=self._python, _state=self._state, _owned=False)

    @property
    def initialized(self) -> Future[bool]:
        """Completes with True once every host agent answers (at once for the local host)."""
        if not self._agents:
            return Future.completed(True)
        futs = [agent_mesh(self._agents[self._shape.rank_at(i)]).info.call_one() for i in range(len(self._shape))]
        rt = current_runtime()
        return gather(futs, timeout_s=60, call_later=rt.loop_thread.call_later, what="host agents answering").then(lambda _: True)

    def host_info(self) -> Future[list[dict[str, Any]]]:
        """``hostname``, ``pid``, ``cpus`` and ``address`` of each host's agent, row-major.

        For this host (no agent) one entry with this process's pid and ``address`` ``"local"``.
        """
        if not self._agents:
            return Future.completed([{"hostname": socket.gethostname(), "pid": os.getpid(), "cpus": os.cpu_count(), "address": "local"}])
        futs = [agent_mesh(self._agents[self._shape.rank_at(i)]).info.call_one() for i in range(len(self._shape))]
        # No thread waits: the last answer (or the deadline) completes it.
        return gather(futs, timeout_s=60, call_later=current_runtime().loop_thread.call_later, what="host_info")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reference, (self._shape, self._agents, self._python))

    def with_python_executable(self, path: str) -> HostMesh:
        """The same hosts, whose procs spawned from the result run ``path -m actormesh.worker``.

        ``path`` is a Python interpreter on the hosts with actormesh importable
        (on the local host it must be an executable file). The hosts are shared:
        stopping either mesh stops procs spawned through both.
        """
        python = check_python(path)
        if not self._agents:
            from ..runtime import launch

            if not launch.is_executable(python):
                raise ValueError(f"with_python_executable({python!r}): not an executable file on this host")
        return HostMesh(self._shape, self._agents, python=python, _state=self._state, _owned=self._owned)

    def spawn_procs(self, per_host: dict[str, int] | None = None, bootstrap: Callable[[], Any] | None = None, name: str | None = None,
                    proc_bind: list[dict[str, str]] | None = None, bootstrap_command: BootstrapSpec = None) -> ProcMesh:
        """Start ``per_host`` procs on every host, e.g. ``per_host={"gpus": 4}``.

        ``bootstrap`` (sync or async, no arguments) runs on every proc before any
        actor. ``proc_bind`` (one dict per proc of a host) pins procs:
        ``cpunodebind``/``membind``/``physcpubind`` via numactl, ``cpus`` via
        sched_setaffinity. ``bootstrap_command`` (a ``BootstrapCommand``, or a
        function of the proc's ``Point`` returning one) replaces the command
        that starts each proc. Returns at once; ``.initialized`` waits for the procs.
        """
        per_host = dict(per_host or {})
        for label, size in per_host.items():
            if not isinstance(label, str):
                raise TypeError(f"per_host keys must be dimension names (str), got {label!r}")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"per_host[{label!r}] must be a positive int, got {size!r}")
        overlap = set(per_host) & set(self._shape.labels)
        if overlap:
            raise ValueError(f"per_host dims {sorted(overlap)} collide with the host mesh's dims {list(self._shape.labels)}")
        if bootstrap is not None and not callable(bootstrap):
            raise TypeError(f"bootstrap must be a callable taking no arguments, got {bootstrap!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if self._state.shut_down:
            raise RuntimeError("HostMesh has already been shut down")
        per = math.prod(per_host.values())
        binds = check_proc_bind(proc_bind, per)
        labels = (*self._shape.labels, *per_host)
        sizes = (*self._shape.sizes, *per_host.values())
        shape = Shape.row_major(labels, sizes)
        extent = Extent(labels, sizes)
        points = [Point(r, extent) for r in range(len(shape))]
        commands = proc_commands(points, bootstrap_command, binds, self._python, local=not self._agents)
        base = name or "anon"
        rt = current_runtime()
        install_singleton_handler(rt)  # before its first proc can ask the root for one
        me = context().actor_instance
        owner = me.name if me.is_actor else CLIENT_NAME
        if self._agents:
            pm = self._spawn_remote(rt, shape, per, base, bootstrap, owner, commands)
        else:
            pm = self._spawn_local(rt, shape, base, bootstrap, owner, commands)
        with self._state.lock:
            live = [m for m in self._state.proc_meshes if _running(m)]
            self._state.proc_meshes = [*live, pm]
        me.spawned(pm, _running)
        return pm

    def _spawn_local(self, rt: ProcRuntime, shape: Shape, base: str, bootstrap: Callable[[], Any] | None, owner: str, commands: Any) -> ProcMesh:
        names = [f"{base}-{i}" for i in range(len(shape))]
        host = socket.gethostname()

        def stdio(child: ChildProc, out: Any, err: Any) -> None:
            who = f"{child.name.rsplit('-', 1)[-1]} {host}"
            child.pumps = [pump(out, sink.line, who, "stdout"), pump(err, sink.line, who, "stderr")]

        children = spawn_children(rt, names, bootstrap=bootstrap, owner=owner, stdio=stdio, commands=commands)
        addresses = [c.address for c in children]
        return ProcMesh(addresses, shape, base, _ProcMeshState(children, bootstrap=bootstrap, owner=owner, addresses=addresses, commands=commands))

    def _spawn_remote(self, rt: ProcRuntime, shape: Shape, per: int, base: str, bootstrap: Callable[[], Any] | None, owner: str,
                      commands: Any) -> ProcMesh:
        blob = bytes(dumps(bootstrap, out_of_band=False)[0]) if bootstrap is not None else None
        port = _event_port(rt)
        timeout = rt.config.proc_spawn_timeout
        calls = []
        for h in range(len(self._shape)):
            agent = self._agents[self._shape.rank_at(h)]  # type: ignore[index]
            rt.reconnect(agent)  # an agent that was unreachable (a healed partition) is tried again
            ranks = range(h * per, (h + 1) * per)
            names = [f"{base}-{r}" for r in ranks]
            args: tuple[Any, ...] = (names, [str(r) for r in ranks], blob, port, timeout)
            if commands is not None:
                args = (*args, commands[h * per:(h + 1) * per])
            calls.append((agent, agent_mesh(agent).spawn_procs.call_one(*args)))
        agents: list[tuple[str, list[str]]] = []
        with progress(f"starting {per * len(calls)} procs on {len(calls)} hosts", len(calls)) as advance:
            for agent, fut in calls:
                agents.append((agent, fut.get(timeout=timeout + 10)))
                advance(1)
        for agent, addrs in agents:
            rt.judge_through(addrs, agent)  # a busy proc is not unreachable while its host answers
        addresses = [a for _, addrs in agents for a in addrs]
        state = _ProcMeshState(None, bootstrap=bootstrap, owner=owner, addresses=addresses, agents=agents)
        _remote_states[id(state)] = state  # so release_hosts() can tear it down with its hosts
        return ProcMesh(addresses, shape, base, state)

    def _check_owned(self, what: str) -> None:
        if not self._owned:
            raise NotImplementedError(f"{what}() is only available on the host mesh its job or this_host() handed out, "
                                      "not on a slice or a reference received from elsewhere")

    def stop(self) -> Future[None]:
        """Stop every proc spawned through this host mesh; the hosts stay up for later spawns
        (or a later controller). Completes when the procs have exited."""
        self._check_owned("stop")
        with self._state.lock:
            meshes, self._state.proc_meshes = list(self._state.proc_meshes), []
        futures = [pm.stop("the host mesh was stopped") for pm in meshes]
        return _all_done(futures, current_runtime().config.stop_timeout + 15, "stop")

    def shutdown(self) -> Future[None]:
        """Stop every proc, then end the hosts' worker loops: the hosts (and this mesh) are unusable after.

        On the local host this stops the procs spawned through this mesh and
        retires the mesh object (``this_host()`` hands out a fresh one).
        """
        self._check_owned("shutdown")
        stopped = self.stop()
        self._state.shut_down = True
        agents = list(self._agents or ())
        release_hosts(self, "its host mesh was shut down")  # deliberate: not a failure
        rt = current_runtime()
        done: Promise[None] = Promise()

        def end_agents() -> None:
            # Runs where ``stopped`` completed (maybe the loop thread): it only sends.
            error = stopped.exception(timeout=0)
            if error is not None:
                done.set_exception(error)
                return
            calls = [agent_mesh(a).shutdown_host.call_one() for a in agents]
            # An agent exits right after answering: its loss is as good as its answer.
            answered = gather(calls, timeout_s=rt.config.stop_timeout + 15, call_later=rt.loop_thread.call_later, what="host agents shutting down")
            when_done(answered, lambda: done.set_result(None))

        def guarded() -> None:
            try:
                end_agents()
            except BaseException as exc:
                done.set_exception(exc)

        when_done(stopped, guarded)
        return done.future

    def sync_workspace(self, workspace: Any, conda: bool = False, auto_reload: bool = False, *, dest: str | None = None,
                       exclude: Sequence[str] = DEFAULT_EXCLUDE) -> Future[WorkspaceSync]:
        """Ship local directories to every host of this mesh (Monarch's name); see docs/sync.md.

        ``workspace`` is a directory, a list of them, or an object with ``dirs``
        (Monarch's ``Workspace``: a list, or a dict of local dir -> name). Each
        lands on every host at ``<root>/<name>`` (``root``: ``dest``, else the
        host's ``ACTORMESH_WORKSPACE_DIR``, else a node-local temp dir), receiving
        only files whose content changed, swapped in atomically per directory.
        Procs the hosts start afterwards have it on ``sys.path``; with
        ``auto_reload`` the procs spawned through this mesh reload changed modules
        before the Future completes. ``await`` it or ``.get()`` it. Example::

            await hosts.sync_workspace(".", auto_reload=True)
        """
        if conda:
            raise NotImplementedError("sync_workspace(conda=True) is not supported: install the environment on the hosts (or use with_python_executable)")
        if isinstance(exclude, str):
            raise TypeError(f"exclude must be a list of glob patterns, got the string {exclude!r}")
        resolve_dirs(workspace)  # argument errors at the call site, not in the Future
        agents = [self._agents[self._shape.rank_at(i)] for i in range(len(self._shape))] if self._agents else None
        reload = self._reload_procs if auto_reload else None
        done: Promise[WorkspaceSync] = Promise()

        def run_now() -> None:
            try:
                done.set_result(sync_workspace(agents, workspace, dest=dest, exclude=tuple(exclude), reload=reload))
            except BaseException as exc:
                done.set_exception(exc)

        threading.Thread(target=run_now, name="actormesh-sync-workspace", daemon=True).start()
        return done.future

    def _reload_procs(self, paths: dict[str, dict[str, str]], changed: dict[str, list[str]]) -> list[str]:
        """Reload changed modules in every running proc spawned through this mesh (each with its host's paths)."""
        with self._state.lock:
            meshes = [m for m in self._state.proc_meshes if _running(m)]
        calls = []
        for pm in meshes:
            state = pm._state
            assert state is not None  # spawned through this host mesh, so it has its state
            # spawn() is typed to return the actor class (so endpoints type-check); it is an ActorMesh
            reloaders = cast("ActorMesh[WorkspaceReloader]", pm.spawn(f"workspace_reload_{os.urandom(4).hex()}", WorkspaceReloader))
            flat, start = reloaders.flatten("rank"), 0
            for agent, addrs in (state.agents or [("local", state.addresses)]):
                part = flat.slice(rank=slice(start, start + len(addrs)))
                calls.append((reloaders, part.reload.call(paths.get(agent, {}), changed)))
                start += len(addrs)
        names: set[str] = set()
        try:
            for _, fut in calls:
                for mods in fut.get(timeout=120).values():
                    names.update(mods)
        finally:
            for mesh in {id(r): r for r, _ in calls}.values():
                mesh.stop().get(timeout=60)
        return sorted(names)

    async def __aenter__(self) -> HostMesh:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._owned and not self._state.shut_down:
            await self.shutdown()

    def __repr__(self) -> str:
        return f"<HostMesh {self._shape.extent}>"


def _running(pm: ProcMesh) -> bool:
    return pm._state is None or pm._state.stopped is None


def _reference(shape: Shape, agents: list[str] | None, python: str | None) -> HostMesh:
    return HostMesh(shape, agents, python=python, _owned=False)


def _all_done(futures: list[Future[None]], timeout_s: float, what: str) -> Future[None]:
    """One future for many; the first error wins. Fails with TimeoutError if they
    are not all done within ``timeout_s``."""
    rt = current_runtime()
    return gather(futures, timeout_s=timeout_s, call_later=rt.loop_thread.call_later, what=what).then(lambda _: None)


_this_hosts: dict[int, HostMesh] = {}


def this_host() -> HostMesh:
    """The host the current code runs on (one owned mesh per runtime until it is shut down).

    Does not start the runtime: before it runs, each call gives a new mesh object.
    """
    if not runtime_started():
        return HostMesh()
    rt = current_runtime()
    hm = _this_hosts.get(id(rt))
    if hm is None or hm._state.shut_down:
        hm = _this_hosts[id(rt)] = HostMesh()
    return hm
