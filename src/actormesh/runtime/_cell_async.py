"""The event-loop half of :class:`~._cell.Cell`: how an ``async def`` actor runs.

An async actor runs its own event loop on its own thread (:func:`run_async` is
that thread's body; the functions here take the cell whose state they use). It
takes from the cell's :class:`~._mailbox.LoopMailbox`, which wakes its loop only
when it sleeps, so a burst costs one wake-up. Endpoints marked concurrent run as
tasks; the others run one at a time, in arrival order.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from ..transport import Segment
from . import _messages as M
from ._actor import EndpointProperty, MeshFailure, _message_rank, _overrides
from ._cell_figures import now
from ._mailbox import LoopMailbox

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


def run_async(cell: Cell) -> None:
    """The thread body of an async actor: its own event loop until it stops or fails."""
    asyncio.set_event_loop(cell._loop)
    try:
        cell._loop.run_until_complete(_dispatch(cell))
    finally:
        cell._close_mailbox()
        cell._loop.close()


async def _dispatch(cell: Cell) -> None:
    ok = cell._enter()
    mailbox = cell._mailbox
    assert isinstance(mailbox, LoopMailbox)
    take = mailbox.next_nowait  # a batch per wake-up (_mailbox.py)
    while True:
        item = take()
        if item is None:
            await mailbox.wait()
            continue
        env, payload = item
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
    try:
        prop = cell._endpoints.get(env.endpoint) or cell._endpoint(env)  # as in Cell._call_sync
    except Exception as exc:
        cell._handle_error(exc, env.reply, env.member, False)
        return
    if prop.concurrent:
        task = asyncio.ensure_future(_run_endpoint(cell, prop, env, payload))
        cell._tasks.add(task)
        task.add_done_callback(cell._tasks.discard)
        await asyncio.sleep(0)  # let the body start before the next message (start order)
        return
    await _run_endpoint(cell, prop, env, payload)


async def _run_endpoint(cell: Cell, prop: EndpointProperty[Any], env: M.Call, payload: Sequence[Segment]) -> None:
    """Run one call on the actor's loop (the steps are in ``_cell_invoke``)."""
    token = _message_rank.set((env.member, env.labels, env.sizes))
    fig, scope = cell.figures, None
    t0 = now() if fig is not None else 0.0
    try:
        msg = cell._open(prop, env, payload)
        if len(msg) > 2:
            scope = msg[2]
        result = await prop._fn(cell.instance, *msg[0], **msg[1])
    except BaseException as exc:
        cell._call_failed(exc, env, prop, token, fig, t0, scope)
        if isinstance(exc, asyncio.CancelledError):
            raise  # a task cancelled by a stop ends cancelled
        return
    cell._call_done(env, prop, token, fig, t0, scope, result)


async def _supervise(cell: Cell, failure: MeshFailure) -> None:
    """Offer ``failure`` to ``__supervise__`` (awaited if async); unless handled, fail."""
    handled, raised = False, None
    try:
        if _overrides(type(cell.instance), "__supervise__"):
            handled = cell.instance.__supervise__(failure)
            if inspect.isawaitable(handled):
                handled = await handled
    except Exception as exc:
        raised = exc
    cell._supervised(failure, handled, raised)


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
    if failure is None:
        cell._stopped(env.reply, env.slot)
