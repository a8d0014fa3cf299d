"""How a :class:`~._cell.Cell` runs one call, for sync and async actors alike.

Theory of operation
-------------------
A call goes through the same steps whatever the actor's kind; only the middle
one differs (the sync path calls the endpoint, the async path awaits it, as a
task for a concurrent endpoint):

1. Set the message's rank (``context().message_rank``), start the clock when
   telemetry is on, find the endpoint (:meth:`CellInvocation._endpoint`) and
   unpickle its arguments, opening the call's span if the caller traced it
   (:meth:`CellInvocation._open`).
2. Run the endpoint.
3. Settle: :meth:`CellInvocation._call_done` or :meth:`CellInvocation._call_failed`.
   Figures are counted and the span ended *before* the caller hears, so a
   caller that reads telemetry after its reply sees its own call. The outcome:

   - a result is pickled and answered OK; one that cannot be is answered as
     a ``TypeError``;
   - an ``Exception`` is answered as ERROR (the caller can catch its type),
     unless no one waits for a return value (an explicit response port, or
     no reply port): then the actor fails and its owner hears;
   - an async call cancelled by a stop is answered STOPPED;
   - any other ``BaseException`` fails the actor.

The steps are separate methods, not a wrapper around the endpoint, so that a
sync no-op call costs no more frames or allocations than a hand-written loop.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ActorError, Cause, CauseKind, PortableException
from ..telemetry import ActorFigures, EndpointScope
from ..transport import Segment, dumps, loads
from . import _messages as M
from ._actor import EndpointProperty, MeshFailure, _message_rank
from ._cell_end import CellEnding
from ._cell_figures import CellFigures
from ._channel import Port

if TYPE_CHECKING:
    from contextvars import Token

__all__ = ["CellInvocation", "error_payload"]


def error_payload(exc: BaseException, prefix: str = "") -> list[Segment]:
    """The ERROR reply for ``exc``: the exception (its type is what callers catch) and its traceback."""
    formatted = "".join(traceback.format_exception(exc))
    if isinstance(exc, ActorError):
        # Relayed from a deeper actor: send the original exception (its type is what
        # callers catch) with both tracebacks, innermost first.
        formatted = f"{exc.exception_formatted.rstrip()}\n\nrelayed by:\n{formatted}"
        exc = exc.exception
    formatted = prefix + formatted
    try:
        return dumps((PortableException(exc), formatted))
    except TypeError:
        return dumps((RuntimeError(f"{type(exc).__name__}: {exc}"), formatted))


class _DropPort:
    """The port given to explicit-port endpoints called without a reply (broadcast)."""

    def send(self, obj: Any) -> None:
        pass

    def exception(self, exc: BaseException) -> None:
        pass


def _text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


class CellInvocation(CellEnding, CellFigures):
    """Mixin of :class:`~._cell.Cell`: the steps of a call, and how an actor fails (uses the cell's state)."""

    owner: Any
    mesh_name: str
    is_async: bool
    cause: str | None
    _endpoints: dict[str, Any]

    # -- before the endpoint runs -------------------------------------------------------
    def _endpoint(self, env: M.Call) -> EndpointProperty[Any]:
        """The endpoint ``env`` calls; AttributeError if the actor has none of that name."""
        name = env.endpoint
        prop = self._endpoints.get(name)
        if prop is None:
            fn = getattr(type(self.instance), name, None)
            if callable(fn) and not name.startswith("_") and not isinstance(fn, type):
                # a plain method called through as_endpoint()
                prop = self._endpoints[name] = EndpointProperty(fn)
        if prop is None:
            raise AttributeError(f"{type(self.instance).__qualname__} has no endpoint named {name!r}")
        return prop

    def _open(self, prop: EndpointProperty[Any], env: M.Call, payload: Sequence[Segment]) -> tuple[Any, ...]:
        """The call's ``(args, kwargs)``, or ``(args, kwargs, span)`` if the caller traced it.

        An explicit-port endpoint gets its port as the first of ``args``. The
        common case returns the unpickled message itself (no copy).
        """
        msg = loads(payload)  # (args, kwargs[, trace context])
        if prop.explicit_response_port:
            reply = env.reply
            port: Port[Any] | _DropPort = Port(reply[0], reply[1], env.member, self.runtime) if reply else _DropPort()
            msg = ((port, *msg[0]), *msg[1:])
        if len(msg) > 2:
            msg = (msg[0], msg[1], self._trace_scope(msg, env))
        return msg

    # -- after it ran -------------------------------------------------------------------
    def _call_done(
        self,
        env: M.Call,
        prop: EndpointProperty[Any],
        token: Token[Any],
        fig: ActorFigures | None,
        t0: float,
        scope: EndpointScope | None,
        result: Any,
    ) -> None:
        """The endpoint returned ``result``: count it, end its span, then answer the caller."""
        _message_rank.reset(token)
        if fig is not None or scope is not None:
            self._handled(fig, t0, scope)
        reply = env.reply
        if reply is None or prop.explicit_response_port:
            return  # an explicit-port endpoint answers through its port
        try:
            payload = dumps(result)
        except TypeError as exc:
            self.runtime.reply(reply, env.member, M.ERROR, error_payload(TypeError(f"endpoint result could not be pickled: {exc}")))
            return
        self.runtime.reply(reply, env.member, M.OK, payload)

    def _call_failed(
        self,
        exc: BaseException,
        env: M.Call,
        prop: EndpointProperty[Any] | None,
        token: Token[Any],
        fig: ActorFigures | None,
        t0: float,
        scope: EndpointScope | None,
    ) -> None:
        """The call raised ``exc`` (``prop`` is None if no endpoint was found): count
        it, end its span, then answer or fail the actor. The async caller re-raises
        a ``CancelledError`` itself."""
        reply, index = env.reply, env.member
        explicit = prop is not None and prop.explicit_response_port
        try:
            self._handled(fig, t0, scope, exc)  # counted before the caller hears
            if isinstance(exc, Exception):
                self._handle_error(exc, reply, index, explicit)
            elif self.is_async and isinstance(exc, asyncio.CancelledError):
                if reply is not None and not explicit:
                    cause = Cause(f"The actor {self.display} stopped before the call finished", CauseKind.STOPPED)
                    self.runtime.reply(reply, index, M.SUPERVISION, dumps(cause))
            else:
                self._fail(f"actor failed with {type(exc).__name__}: {_text(exc)}", reply=(reply, index))
        finally:
            _message_rank.reset(token)

    def _handle_error(self, exc: BaseException, reply: Any, index: int, explicit: bool) -> None:
        """Answer ``exc`` as ERROR, or, when no one waits for a return value, fail the actor."""
        if self.figures is not None:
            self.figures.errors += 1
        if reply is not None and not explicit:
            self.runtime.reply(reply, index, M.ERROR, error_payload(exc))
            return
        # No one to tell: like an Erlang process, the actor dies and its owner hears.
        self._fail(f"actor explicitly aborted due to: {_text(exc)}", reply=(reply, index) if explicit else None)

    # -- supervision and stop -----------------------------------------------------------
    def _supervised(self, failure: MeshFailure, handled: Any, exc: Exception | None) -> None:
        """``__supervise__`` returned ``handled`` or raised ``exc``: unless it handled the failure, fail."""
        if exc is not None:
            self._fail(f"__supervise__ raised while handling {failure!r}: {_text(exc)}")
        elif not handled:
            self._fail(f"unhandled failure of an owned mesh: {failure.report()}")

    def _stopped(self, reply: M.PortRef | None, slot: int) -> None:
        """The actor is stopped: say so to whoever asked (as slot ``slot`` of ``reply``)."""
        self.status = "stopped"
        if reply is not None:
            self.runtime.reply(reply, slot, M.OK, dumps(None))

    def dead_text(self) -> Cause:
        """What callers of this dead actor are told (STOPPED, or the failure's Cause)."""
        if self.status == "stopped":
            return Cause(f"The actor {self.display} has status: stopped: {self.cause or 'stopped by client'}", CauseKind.STOPPED)
        return Cause.of(self.cause or "", CauseKind.RAISED).reworded(f"The actor {self.display} and all its descendants have failed:\n  {self.cause}")

    def _fail(self, cause: str, run_cleanup: bool = True, reply: tuple[Any, int] | None = None) -> None:
        """Mark the actor failed; tell the owner, then ``reply`` (a waiting caller), then clean up.

        The owner hears first: a ``__cleanup__`` that hangs cannot delay the report.
        """
        if self.status in ("failed", "stopped"):
            return
        self.status = "failed"
        self.cause = Cause.of(cause, CauseKind.RAISED).reworded(cause.rstrip())
        owner = self.owner
        if owner is not None:
            self.runtime.report_failure(owner, self.mesh_name, self.rank_raw[0], self.cause, self.display)
        if reply is not None and reply[0] is not None:
            self.runtime.reply(reply[0], reply[1], M.SUPERVISION, dumps(self.dead_text()))
        if run_cleanup and not self.is_async:
            self._cleanup(RuntimeError(str(self.cause)))
        elif self.is_async:
            self.runtime.threads.start(self._stop_owned, "its owner failed", name=f"actor-{self.display}-stop-owned")
