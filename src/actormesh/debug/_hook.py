"""``breakpoint()`` inside an actor: a pdb whose terminal is the controller's debug console.

Theory of operation
-------------------
:func:`install_breakpoint_hook` replaces ``sys.breakpointhook`` and
``pdb.set_trace`` in a process. Called outside an actor (the controller's own
script, a plain thread) they behave as before. Called inside an actor they
register a session with the job's :class:`DebugController` (a singleton actor in
the controller) and hand it a port for input; the controller answers at once
whether anyone can debug (a console is connected, or the controller runs on a
terminal). If not, the breakpoint is skipped with a logged warning naming the
actor and ``file:line``.

Otherwise a :class:`RemotePdb` stops in the caller's frame. Only the calling
thread is traced and blocked: a sync actor's own thread, or an async actor's own
loop. The proc's I/O loop and every other actor go on serving. pdb's output is
buffered and sent to the controller each time pdb wants a line (with the
prompt); its input is the next line the console sends to the port.

Deadline: while a console is connected the controller sends a keep-alive tick
to every paused session several times per ``debug_attach_timeout``. A session
that hears nothing (no line, no tick) for that long clears its breakpoints and
continues, with a warning: no console, a console that quit, or a controller that
is gone never leaves an actor paused for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pdb
import socket
import sys
from types import FrameType
from typing import Any, Iterator

from ..config import get_config
from ..runtime import Channel, context, runtime_started
from ._commands import RESUME, TICK, SessionInfo

log = logging.getLogger("actormesh.debug")

__all__ = ["install_breakpoint_hook", "breakpoint_hook", "RemotePdb"]

_CONTROLLER_CLASS = "actormesh.debug._controller.DebugController"
#: Frames of these modules are never stepped into (the runtime around an endpoint).
_SKIP = ["actormesh.runtime.*", "actormesh.debug.*", "asyncio.*", "threading", "concurrent.futures.*"]


def install_breakpoint_hook() -> None:
    """Route ``breakpoint()`` and ``pdb.set_trace()`` in this process's actors to the debug console.

    Idempotent. Outside actors both keep their usual behaviour (``PYTHONBREAKPOINT``
    is honoured there). Workers call this at start; so does :func:`debug_controller`
    in the controller, for actors spawned on the controller's own proc.
    """
    sys.breakpointhook = breakpoint_hook
    pdb.set_trace = _set_trace


def _actor_instance() -> Any:
    """The actor running on this thread, or None (no runtime, or not inside an actor)."""
    if not runtime_started():
        return None
    inst = context().actor_instance
    if getattr(inst, "rank", None) is None or inst.class_name == _CONTROLLER_CLASS:
        return None  # the client (no rank), or the debugger itself
    return inst


def breakpoint_hook(*args: Any, **kwargs: Any) -> None:
    """``sys.breakpointhook``: a remote pdb session inside an actor, the usual one elsewhere.

    ``PYTHONBREAKPOINT=0`` turns every ``breakpoint()`` off, in actors too.
    """
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return
    frame = sys._getframe(1)
    if _actor_instance() is None:
        if os.environ.get("PYTHONBREAKPOINT") is not None:
            sys.__breakpointhook__(*args, **kwargs)
        else:
            pdb.Pdb().set_trace(frame)
        return
    pause(frame)


def _set_trace(*, header: str | None = None) -> None:
    frame = sys._getframe(1)
    if _actor_instance() is None:
        debugger = pdb.Pdb()
        if header is not None:
            debugger.message(header)
        debugger.set_trace(frame)
        return
    pause(frame, header=header)


@contextlib.contextmanager
def _outside_loop() -> Iterator[None]:
    """Block an async actor's loop on purpose: only that actor pauses (see the module doc).

    ``Future.get`` warns when called on a running loop; here blocking it is the point.
    """
    loop = asyncio._get_running_loop()
    asyncio._set_running_loop(None)
    try:
        yield
    finally:
        asyncio._set_running_loop(loop)


def _spawn_name(actor_name: str) -> str:
    """The name the actor mesh was spawned with (the runtime appends ``-<12 hex>`` to make it unique)."""
    base, _, tag = actor_name.rpartition("-")
    return base if base and len(tag) == 12 and all(c in "0123456789abcdef" for c in tag) else actor_name


def _session_info(inst: Any, frame: FrameType) -> SessionInfo:
    point = inst.rank
    rank = int(getattr(point, "rank", 0))
    try:
        coords = {str(k): int(v) for k, v in dict(point).items()}
    except (TypeError, ValueError):
        coords = {}
    return SessionInfo(
        actor=_spawn_name(inst.name), rank=rank, coords=coords, host=socket.gethostname(), pid=os.getpid(),
        function=frame.f_code.co_name, filename=frame.f_code.co_filename, lineno=frame.f_lineno,
    )


def pause(frame: FrameType, header: str | None = None) -> None:
    """Register a session for the current actor and stop in ``frame`` (or skip, logged)."""
    from ._controller import debug_controller

    info = _session_info(_actor_instance(), frame)
    cfg = get_config()
    with _outside_loop():
        try:
            controller = debug_controller()
            port, inbox = Channel.open()
            verdict = controller.session_start.call_one(info, port).get(timeout=cfg.connect_timeout + cfg.message_delivery_timeout)
        except Exception as exc:
            log.warning("breakpoint() in %s rank %d at %s skipped: the debug controller could not be reached: %s",
                        info.actor, info.rank, info.where, exc)
            return
    if verdict is not None:
        inbox.close()
        log.warning("breakpoint() in %s rank %d at %s skipped: %s", info.actor, info.rank, info.where, verdict)
        return
    debugger = RemotePdb(controller, info, inbox, cfg.debug_attach_timeout)
    if header is not None:
        debugger.message(header)
    debugger.set_trace(frame)


class _Reader:
    """pdb's stdin: flush pdb's output with its prompt, then wait for the console's next line."""

    def __init__(self, session: RemotePdb) -> None:
        self._session = session
        self._pending: Any = None  # a recv() future that timed out keeps its claim

    def readline(self) -> str:
        s = self._session
        s.send_output(waiting=True)
        while True:
            if self._pending is None:
                self._pending = s.inbox.recv()
            try:
                with _outside_loop():
                    msg = self._pending.get(timeout=s.timeout_s)
            except TimeoutError:
                log.warning("breakpoint() in %s rank %d at %s: no debugger for %.0fs (debug_attach_timeout); continuing",
                            s.info.actor, s.info.rank, s.where(), s.timeout_s)
                return s.resume_line()
            except Exception as exc:  # the port was closed under us
                log.warning("debug session of %s rank %d ended: %s; continuing", s.info.actor, s.info.rank, exc)
                return s.resume_line()
            self._pending = None
            if msg == TICK:
                continue
            if msg == RESUME:
                return s.resume_line()
            return str(msg) + "\n"


class _Writer:
    """pdb's stdout: text is kept until pdb asks for input (one message per prompt)."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass  # sent with the prompt, see _Reader.readline

    def take(self) -> str:
        text, self.parts = "".join(self.parts), []
        return text


class RemotePdb(pdb.Pdb):
    """A pdb stopped in an actor, driven from the controller's console.

    ``c`` with no breakpoints left (or ``continue`` at the console, or the deadline)
    ends the session; ``q`` ends it and raises ``bdb.BdbQuit`` in the endpoint,
    so its caller gets an error, as with pdb in a plain program.
    """

    def __init__(self, controller: Any, info: SessionInfo, inbox: Any, timeout_s: float) -> None:
        self._out = _Writer()
        super().__init__(stdin=_Reader(self), stdout=self._out, skip=_SKIP, nosigint=True, readrc=False)  # type: ignore[arg-type]
        self.controller = controller
        self.info = info
        self.inbox = inbox
        self.timeout_s = timeout_s
        self._ended = False

    def where(self) -> str:
        """``file:line`` of the frame pdb is in now."""
        f = self.curframe
        return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else self.info.where

    def send_output(self, waiting: bool) -> None:
        """Send pdb's pending output; ``waiting``: pdb now waits for a command."""
        f = self.curframe
        function, filename, lineno = (f.f_code.co_name, f.f_code.co_filename, f.f_lineno) if f is not None else ("", "", 0)
        self.controller.session_output.broadcast(self.info.actor, self.info.rank, self._out.take(), waiting, function, filename, lineno)

    def print_stack_trace(self, count: int | None = None) -> None:
        """``where [count]``, without the runtime's frames below the endpoint (the thread, the actor loop)."""
        entries = [e for e in self.stack if not self.is_skipped_module(e[0].f_globals.get("__name__", ""))]
        for frame_lineno in entries[-count:] if count else entries:
            self.print_stack_entry(frame_lineno)

    def resume_line(self) -> str:
        """Clear breakpoints and continue: the session ends."""
        self.clear_all_breaks()
        return "c\n"

    def do_clear(self, arg: str) -> Any:
        """``clear`` with no argument clears every breakpoint without asking (no terminal to ask on)."""
        if not arg:
            self.clear_all_breaks()
            self.message("Deleted all breakpoints")
            return None
        return super().do_clear(arg)

    def set_continue(self) -> None:
        super().set_continue()
        if not self.breaks:
            self._end()

    def set_quit(self) -> None:
        super().set_quit()
        self._end()

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        self.send_output(waiting=False)
        self.controller.session_end.broadcast(self.info.actor, self.info.rank)
        self.inbox.close()

