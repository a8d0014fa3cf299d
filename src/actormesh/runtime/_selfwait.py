"""Refuse a wait that can never end: an actor blocking on a call to itself.

An actor runs one message at a time on its own thread. If an endpoint calls an
endpoint of the same actor and then blocks on the reply (``.get()``), the reply
needs the very thread that is blocked: it would wait forever. The same holds
for an async actor's ``.get()`` (it blocks the actor's event loop) and for an
``await`` in a non-concurrent async endpoint (the call is queued behind the
endpoint that awaits it). Calls mark their future when they target the calling
actor; the future asks :func:`_verdict` when someone waits on it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ._actor import _context

__all__ = ["mark_if_self_call"]


def mark_if_self_call(future: Any, actor_name: str, addresses: Iterable[str] | Callable[[], Iterable[str]], what: str) -> None:
    """Mark ``future`` if the current actor is among the targets of call ``what``.

    ``addresses`` are the procs that received the call, for actor ``actor_name``
    (or a function listing them, called only when the caller is that actor).
    Cheap when the caller is the client or another actor (one context lookup).
    """
    ctx = _context.get()
    if ctx is None:
        return
    cell = ctx.actor_instance._cell
    if cell is None or cell.name != actor_name:
        return
    if callable(addresses):
        addresses = addresses()
    if cell.runtime.address not in addresses:
        return
    future._wedge = lambda how: _verdict(cell, what, how)


def _verdict(cell: Any, what: str, how: str) -> str | None:
    """Why waiting (``how``: "get" or "await") here on a self-call never ends, or None."""
    if threading.current_thread() is not cell.thread:
        return None  # another thread of the actor may wait: the actor thread serves the call
    head = f"{what}() is a call from actor {cell.display} to itself, and the reply can never come while this wait blocks:"
    if how == "get":
        if cell.is_async:
            return (
                f"{head} .get() blocks this actor's event loop, which would run the call. "
                "Use `await` on the call inside an endpoint marked @concurrent_endpoint, or call the method directly."
            )
        return (
            f"{head} this actor runs one message at a time on this thread, which .get() blocks. "
            "Call the method directly (self.<method>(...)), or make the endpoint `async def` with "
            "@concurrent_endpoint and `await` the call."
        )
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return None
    if task is not None and task in cell._tasks:
        return None  # a concurrent endpoint: the actor takes the call while this one awaits
    return (
        f"{head} this endpoint is not concurrent, so the call is queued behind it. "
        "Mark the calling endpoint @concurrent_endpoint, or call the method directly."
    )
