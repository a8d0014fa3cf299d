"""The host agent: one process per host that starts, watches and stops that
host's procs for a remote controller, and forwards their output and exits.

Run it with ``python -m actormesh.host --address tcp:0.0.0.0:PORT --secret-file F``
(a scheduler does this on every node), optionally ``--controller tcp:HOST:PORT``
so that it dials the controller and announces itself. The agent is an actor
(``HostAgent``, at the fixed name ``host_agent``) in a runtime of its own, so
the controller talks to it with ordinary endpoint calls over authenticated
channels. Procs it spawns are its children: they die with it.

The agent is the liveness judge of its procs (``runtime/_liveness.py``, run by
the spawner of every proc): it sees them through the OS, so a busy proc is kept
however long it is silent, and a proc that exited, was stopped or hung is
reported to the controller with that cause as ``("exit", address, cause)``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

from ..runtime import (
    Actor,
    ChildProc,
    Future,
    Port,
    Promise,
    current_runtime,
    endpoint,
    spawn_children,
    stop_children,
)
from ..transport import dumps
from ._logs import pump

if TYPE_CHECKING:
    from ..runtime import ProcRuntime

log = logging.getLogger("actormesh.host")

__all__ = ["HostAgent", "AGENT_NAME", "agent_mesh", "serve_agent", "EventPort", "shutdown_requested"]

AGENT_NAME = "host_agent"


class HostAgent(Actor):
    """Spawns and stops procs on its host on behalf of a controller."""

    def __init__(self) -> None:
        self.children: dict[str, ChildProc] = {}
        self.events: dict[str, Port[Any]] = {}
        #: child address -> the controller that asked for it (where its events go)
        self.owners: dict[str, str] = {}
        self._pumps: dict[str, list[threading.Thread]] = {}
        self.shut_down = False
        self._stores: dict[str, Any] = {}  # workspace root -> WorkspaceStore
        rt = current_runtime()
        rt.handlers.peer_lost.append(self._lost)

    def _lost(self, address: str, reason: str) -> None:
        """A peer is gone (loop thread): report a child's exit, or stop a departed controller's procs."""
        port = self.events.pop(address, None)
        self.owners.pop(address, None)
        if port is not None:
            port.send(("exit", address, reason))
        orphans = [self.children.pop(a) for a, owner in list(self.owners.items()) if owner == address and a in self.children]
        if not orphans:
            return
        # An agent serves one controller after another: nobody else would ever stop these.
        log.warning("controller %s is gone (%s): stopping its %d procs on this host", address, reason, len(orphans))
        for c in orphans:
            self.events.pop(c.address, None)
            self.owners.pop(c.address, None)
        rt = current_runtime()
        stop_children(rt, orphans, rt.config.stop_timeout)  # bounded: it kills what is left at the deadline

    @endpoint
    def info(self) -> dict[str, Any]:
        """Hostname, pid, cpu count and address of this agent."""
        return {"hostname": socket.gethostname(), "pid": os.getpid(), "cpus": os.cpu_count(), "address": current_runtime().address}

    @endpoint
    def spawn_procs(self, names: list[str], labels: list[str], bootstrap_blob: bytes | None, events: Port[Any], timeout_s: float,
                    commands: list[Any] | None = None) -> list[str]:
        """Start one proc per name; return their addresses once all are ready.

        ``commands[i]`` (a ``runtime.launch.ProcCommand``), when given, launches proc ``i``.

        Output lines and unexpected exits are sent to ``events`` as
        ``("log", who, stream, line)`` and ``("exit", address, cause)``.
        """
        rt = current_runtime()
        host = socket.gethostname()
        who_of = dict(zip(names, labels))

        def stdio(child: ChildProc, out: Any, err: Any) -> None:
            who = f"{who_of.get(child.name, child.name)} {host}"

            def deliver(who: str, stream: str, line: str) -> None:
                events.send(("log", who, stream, line))

            pump(out, deliver, who, "stdout")
            pump(err, deliver, who, "stderr")

        if self.shut_down:
            raise RuntimeError("this host was shut down (HostMesh.shutdown()); start its worker loop again to use it")
        children = spawn_children(rt, names, bootstrap_blob=bootstrap_blob, stdio=stdio, commands=commands)
        for c in children:
            self.children[c.address] = c
            self.events[c.address] = events
            self.owners[c.address] = events.ref[0]
        for c in children:
            c.ready.get(timeout=timeout_s)
        return [c.address for c in children]

    @endpoint
    def stop_procs(self, addresses: list[str], timeout_s: float) -> None:
        """Stop these procs (their actors' ``__cleanup__`` run); kill after ``timeout_s``."""
        rt = current_runtime()
        children = [self.children.pop(a) for a in addresses if a in self.children]
        for c in children:
            self.events.pop(c.address, None)
            self.owners.pop(c.address, None)
        stop_children(rt, children, timeout_s).get(timeout=timeout_s + 5)


    # -- HostMesh.sync_workspace (see _workspace_store.py) ------------------------------------
    def _store(self, dest: str | None) -> Any:
        from ._workspace_store import WorkspaceStore, default_workspace_root

        root = os.path.abspath(os.path.expanduser(dest)) if dest else default_workspace_root()
        if root not in self._stores:
            self._stores[root] = WorkspaceStore(root)
        return self._stores[root]

    @endpoint
    def workspace_begin(self, dest: str | None, manifests: dict[str, Any]) -> tuple[str, list[str]]:
        """Start receiving ``{name: manifest}`` into ``dest`` (default: this host's workspace root)."""
        return self._store(dest).begin(manifests)

    @endpoint
    def workspace_put(self, dest: str | None, sid: str, digest: str, offset: int, data: bytes) -> None:
        """One chunk of one content of session ``sid``."""
        self._store(dest).put(sid, digest, offset, data)

    @endpoint
    def workspace_commit(self, dest: str | None, sid: str) -> dict[str, Any]:
        """Swap the session's directories in; procs this agent starts later import from them."""
        result = self._store(dest).commit(sid)
        paths = [r["path"] for r in result.values()]
        old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *old])
        return result

    @endpoint
    def workspace_abort(self, dest: str | None, sid: str) -> None:
        """Drop session ``sid`` and what it staged."""
        self._store(dest).abort(sid)

    @endpoint
    def shutdown_host(self) -> None:
        """Stop every proc on this host, then end this agent's worker loop (HostMesh.shutdown())."""
        rt = current_runtime()
        self.shut_down = True
        children = list(self.children.values())
        self.children.clear()
        self.events.clear()
        self.owners.clear()
        timeout = rt.config.stop_timeout
        stop_children(rt, children, timeout).get(timeout=timeout + 5)
        _shutdown(rt).set_result(None)


_shutdowns: dict[int, Promise[None]] = {}


def _shutdown(runtime: ProcRuntime) -> Promise[None]:
    promise = _shutdowns.get(id(runtime))
    if promise is None:
        promise = _shutdowns[id(runtime)] = Promise()
    return promise


def shutdown_requested(runtime: ProcRuntime) -> Future[None]:
    """A Future that completes when a controller shuts this agent's host down."""
    return _shutdown(runtime).future


class EventPort:
    """Controller-side handler of an agent's events: logs to the sink, exits to
    the runtime (so calls waiting on a dead remote proc fail at once)."""

    def __init__(self, runtime: ProcRuntime) -> None:
        from ._logs import sink

        self.runtime = runtime
        self.sink = sink
        self.port_id = runtime.register_port(self)

    def port(self) -> Port[Any]:
        return Port(self.runtime.address, self.port_id)

    def deliver(self, env: tuple[Any, ...], payload: Any) -> None:
        from ..transport import loads

        event = loads(payload)
        if event[0] == "log":
            self.sink.line(event[1], event[2], event[3])
        elif event[0] == "exit":
            self.runtime.peer_gone(event[1], event[2])

    def peer_lost(self, address: str, reason: str) -> None:
        pass


def agent_mesh(address: str) -> Any:
    """An actor-mesh reference to the host agent listening at ``address``."""
    from ._actor_mesh import ActorMesh
    from ._shape import Extent, Shape

    return ActorMesh(HostAgent, AGENT_NAME, AGENT_NAME, [address], Shape.unity(), f"<host_agent@{address}", Extent((), ()))


def serve_agent(address: str, secret: bytes, controller: str | None = None, name: str | None = None, tls: Any = None) -> Any:
    """Run a host agent in this process (returns its runtime; serve until it closes).

    With ``controller``, the agent dials it and announces itself (JOIN). With
    ``tls`` (a ``JobTLS``), its TCP channels and its procs' use mutual TLS.
    """
    from ..runtime import ProcRuntime, serve_gateway, set_runtime
    from ._singleton import install_singleton_handler

    transport = "unix" if address.startswith("unix:") else "tcp"
    rt = ProcRuntime(secret=secret, name=name or f"host-{socket.gethostname()}", listen_address=address, transport=transport, tls=tls)
    set_runtime(rt)
    install_singleton_handler(rt)  # the agent is its procs' root: their get_or_spawn_controller comes here
    serve_gateway(rt)  # clients outside the job's network attach here (Monarch's attach())
    payload = dumps((HostAgent, (), {}))
    rt.spawn_actor(rt.address, AGENT_NAME, 0, (), (), None, None, f"<host_agent@{rt.address}>", False, payload)
    if controller:
        rt.announce(controller, socket.gethostname(), os.getpid())
    return rt


def join_listener(runtime: ProcRuntime, on_join: Any) -> None:
    """Call ``on_join(address, hostname, pid)`` (loop thread) for every agent that dials in."""
    runtime.handlers.join.append(on_join)
