"""Errors of the data plane, placed in the tree of :mod:`actormesh.errors`.

::

    TransportError (RuntimeError)          the system failed to move bytes
    └── RDMAError                          a one-sided transfer failed; names the buffer's owner
        ├── OwnerGoneError                 the owner's process died or cannot be reached
        ├── BufferDroppedError             the buffer was dropped (deregistered) before or during use
        └── RDMATimeoutError (+TimeoutError)  the transfer did not finish within its timeout

Argument problems (a destination too small, non-contiguous memory) are
``ValueError`` raised at the call site, before anything moves.

Warnings (Monarch's names; each shown once per process and call site, as
``warnings`` does by default):

- ``RDMAReadTransferWarning`` / ``RDMAWriteTransferWarning``: ``read_into`` /
  ``write_from`` with GPU memory on the calling side; the bytes are staged
  through a host buffer (an extra copy each way).
- ``RDMATcpFallbackWarning``: a transfer between two processes on the same
  host had to use the TCP stream because neither same-host path (kernel copy,
  shared memory) could reach the buffer. Cross-host TCP is the designed path
  and does not warn.
"""

from __future__ import annotations

from ..errors import TransportError

__all__ = ["RDMAError", "OwnerGoneError", "BufferDroppedError", "RDMATimeoutError",
           "RDMAReadTransferWarning", "RDMAWriteTransferWarning", "RDMATcpFallbackWarning"]


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


class RDMAReadTransferWarning(Warning):
    """``read_into`` a GPU destination: the bytes go through a host staging buffer."""


class RDMAWriteTransferWarning(Warning):
    """``write_from`` a GPU source: the bytes go through a host staging buffer."""


class RDMATcpFallbackWarning(Warning):
    """A same-host transfer fell back to the TCP stream (no same-host path could reach the buffer)."""
