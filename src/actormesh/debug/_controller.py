"""The job's debug controller: one actor in the controller that holds every paused session.

``debug_controller()`` (Monarch's name) returns it, spawning it on first use
with ``get_or_spawn_controller``. Actors that hit ``breakpoint()`` register
sessions with it (see ``_hook``); a console drives them (see ``_console``):
the controller's own terminal through ``enter``, or ``actormesh debug``
through the debug socket it listens on from the start (see ``_server``). One
console at a time: a second one is refused with a message saying who holds it.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import sys
import threading
from typing import Any, Optional

from ..config import get_config
from ..runtime import Actor, Port, concurrent_endpoint, current_runtime, endpoint
from ..transport import Connection, new_secret
from ._commands import TICK, SessionInfo, format_sessions
from ._console import Console, ConsoleIO, Session, StdIO
from ._server import KEY_NAME, MAX_FRAME_BYTES, SOCKET_NAME, ConnIO, write_key

log = logging.getLogger("actormesh.debug")

__all__ = ["DebugController", "debug_controller", "CONTROLLER_NAME", "controller_is_interactive"]

CONTROLLER_NAME = "debug_controller"
_CI_VARIABLES = ("CI", "GITHUB_ACTIONS", "GITLAB_CI", "BUILDKITE", "JENKINS_URL", "TF_BUILD", "TEAMCITY_VERSION")


def controller_is_interactive() -> bool:
    """Whether a person may be at this process's terminal: stdin is a TTY and no CI variable is set."""
    for name in _CI_VARIABLES:
        value = os.environ.get(name, "")
        if value and value.lower() not in ("0", "false", "no"):
            return False
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError, OSError):
        return False


class DebugController(Actor):
    """Holds the paused sessions of the job and serves the debug console.

    Endpoints for consoles and scripts: ``list()``, ``enter()`` (the console on
    this process's terminal, until ``quit``), ``wait_pending_session(timeout_s)``,
    ``server_address()``. The ``session_*`` endpoints are the paused actors' side.
    """

    def __init__(self) -> None:
        self.sessions: dict[tuple[str, int], Session] = {}
        self.console_holder: Optional[str] = None
        self.timeout_s = get_config().debug_attach_timeout
        self._new_session = asyncio.Condition()
        self._listener: Any = None
        self._job_dir = current_runtime().job_dir
        loop = asyncio.get_running_loop()
        # A paused actor whose proc dies leaves the list (the hook runs on the runtime's I/O thread).

        def peer_hook(address: str, reason: str) -> None:
            loop.call_soon_threadsafe(self._peer_lost, address, reason)

        self._peer_hook = peer_hook
        current_runtime().handlers.peer_lost.append(self._peer_hook)
        self._serving = asyncio.ensure_future(self._serve())
        self._tasks: set[asyncio.Future[Any]] = {self._serving, asyncio.ensure_future(self._tick())}

    # -- the paused actors' side --------------------------------------------------------
    @endpoint
    async def session_start(self, info: SessionInfo, inbox: Port[str]) -> Optional[str]:
        """Register a paused actor; None: wait for a console, else why the breakpoint is skipped."""
        old = self.sessions.get(info.key)
        if old is not None and not old.ended:
            return f"{info.actor} rank {info.rank} already has a debug session (one per actor at a time)"
        if self.console_holder is None and not controller_is_interactive():
            return ("no debug console is connected and the controller is not interactive (no TTY, or a CI "
                    "variable is set); connect one with `actormesh debug` (call debug_controller() early so it "
                    "can connect before the breakpoint)")
        inbox.return_undeliverable = False  # a session whose proc died is not the console's failure
        self.sessions[info.key] = Session(info, inbox)
        if self.console_holder is None:
            log.warning("%s rank %d paused in breakpoint() at %s: run `actormesh debug` within %.0fs "
                        "(debug_attach_timeout) to debug it, or it continues", info.actor, info.rank, info.where,
                        self.timeout_s)
        async with self._new_session:
            self._new_session.notify_all()
        return None

    @endpoint
    async def session_output(self, actor: str, rank: int, text: str, waiting: bool, function: str, filename: str,
                             lineno: int) -> None:
        """pdb output of a session; ``waiting``: it is at its prompt."""
        session = self.sessions.get((actor, rank))
        if session is not None:
            await session.on_output(text, waiting, function, filename, lineno)

    @endpoint
    async def session_end(self, actor: str, rank: int) -> None:
        """The actor continued: forget its session."""
        session = self.sessions.pop((actor, rank), None)
        if session is not None:
            await session.on_end()

    # -- consoles and scripts -------------------------------------------------------------
    @endpoint
    async def list(self, print_output: bool = True) -> list[SessionInfo]:
        """The paused sessions (printed on the controller's stdout when ``print_output``)."""
        infos = sorted((s.info for s in self.sessions.values()), key=lambda i: i.key)
        if print_output:
            sys.stdout.write(format_sessions(infos, {k: s.state for k, s in self.sessions.items()}))
            sys.stdout.flush()
        return infos

    @endpoint
    async def server_address(self) -> str:
        """The debug socket ``actormesh debug`` connects to."""
        await asyncio.shield(self._serving)
        return self._listener.address

    @concurrent_endpoint
    async def wait_pending_session(self, timeout_s: Optional[float] = None) -> None:
        """Return once some actor is paused; TimeoutError after ``timeout_s`` (default debug_attach_timeout)."""
        async with self._new_session:
            try:
                await asyncio.wait_for(self._new_session.wait_for(lambda: bool(self.sessions)), timeout_s or self.timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no actor paused in breakpoint() within {timeout_s or self.timeout_s:.0f}s") from None

    @concurrent_endpoint
    async def enter(self) -> None:
        """Run the console on this process's terminal until ``quit`` (or end of input)."""
        if self.console_holder is not None:
            raise RuntimeError(f"a debug console is already connected ({self.console_holder}); quit it first")
        await self._run_console(StdIO(), "the controller's terminal")

    async def _run_console(self, io: ConsoleIO, holder: str) -> None:
        self.console_holder = holder
        try:
            await Console(self.sessions, io, self.timeout_s).run()
        finally:
            self.console_holder = None

    # -- the debug socket -----------------------------------------------------------------
    async def _serve(self) -> None:
        from ..transport import listen

        key = new_secret()
        write_key(self._job_dir, key)
        path = os.path.join(self._job_dir, SOCKET_NAME)
        cfg = get_config()
        self._listener = await listen(
            f"unix:{path}", key, on_connection=self._on_console, on_frame=self._on_frame, on_close=self._on_close,
            max_frame_bytes=MAX_FRAME_BYTES, handshake_timeout_s=cfg.handshake_timeout,
        )

    def _on_console(self, conn: Connection) -> None:
        io = ConnIO(conn)
        conn.tag = io
        if self.console_holder is not None:
            io.close(f"another debug console is connected ({self.console_holder}); quit it first", code=1)
            return
        task = asyncio.ensure_future(self._run_console(io, "actormesh debug"))
        self._tasks.add(task)
        def done(t: asyncio.Future[Any]) -> None:
            self._tasks.discard(t)
            io.close("the job ended; the debug console closes" if t.cancelled() else "")

        task.add_done_callback(done)

    def _on_frame(self, conn: Connection, frame: builtins.list[Any]) -> None:  # ``list`` here is the endpoint
        if isinstance(conn.tag, ConnIO):
            conn.tag.feed(frame)

    def _on_close(self, conn: Connection, exc: Optional[BaseException]) -> None:
        if isinstance(conn.tag, ConnIO):
            conn.tag.feed_closed()

    async def _tick(self) -> None:
        """While a console is connected, tell paused actors to keep waiting (see ``_hook``)."""
        while True:
            await asyncio.sleep(max(0.05, self.timeout_s / 4))
            if self.console_holder is None:
                continue
            for session in list(self.sessions.values()):
                if not session.ended:
                    try:
                        session.inbox.send(TICK)  # type: ignore[attr-defined]
                    except Exception as exc:  # its proc is gone: the session goes with it
                        log.info("dropping the debug session of %s rank %d: %s", session.info.actor, session.info.rank, exc)
                        self.sessions.pop(session.info.key, None)

    def _peer_lost(self, address: str, reason: str) -> None:
        for key, session in list(self.sessions.items()):
            if session.inbox.ref[0] == address:  # type: ignore[attr-defined]
                del self.sessions[key]
                task = asyncio.ensure_future(session.on_lost(reason))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def __cleanup__(self, exc: Optional[BaseException]) -> None:
        try:
            current_runtime().handlers.peer_lost.remove(self._peer_hook)
        except ValueError:
            pass
        if self._listener is not None:
            self._listener.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=1.0)
        for name in (SOCKET_NAME, KEY_NAME):
            try:
                os.unlink(os.path.join(self._job_dir, name))
            except OSError:
                pass


_cache: dict[str, Any] = {}
_cache_lock = threading.Lock()


def debug_controller() -> Any:
    """The job's :class:`DebugController` actor (an ActorMesh of one), spawned on first use.

    Works from the controller and from any actor. In the controller it also
    starts the debug socket that ``actormesh debug`` connects to: call it early
    in a script that runs without a terminal. Example::

        from actormesh.actor import debug_controller
        debug_controller().enter.call_one().get()   # the console on this terminal
    """
    from ..mesh import get_or_spawn_controller
    from ._hook import install_breakpoint_hook

    rt = current_runtime()
    with _cache_lock:
        mesh = _cache.get(rt.address)
        if mesh is None:
            install_breakpoint_hook()  # actors on the controller's own proc pause the same way
            cfg = get_config()
            mesh = get_or_spawn_controller(CONTROLLER_NAME, DebugController).get(timeout=cfg.connect_timeout + cfg.proc_spawn_timeout)
            if rt.root_address == rt.address:  # the controller: `actormesh debug` can connect once this returns
                mesh.server_address.call_one().get(timeout=cfg.connect_timeout)
            _cache.clear()
            _cache[rt.address] = mesh
    return mesh
