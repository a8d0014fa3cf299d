"""Errors of the data plane, placed in the tree of :mod:`actormesh.errors`.

::

    TransportError (RuntimeError)          the system failed to move bytes
    └── RDMAError                          a one-sided transfer failed; names the buffer's owner
        ├── OwnerGoneError                 the owner's process died or cannot be reached
        ├── BufferDroppedError             the buffer was dropped (deregistered) before or during use
        └── RDMATimeoutError (+TimeoutError)  the transfer did not finish within its timeout

Argument problems (a destination too small, non-contiguous memory) are
``ValueError`` raised at the call site, before anything moves.
"""

from __future__ import annotations

from ..errors import TransportError

__all__ = ["RDMAError", "OwnerGoneError", "BufferDroppedError", "RDMATimeoutError"]


class RDMAError(TransportError):
    """A transfer to or from an RDMA buffer failed. ``owner`` names the buffer's owner."""

    def __init__(self, message: str, *, owner: str = "") -> None:
        super().__init__(message)
        self.owner = owner

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), str(self), self.owner))


def _rebuild(cls: type[RDMAError], message: str, owner: str) -> RDMAError:
    return cls(message, owner=owner)


class OwnerGoneError(RDMAError):
    """The process that owns the buffer died or is unreachable; the bytes cannot move."""


class BufferDroppedError(RDMAError):
    """The buffer was dropped: its memory is no longer registered for transfers."""


class RDMATimeoutError(RDMAError, TimeoutError):
    """The transfer did not complete within its ``timeout``."""
