"""The per-process runtime: one event loop thread that owns the sockets, routes
messages to local actors and reply ports, and notices peers that are gone.

User code never runs on this loop: actors run on their own threads
(see ``_cell.py``). Handlers here are short and non-blocking.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..config import Config, get_config
from ..errors import Cause, CauseKind
from ..transport import Connection, JobTLS, Listener, Segment, ShmPool, listen, new_secret
from ._handlers import Handlers
from ._jobdir import make_job_dir, remove_job_dir
from ._loop import LoopThread
from ._cast import CastTables
from ._numbering import SeqOut
from ._ordering import Reorder
from ._links import LinkWatch
from ._peers import connection_closed, dial, peer_gone, revive, table_sizes
from ._routes import LocalRoute, Route
from ._threads import ThreadGroup
from ._receive import Receiving

if TYPE_CHECKING:
    from ._heartbeat import Heartbeat
    from ._spawn import ChildProc
    from ._supervision import MeshRecord
    from ._zygote import Zygote

log = logging.getLogger("actormesh.runtime")

__all__ = ["ProcRuntime"]

Envelope = Any  # a Message of any kind: code here branches on its .kind, which a type checker cannot narrow


class ProcRuntime(Receiving):
    """Everything one OS process needs to take part in a job. Its verbs (``call_actor``,
    ``cast``, ``spawn_actor``, ``stop_actor``, ``reply`` ...: _verbs.py) are the messages it sends;
    what it does with the messages it receives is in _receive.py.

    ``address`` is where peers reach this process. ``root_address`` is the
    controller's (for process-wide singletons); ``parent_address`` the process
    that spawned this one (None at the controller).
    """

    address: str
    root_address: str
    #: The gateway an attached client runtime goes through (None: a member of the job's network).
    attached_via: str | None = None

    def __init__(
        self,
        *,
        secret: bytes | None = None,
        name: str = "client",
        root_address: str | None = None,
        parent_address: str | None = None,
        job_dir: str | None = None,
        transport: str | None = None,
        listen_address: str | None = None,
        tls: JobTLS | None = None,
        handlers: Handlers | None = None,
    ) -> None:
        self.config: Config = get_config()
        self.secret = secret or new_secret()
        self.name = name
        self.pid = os.getpid()
        self.transport = transport or self.config.default_transport
        self._use_job_dir(job_dir, tls)
        self.loop_thread = LoopThread(f"actormesh-{name}-io")
        self.loop = self.loop_thread.loop
        self.parent_address = parent_address
        self.actors: dict[str, Any] = {}  # name -> _cell.Cell
        self.ports: dict[int, Any] = {}
        self._port_ids = itertools.count(1)
        self._routes: dict[str, Route | LocalRoute] = {}
        self._routes_lock = threading.Lock()
        self._waiting_on: dict[str, set[Any]] = {}
        self._early: dict[str, list[tuple[Envelope, Sequence[Segment]]]] = {}
        self.seq_out = SeqOut()
        #: Subtree addresses that senders' casts name by table id (_cast.py).
        self.cast_tables = CastTables()
        self._expected_gone: set[str] = set()
        #: Host agents that report how the procs they spawned ended (judge_through).
        self.reporters: set[str] = set()
        #: Routes of peers that are gone, most recent last (bounded: MAX_TOMBSTONES).
        self._dead: OrderedDict[str, Route] = OrderedDict()
        self._reorder = Reorder(self._release, lambda delay, fn: self.loop.call_later(delay, fn), min(5.0, self.config.message_delivery_timeout))
        self.closed = False
        #: Threads for work that may block off the loop (fault hooks...): joined at close.
        self.threads = ThreadGroup(f"runtime {name}")
        #: Actor meshes this process spawned and owns, by name (supervision: _supervision.py).
        self.owned_meshes: dict[str, MeshRecord] = {}
        #: Procs this process spawned, by address, and their liveness rounds, which
        #: start with the first spawn (_spawn.py).
        self.children: dict[str, ChildProc] = {}
        self.heartbeat: Heartbeat | None = None
        self.zygote: Zygote | None = None  # what its procs are forked from, from its first spawn
        #: What this process does with the kinds that are neither calls nor replies (_handlers.py).
        self.handlers = handlers if handlers is not None else Handlers()
        #: Sent in HELLO: why this process cannot serve (its bootstrap failed).
        self.hello_error: str | None = None
        self._listen_address = listen_address
        #: Large message buffers to same-host procs go through shared memory (transport/_shm.py).
        self.shm = ShmPool(self.config.shm_threshold_bytes, self.config.shm_pool_bytes)
        self._listener: Listener = self.loop_thread.run(self._listen(root_address), timeout=30)
        #: Liveness of links to peers on other hosts (runtime/_links.py).
        self.links = LinkWatch(self)
        self.links.start()

    def _use_job_dir(self, job_dir: str | None, tls: JobTLS | None) -> None:
        """The job's directory (made here if None given: then it goes on close) and
        certificates (generated when the config asks for TLS on tcp and none was given)."""
        #: Whether this runtime made its job directory (then it removes it on close).
        self.owns_job_dir = job_dir is None
        if job_dir is None:
            job_dir = make_job_dir()
        self.job_dir = job_dir
        self.tls = tls if tls is not None or not (self.config.tls and self.transport == "tcp") else JobTLS.generate()
        self._server_ssl = self.tls.server_context(job_dir) if self.tls else None
        self._client_ssl = self.tls.client_context(job_dir) if self.tls else None

    def __repr__(self) -> str:
        return f"<ProcRuntime {self.name} at {self.address}>"

    async def _listen(self, root_address: str | None) -> Listener:
        if self._listen_address is not None:
            addr = self._listen_address
        elif self.transport == "unix":
            addr = f"unix:{os.path.join(self.job_dir, f'{self.name}-{os.getpid()}.sock')}"
        else:
            addr = f"tcp:{self.config.bind_host}:0"
        listener = await listen(
            addr,
            self.secret,
            on_connection=self._on_connection,
            on_frame=self._on_frame,
            on_close=self._on_close,
            max_frame_bytes=self.config.codec_max_frame_length,
            handshake_timeout_s=self.config.handshake_timeout,
            ssl_context=self._server_ssl if addr.startswith("tcp:") else None,
            shm=self.shm,
            dead_after_s=self.config.link_timeout,
            bulk_lane_bytes=self.config.bulk_lane_bytes,
        )
        # Set on the loop thread before it can run any frame handler: a spawner that
        # chose our address may dial us (and send) the moment the socket exists.
        self.address = listener.address
        self.root_address = root_address or self.address
        self._routes[self.address] = LocalRoute(self, self.address, self._dispatch)
        return listener

    def in_loop(self) -> bool:
        """Whether the caller runs on the loop thread."""
        return threading.get_ident() == self.loop_thread.ident

    def call_soon_anywhere(self, fn: Callable[[], Any]) -> bool:
        """Run ``fn`` on the loop thread soon, from any thread; False if the loop is closed."""
        try:
            if threading.get_ident() == self.loop_thread.ident:
                self.loop.call_soon(fn)
            else:
                self.loop.call_soon_threadsafe(fn)
        except RuntimeError:
            return False
        return True

    # -- routes ---------------------------------------------------------------------------
    def route(self, address: str) -> Route | LocalRoute:
        """The route to ``address`` (created on first use)."""
        r = self._routes.get(address)
        if r is None:
            with self._routes_lock:
                r = self._routes.get(address) or self._dead.get(address)
                if r is None:
                    r = Route(self, address)
                    self._routes[address] = r
        return r

    def peer_dead(self, address: str) -> str | None:
        """Why ``address`` is gone for good, or None while it may be reached."""
        r = self._routes.get(address) or self._dead.get(address)
        return r.dead if r is not None else None

    def expect_child(self, address: str) -> Route:
        """Register a child proc's address: it dials us, we never dial it."""
        with self._routes_lock:
            r = Route(self, address, child=True)
            self._dead.pop(address, None)  # a TCP port can come back with a new proc
            self._routes[address] = r
        return r

    def messages_sent(self) -> int:
        """Messages this process has sent to other processes so far (all routes)."""
        return sum(r.sent for r in list(self._routes.values()) if isinstance(r, Route))

    def messages_batched(self) -> int:
        """Of those, how many went in a batch of several (a busy route's, see _routes)."""
        return sum(r.batched for r in list(self._routes.values()) if isinstance(r, Route))

    def start_dial(self, route: Route) -> None:
        """Begin connecting a route (any thread)."""

        def go() -> None:
            asyncio.ensure_future(self._dial(route))

        if self.in_loop():
            go()
        else:
            self.loop.call_soon_threadsafe(go)

    async def _dial(self, route: Route) -> None:
        await dial(self, route)

    def _on_connection(self, conn: Connection) -> None:
        pass  # an accepted peer identifies itself with HELLO as its first frame

    def _on_close(self, conn: Connection, exc: BaseException | None) -> None:
        connection_closed(self, conn)

    def peer_gone(self, address: str, reason: str, *, expected: bool = False) -> None:
        """A peer died or became unreachable: fail everything it owed us. Loop thread.

        ``reason`` is a :class:`~actormesh.errors.Cause` (text alone is taken as
        UNREACHABLE). ``expected`` (the proc was stopped on purpose, or named in
        :meth:`expect_gone`) skips supervision hooks. Supervision hears first:
        the hooks run before any caller's future fails for this cause, so an
        owner (or ``unhandled_fault_hook``) is never told later than a caller.
        """
        peer_gone(self, address, reason, expected)

    def judge_through(self, addresses: Sequence[str], agent: str) -> None:
        """Judge the remote procs at ``addresses`` through their host agent at ``agent``:
        while the agent answers they are busy, not unreachable (runtime/_links.py); when
        a connection to one closes, its calls wait for the agent's word on how it ended."""
        self.links.judge_through(addresses, agent)
        self.reporters.add(agent)
        for a in addresses:
            r = self.route(a)
            if isinstance(r, Route):
                r.reporter = agent

    def reconnect(self, address: str) -> bool:
        """Let a peer that was declared unreachable (not one that died) be dialed
        again on the next send, e.g. a host agent after a healed partition.
        True if it was unreachable. Loop thread or any thread."""
        return revive(self, address)

    def expect_gone(self, address: str) -> None:
        """The peer at ``address`` is being torn down on purpose (a job kill, a host
        mesh stop): its loss is not a failure and reaches no supervision hook."""
        self._expected_gone.add(address)

    def table_sizes(self) -> dict[str, int]:
        """Entries in this process's per-peer tables (diagnostics; tests check nothing leaks)."""
        return table_sizes(self)

    # -- reply ports ------------------------------------------------------------------------
    def register_port(self, handler: Any) -> int:
        """Give a reply handler a port id on this process."""
        pid = next(self._port_ids)
        self.ports[pid] = handler
        return pid

    def unregister_port(self, port_id: int) -> None:
        """Forget a port; late replies to it are dropped."""
        self.ports.pop(port_id, None)

    def await_peer(self, address: str, handler: Any) -> None:
        """``handler.peer_lost`` runs if ``address`` dies before ``unawait_peer``."""
        r = self._routes.get(address) or self._dead.get(address)
        if r is not None and r.dead is not None:
            self.loop.call_soon_threadsafe(handler.peer_lost, address, r.dead)
            return
        s = self._waiting_on.get(address)
        if s is None:
            s = self._waiting_on.setdefault(address, set())
        s.add(handler)

    def unawait_peer(self, address: str, handler: Any) -> None:
        s = self._waiting_on.get(address)
        if s is not None:
            s.discard(handler)

    # -- shutdown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Close listener and connections and stop the loop (idempotent)."""
        if self.closed:
            return
        self.closed = True

        def shut() -> None:
            self.links.stop()
            self._listener.close()
            for r in list(self._routes.values()):
                if isinstance(r, Route) and r.conn is not None:
                    r.conn.close()

        try:
            self.loop_thread.run(_call(shut), timeout=2)
        except Exception:
            pass
        self.loop_thread.stop()
        # Every waiter belongs to something that fails it when it closes.
        for handler in list(self.ports.values()):
            abort = getattr(handler, "abort", None)
            try:
                if abort is not None:
                    abort(Cause(f"the runtime of {self.address} was shut down", CauseKind.STOPPED))
            except Exception:
                log.exception("failing a port at shutdown failed")
        self.ports.clear()
        self.threads.join(2.0)
        self.shm.close()
        if self.owns_job_dir:
            remove_job_dir(self.job_dir)

    def flush(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until what this process has sent is in the kernel:
        routes still dialing have connected and written their queue, and no connection
        holds unwritten frames. A proc that is about to exit calls it, so that a message
        its actors sent just before the stop still leaves. True if everything left."""

        async def drained() -> bool:
            deadline = self.loop.time() + timeout_s
            while any(r.sending for r in list(self._routes.values()) if isinstance(r, Route)):
                if self.loop.time() >= deadline:
                    return False
                await asyncio.sleep(0.005)  # a dial or a socket write finishing: polled, bounded by the deadline
            return True

        try:
            return bool(self.loop_thread.run(drained(), timeout=timeout_s + 1.0))
        except Exception:
            return False

    def release_files(self) -> None:
        """Before ``os._exit``: stop accepting, remove this process's socket file and,
        if this runtime made it, the job directory (any thread; bounded)."""
        try:
            self.loop_thread.run(_call(self._listener.close), timeout=2)
        except Exception:
            self._listener.close()  # the loop is wedged: unlink from here
        if self.owns_job_dir:
            remove_job_dir(self.job_dir)


async def _call(fn: Callable[[], None]) -> None:
    fn()
    await asyncio.sleep(0)
