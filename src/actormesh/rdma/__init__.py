"""One-sided buffer transfers: Monarch's ``monarch.rdma`` API, ``actormesh.rdma`` here.

A process registers memory with ``RDMABuffer(tensor)`` (no copy); the small
handle travels in messages; any holder moves the bytes with ``read_into`` /
``write_from`` without the owner's code taking part. Same host: one memcpy
by the kernel (``process_vm_readv``/``writev``), or shared memory when that is
not permitted. Across hosts: a bulk TCP stream between the two processes.
See docs/rdma.md for the backends, settings and the seam for ibverbs/UCX.

Example::

    from actormesh.rdma import RDMABuffer

    buf = RDMABuffer(weights.view(-1))      # in the owner
    buf.read_into(local).get(timeout=30)    # anywhere the handle went
"""

from ._action import RDMAAction
from ._backends import Backend, BufferHandle, register_backend
from ._buffer import RDMABuffer, get_rdma_backend, is_ibverbs_available, is_rdma_available, same_host_backend
from ._scatter import read_scattered
from ._errors import (
    BufferDroppedError,
    OwnerGoneError,
    RDMAError,
    RDMAReadTransferWarning,
    RDMATcpFallbackWarning,
    RDMATimeoutError,
    RDMAWriteTransferWarning,
)

__all__ = [
    "RDMABuffer",
    "RDMAAction",
    "read_scattered",
    "get_rdma_backend",
    "same_host_backend",
    "is_rdma_available",
    "is_ibverbs_available",
    "RDMAError",
    "OwnerGoneError",
    "BufferDroppedError",
    "RDMATimeoutError",
    "RDMAReadTransferWarning",
    "RDMAWriteTransferWarning",
    "RDMATcpFallbackWarning",
    "Backend",
    "BufferHandle",
    "register_backend",
]
