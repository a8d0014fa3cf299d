"""A live actor in this process: its thread, its mailbox, its lifecycle.

Theory of operation
-------------------
The loop thread ``post``s envelopes; the actor's own thread handles them one at
a time, so user code never runs on the loop and one slow actor delays nobody
else. Both kinds take from one mailbox (``_mailbox``) a batch per wake-up, so a
burst costs one wake-up; they differ in how they sleep on it (a sync actor's
thread on a lock, an async actor's own event loop on an event) and whether they
call or await the endpoint. Either way a call goes through the same steps
(``_cell_invoke``).

States: ``init`` -> ``running`` -> ``stopped`` | ``failed``. A failed or stopped
actor answers every later call with a supervision error at once, from the loop
thread. A failure is reported to the owner (``FAILURE`` envelope) before anyone
else hears of it and before ``__cleanup__`` runs, so a cleanup that hangs
cannot keep the owner in the dark.

Deadlines: ``__cleanup__`` has ``cleanup_timeout`` seconds. On a stop they count
from the moment the stop reached this process (the loop thread stamps it), so
an actor that stops does so within ``cleanup_timeout`` unless an endpoint it is
running never returns; the owner then kills the proc (see ``_supervision``). A
sync ``__cleanup__`` runs on the actor's own thread; when it overruns, a timer
thread declares the actor stopped (logged) and answers the stop, and the
cleanup is left to run on.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..telemetry import FIGURES
from ..telemetry import STATE as _TELEMETRY
from ..transport import Segment, dumps, loads
from . import _messages as M
from ._actor import Context, Instance, MeshFailure, _context, _message_rank, _overrides, endpoints_of, make_point
from ._cell_async import _STOP, _SUPERVISE, Stop, Supervise, run_async
from ._cell_figures import now
from ._cell_invoke import CellInvocation, error_payload
from ._loop import new_event_loop
from ._mailbox import LoopMailbox, Mailbox, ThreadMailbox, refuse_all

if TYPE_CHECKING:
    from ._proc import ProcRuntime

log = logging.getLogger("actormesh.actor")

__all__ = ["Cell", "install"]


class Cell(CellInvocation):
    """One actor instance and the thread that runs it."""

    def __init__(self, runtime: ProcRuntime, env: M.Spawn, payload: Sequence[Segment]) -> None:
        name = env.actor
        self.runtime = runtime
        self.name = name
        self.rank_raw = (env.rank, tuple(env.labels), tuple(env.sizes))
        self.owner = env.owner
        #: The actor mesh this member belongs to: its actors are named after it.
        self.mesh_name = name
        self.display = env.display
        is_async = self.is_async = env.is_async
        self.status = "init"
        self.cause: str | None = None
        self._spawn_payload = payload
        self._spawn_reply = env.reply
        self.instance: Any = None
        self._endpoints: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        #: This actor's counters when telemetry is on (docs/telemetry.md), else None.
        self.figures = FIGURES.actor(name) if _TELEMETRY.on else None
        #: monotonic time by which a requested stop must be done (set by the loop thread).
        self.stop_deadline: float | None = None
        self._mailbox: Mailbox[tuple[Any, Any]]
        if is_async:
            self._loop = new_event_loop()
            self._mailbox = LoopMailbox(self._loop)
            target: Callable[[], None] = functools.partial(run_async, self)
        else:
            self._mailbox = ThreadMailbox()
            target = self._run_sync
        self.thread = threading.Thread(target=target, name=f"actor-{name}-{env.rank}", daemon=True)
        self.thread.start()

    # -- loop thread side ---------------------------------------------------------------
    def post(self, env: M.Call | Stop | Supervise, payload: Sequence[Segment]) -> None:
        """Hand a message to the actor (any thread). Dead actors answer at once.

        A STOP still goes in, so a failed actor's thread gets to end. A message
        that slips in as the actor fails is refused by its thread (the status check
        per message), one that comes after its thread ended by the closed mailbox."""
        if (self.status in ("failed", "stopped") and env.kind != _STOP) or not self._mailbox.put((env, payload)):
            self._refuse(env)

    def _close_mailbox(self) -> None:
        """The actor thread is ending: refuse what is queued and all that comes later."""
        refuse_all(self._mailbox, self._refuse)

    def _refuse(self, env: M.Call | Stop | Supervise) -> None:
        if isinstance(env, M.Call):  # kind M.CALL: calls reach a cell decoded, or typed() by a local route
            if env.reply is not None:
                self.runtime.reply(env.reply, env.member, M.SUPERVISION, dumps(self.dead_text()))
        elif isinstance(env, Stop) and env.reply is not None:
            self.runtime.reply(env.reply, env.slot, M.OK, dumps(None))

    def stop(self, reply: tuple[str, int] | None, index: int = 0) -> None:
        """Stop after the messages already queued (loop thread); reply as ``index``.

        The actor has ``cleanup_timeout`` seconds from now to be done.
        """
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.runtime.config.cleanup_timeout
        self.post(Stop(_STOP, reply, None, index), ())

    def request_stop(self, failure: str | None) -> None:
        """Stop (or abort with ``failure``) from the actor's own code."""
        self.post(Stop(_STOP, None, failure, 0), ())

    def supervise(self, failure: MeshFailure) -> None:
        """Deliver a failure of a mesh this actor owns (loop thread)."""
        self.post(Supervise(_SUPERVISE, failure), ())

    # -- actor thread side --------------------------------------------------------------
    def _enter(self) -> bool:
        rank_point = make_point(*self.rank_raw)
        inst = Instance(runtime=self.runtime, name=self.name, display=self.display, rank=rank_point, class_name="", cell=self)
        self.ctx = Context(inst)
        _context.set(self.ctx)
        try:
            cls, args, kwargs = loads(self._spawn_payload)
            self._spawn_payload = ()
            inst.class_name = f"{cls.__module__}.{cls.__qualname__}"
            self.cls = cls
            self._endpoints = endpoints_of(cls)
            token = _message_rank.set(self.rank_raw)
            try:
                obj = cls.__new__(cls)
                self.instance = obj
                result = obj.__init__(*args, **kwargs)
                if inspect.isawaitable(result):
                    raise TypeError("__init__ must not be async")
            finally:
                _message_rank.reset(token)
        except BaseException as exc:
            self._fail(f"actor failed in __init__: {''.join(traceback.format_exception(exc))}", run_cleanup=False)
            if self._spawn_reply is not None:
                # ``mesh.initialized`` raises this member's error (after the owner heard).
                payload = error_payload(exc, f"{self.display} failed in __init__:\n")
                self.runtime.reply(self._spawn_reply, self.rank_raw[0], M.ERROR, payload)
            return False
        self.status = "running"
        if self._spawn_reply is not None:
            self.runtime.reply(self._spawn_reply, self.rank_raw[0], M.OK, dumps(None))
        return True

    def _run_sync(self) -> None:
        try:
            self._serve_sync()
        finally:
            self._close_mailbox()

    def _serve_sync(self) -> None:
        ok = self._enter()
        mailbox = self._mailbox
        assert isinstance(mailbox, ThreadMailbox)
        take = mailbox.next  # a batch per wake-up (_mailbox.py)
        while True:
            env, payload = take()
            kind = env.kind
            if not ok or self.status != "running":
                self._refuse(env)
                if kind == _STOP:
                    return
                continue
            if kind == M.CALL:
                self._call_sync(env, payload)
            elif kind == _STOP:
                self._stop(env)
                return
            elif kind == _SUPERVISE:
                self._supervise_sync(env.failure)

    def _call_sync(self, env: M.Call, payload: Sequence[Segment]) -> None:
        """Run one call on this thread (the steps are in ``_cell_invoke``)."""
        token = _message_rank.set((env.member, env.labels, env.sizes))
        prop, fig, scope = None, self.figures, None
        t0 = now() if fig is not None else 0.0
        try:
            # the dict hit inline: the common case costs no call to _endpoint
            prop = self._endpoints.get(env.endpoint) or self._endpoint(env)
            msg = self._open(prop, env, payload)
            if len(msg) > 2:
                scope = msg[2]
            result = prop._fn(self.instance, *msg[0], **msg[1])
        except BaseException as exc:
            self._call_failed(exc, env, prop, token, fig, t0, scope)
            return
        self._call_done(env, prop, token, fig, t0, scope, result)

    def _supervise_sync(self, failure: MeshFailure) -> None:
        """Offer ``failure`` to ``__supervise__`` on this thread; unless handled, fail."""
        handled, raised = False, None
        try:
            handled = _overrides(type(self.instance), "__supervise__") and self.instance.__supervise__(failure)
        except Exception as exc:
            raised = exc
        self._supervised(failure, handled, raised)

    def _stop(self, env: Stop) -> None:
        """Stop (clean up, then answer) or, with ``env.failure``, fail (answering no one)."""
        if env.failure is not None:
            self._fail(str(env.failure))
            return
        self._cleanup(None, functools.partial(self._stopped, env.reply, env.slot))


def install(runtime: ProcRuntime) -> None:
    """Teach a runtime to create cells on SPAWN."""

    def on_spawn(env: M.Spawn, payload: Sequence[Segment]) -> None:
        name = env.actor
        old = runtime.actors.get(name)
        if old is not None and old.status == "failed":
            del runtime.actors[name]  # a restart replaces a failed member in place
            if _TELEMETRY.on:
                FIGURES.restarted(name)
        if name in runtime.actors:
            runtime.reply(env.reply, env.rank, M.SUPERVISION, dumps(f"an actor named {name!r} already exists on {runtime.address}"))
            return
        runtime.actors[name] = Cell(runtime, env, payload)

    runtime.handlers.spawn = on_spawn
