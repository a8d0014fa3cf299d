"""The event-loop half of :class:`~._cell.Cell`: how an ``async def`` actor runs.

An async actor runs its own event loop on its own thread (:func:`run_async` is
that thread's body; the functions here take the cell whose state they use). The
loop thread appends envelopes to the cell's deque and sets ``_wake_event`` only
when the actor's loop sleeps (``_idle``), so a burst costs one wake-up. Endpoints
marked concurrent run as tasks; the others run one at a time, in arrival order.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from ..errors import Cause, CauseKind
from ..transport import Segment, dumps, loads
from . import _messages as M
from ._actor import MeshFailure, _message_rank, _overrides
from ._cell_figures import now
from ._channel import Port

if TYPE_CHECKING:
    from ._cell import Cell

log = logging.getLogger("actormesh.actor")

#: Cell-internal mailbox kinds (never on the wire), beside M.CALL.
_STOP = -1
_SUPERVISE = -2


class Stop(NamedTuple):
    """Mailbox item: stop after what is queued, answering slot ``slot`` of ``reply``;
    with ``failure``, abort with it instead (the actor's own code asked)."""

    kind: int  # _STOP
    reply: Optional[M.PortRef]
    failure: Optional[str]
    slot: int


class Supervise(NamedTuple):
    """Mailbox item: a failure of a mesh this actor owns, for its ``__supervise__``."""

    kind: int  # _SUPERVISE
    failure: MeshFailure


class _DropPort:
    """The port given to explicit-port endpoints called without a reply (broadcast)."""

    def send(self, obj: Any) -> None:
        pass

    def exception(self, exc: BaseException) -> None:
        pass


def run_async(cell: Cell) -> None:
    """The thread body of an async actor: its own event loop until it stops or fails."""
    asyncio.set_event_loop(cell._loop)
    try:
        cell._loop.run_until_complete(_dispatch(cell))
    finally:
        cell._close_mailbox()
        cell._loop.close()


async def _dispatch(cell: Cell) -> None:
    wake = cell._wake_event = asyncio.Event()
    ok = cell._enter()
    dq = cell._deque
    while True:
        if not dq:
            cell._idle = True
            if not dq:
                wake.clear()
                await wake.wait()
            cell._idle = False
            continue
        env, payload = dq.popleft()
        kind = env.kind
        if not ok or cell.status != "running":
            cell._refuse(env)
            if kind == _STOP:
                return
            continue
        if kind == M.CALL:
            await _call(cell, env, payload)
        elif kind == _STOP:
            await _stop(cell, env)
            return
        elif kind == _SUPERVISE:
            await _supervise(cell, env.failure)


async def _call(cell: Cell, env: M.Call, payload: Sequence[Segment]) -> None:
    reply, index = env.reply, env.member
    try:
        prop = cell._begin(env)
    except Exception as exc:
        cell._handle_error(exc, reply, index, False)
        return
    if prop.concurrent:
        task = asyncio.ensure_future(_run_endpoint(cell, prop, env, payload))
        cell._tasks.add(task)
        task.add_done_callback(cell._tasks.discard)
        await asyncio.sleep(0)  # let the body start before the next message (start order)
        return
    await _run_endpoint(cell, prop, env, payload)


async def _run_endpoint(cell: Cell, prop: Any, env: M.Call, payload: Sequence[Segment]) -> None:
    reply, index = env.reply, env.member
    token = _message_rank.set((index, env.labels, env.sizes))
    explicit = prop.explicit_response_port
    fig, scope = cell.figures, None
    t0 = now() if fig is not None else 0.0
    try:
        msg = loads(payload)  # (args, kwargs[, trace context])
        args, kwargs = msg[0], msg[1]
        if len(msg) > 2:  # the caller traced this call
            scope = cell._trace_scope(msg, env)
        if explicit:
            port: Port[Any] | _DropPort = Port(reply[0], reply[1], index, cell.runtime) if reply else _DropPort()
            await prop._fn(cell.instance, port, *args, **kwargs)
            return
        result = await prop._fn(cell.instance, *args, **kwargs)
    except Exception as exc:
        fig = scope = cell._handled(fig, t0, scope, exc)  # counted before the caller hears
        cell._handle_error(exc, reply, index, explicit)
        return
    except asyncio.CancelledError as exc:
        fig = scope = cell._handled(fig, t0, scope, exc)  # counted before the caller hears
        if reply is not None and not explicit:
            cell.runtime.reply(reply, index, M.SUPERVISION, dumps(Cause(f"The actor {cell.display} stopped before the call finished", CauseKind.STOPPED)))
        raise
    except BaseException as exc:
        fig = scope = cell._handled(fig, t0, scope, exc)  # counted before the caller hears
        cell._fail(f"actor failed with {type(exc).__name__}: {''.join(traceback.format_exception(exc))}", reply=(reply, index))
        return
    finally:
        _message_rank.reset(token)
        if fig is not None or scope is not None:
            cell._handled(fig, t0, scope)
    if reply is not None:
        cell._reply_value(reply, index, result)


async def _supervise(cell: Cell, failure: MeshFailure) -> None:
    try:
        handled = False
        if _overrides(type(cell.instance), "__supervise__"):
            handled = cell.instance.__supervise__(failure)
            if inspect.isawaitable(handled):
                handled = await handled
    except Exception as exc:
        cell._fail(f"__supervise__ raised while handling {failure!r}: {''.join(traceback.format_exception(exc))}")
        return
    if not handled:
        cell._fail(f"unhandled failure of an owned mesh: {failure.report()}")


async def _stop(cell: Cell, env: Stop) -> None:
    """Stop (or abort with a failure): cancel concurrent endpoints, then clean up.

    An abort reports the failure to the owner first. ``__cleanup__`` gets what
    is left of the stop deadline (``cleanup_timeout`` on a failure).
    """
    failure = env.failure
    if failure is not None:
        cell._fail(str(failure), run_cleanup=False)
    for task in list(cell._tasks):
        task.cancel()
    if cell._tasks:
        await asyncio.wait(list(cell._tasks), timeout=cell.cleanup_budget())
    exc = RuntimeError(str(failure)) if failure is not None else None
    try:
        await asyncio.get_running_loop().run_in_executor(None, cell._stop_owned, "its owner stopped")
    except RuntimeError:  # interpreter shutdown (atexit): no executor threads any more
        cell._stop_owned("its owner stopped")
    if cell.instance is not None and _overrides(type(cell.instance), "__cleanup__"):
        budget = cell.cleanup_budget()
        _message_rank.set(cell.rank_raw)  # this task's context: the cleanup sees the actor's own rank
        try:
            result = cell.instance.__cleanup__(exc)
            if inspect.isawaitable(result):
                await asyncio.wait_for(result, budget)
        except asyncio.TimeoutError:
            log.warning("__cleanup__ of %s did not finish within %.1fs (cleanup_timeout); abandoned", cell.display, budget)
        except Exception:
            log.exception("__cleanup__ of %s raised", cell.display)
    if failure is not None:
        return
    cell.status = "stopped"
    if env.reply is not None:
        cell.runtime.reply(env.reply, env.slot, M.OK, dumps(None))
