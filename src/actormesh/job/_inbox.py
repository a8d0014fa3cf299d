"""Polling a port's receiver with a bounded wait, without losing a message.

A ``recv()`` future claims its message when first observed, so a ``get`` that
timed out still takes the next value: the poller must keep waiting on that same
future rather than make a new one (which would queue behind it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Inbox"]


class Inbox:
    """``next(timeout)``: the next message, or None if none came in time (messages are never None)."""

    def __init__(self, receiver: Any) -> None:
        self._receiver = receiver
        self._pending: Any = None

    def next(self, timeout: float) -> Any:
        if self._pending is None:
            self._pending = self._receiver.recv()
        try:
            message = self._pending.get(timeout=timeout)
        except TimeoutError:
            return None
        self._pending = None
        return message
