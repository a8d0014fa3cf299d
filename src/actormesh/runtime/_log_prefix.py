"""``[actor=<name>] `` in front of Python log messages logged inside actors.

Monarch prefixes every log record made while an actor runs with the actor's
qualified name (``[actor=<root>.<mod.Cls name{'gpus': 0/2}>] msg``), on the
controller too (``[actor=<root>]``), unless ``config.prefix_python_logs_with_actor``
is False. We install one ``logging`` record factory per process when its
runtime starts: the prefix is added once, when the record is made, so every
handler (stream, file, any logger's) sees it, and a record is never
prefixed twice. Empty messages are left alone (torch.compile's structured
trace logging relies on them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ._actor import _context

__all__ = ["install", "actor_prefix"]

_lock = threading.Lock()
_installed = False
_client_display: list[Callable[[], str | None]] = [lambda: None]


def actor_prefix() -> str | None:
    """The prefix for a record made now, or None (not in an actor, or switched off)."""
    from ..config import get_config

    if not get_config().prefix_python_logs_with_actor:
        return None
    ctx = _context.get()
    if ctx is not None:
        return f"[actor={ctx.actor_instance!r}] "
    display = _client_display[0]()
    return f"[actor={display}] " if display else None


def install(client_display: Callable[[], str | None]) -> None:
    """Prefix log records in this process from now on (idempotent).

    ``client_display()`` names code that runs outside any actor (``<root>`` on
    the controller, the proc's name in a worker), or None once the runtime
    was shut down.
    """
    global _installed
    _client_display[0] = client_display
    with _lock:
        if _installed:
            return
        _installed = True
        previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            prefix = actor_prefix()
            if prefix and record.msg:
                # %-formatting runs over the whole message later: a '%' in an actor's name must stay literal
                record.msg = f"{prefix.replace('%', '%%') if record.args else prefix}{record.msg}"
                record.actor_prefix = prefix
        except Exception:  # naming the actor must never break logging
            pass
        return record

    logging.setLogRecordFactory(factory)
