"""Ports: references to a reply handler on some process, usable from anywhere.

A ``Port`` pickles to (address, port id, rank) and is rebuilt bound to the
runtime of whichever process unpickles it, so a port passed to an actor sends
from that actor's process straight to the port's owner.
"""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..errors import PortableException
from ..transport import dumps
from . import _messages as M
from ._future import Future
from ._ports import QueuePort

if TYPE_CHECKING:
    from ._proc import ProcRuntime

__all__ = ["Port", "PortReceiver", "Channel"]

R = TypeVar("R")


def _runtime() -> Any:
    from ._context import current_runtime

    return current_runtime()


class Port(Generic[R]):
    """Where to send values: ``port.send(v)``, ``port.exception(e)``. Thread-safe."""

    __slots__ = ("_address", "_port_id", "_rank", "_runtime", "return_undeliverable")

    def __init__(self, address: str, port_id: int, rank: int | None = None, runtime: ProcRuntime | None = None) -> None:
        self._address = address
        self._port_id = port_id
        self._rank = rank
        self._runtime = runtime
        self.return_undeliverable = True

    def _rt(self) -> Any:
        if self._runtime is None:
            self._runtime = _runtime()
        return self._runtime

    def send(self, obj: R) -> None:
        """Send one value to the receiver (fire and forget, in order)."""
        rt = self._rt()
        rt.reply((self._address, self._port_id), self._rank or 0, M.OK, dumps(obj))

    def exception(self, exc: BaseException) -> None:
        """Make the receiver's ``recv()`` raise ``exc`` itself."""
        rt = self._rt()
        formatted = "".join(traceback.format_exception(exc))
        try:
            payload = dumps((PortableException(exc), formatted))
        except TypeError:
            payload = dumps((RuntimeError(repr(exc)), formatted))
        rt.reply((self._address, self._port_id), self._rank or 0, M.ERROR, payload)

    @property
    def ref(self) -> tuple[str, int]:
        """(address, port id)."""
        return (self._address, self._port_id)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Port, (self._address, self._port_id, self._rank))

    def __repr__(self) -> str:
        return f"<Port {self._port_id}@{self._address}>"


class PortReceiver(Generic[R]):
    """The receiving end of a channel: ``recv()`` returns a Future of the next value."""

    def __init__(self, handler: QueuePort) -> None:
        self._handler = handler

    def recv(self) -> Future[R]:
        """The next value sent to the port (or the exception sent with ``port.exception``).

        The future claims its message when first observed (``get``/``await``):
        a ``recv()`` never looked at takes nothing. On a closed port (or a
        ``once`` port already used) it fails with ``PortClosedError``.
        """
        return self._handler.recv()

    def close(self) -> None:
        """Stop receiving: pending and later ``recv()`` fail with ``PortClosedError``;
        later sends to the port are dropped."""
        self._handler.close()


class Channel(Generic[R]):
    """Open ports on the current actor (or the client).

    Example::

        port, receiver = Channel.open()
        port.send(3)
        assert receiver.recv().get() == 3
    """

    def __init__(self) -> None:
        raise TypeError("use Channel.open() to make a (Port, PortReceiver) pair")

    @staticmethod
    def open(once: bool = False) -> tuple[Port[Any], PortReceiver[Any]]:
        """A new (Port, PortReceiver) pair on the current process."""
        rt = _runtime()
        handler = QueuePort(rt, once=once)
        return Port(rt.address, handler.port_id, None, rt), PortReceiver(handler)

    @staticmethod
    def open_ranked(once: bool = False) -> tuple[Port[Any], PortReceiver[Any]]:
        """Like :meth:`open`, but ``recv()`` yields ``(rank, value)`` for replies sent with ``send(..., port=)``."""
        rt = _runtime()
        handler = QueuePort(rt, once=once)
        handler.ranked = True
        return Port(rt.address, handler.port_id, None, rt), PortReceiver(handler)
