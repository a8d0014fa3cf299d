"""Reads from many buffers as one transfer: e.g. a model's tensors, each registered on its own.

Why: a reader that needs a hundred registered tensors of one owner would
otherwise make a hundred transfers, each handed to a transfer thread and
waited for; on a busy host every hand-off costs a scheduling delay (measured:
two replicas reading 226 buffers each spent more time waking threads than
copying). Here the reads of every buffer of one same-host owner go into one
``process_vm_readv`` scatter list (one system call per 1024 ranges), on one
thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from ..runtime import Future
from ._backends import BACKENDS, Unusable, backends_for
from ._buffer import RDMABuffer, _check_timeout, submit
from ._errors import RDMAError
from ._memory import Region

__all__ = ["read_scattered"]


def read_scattered(reads: Sequence[tuple[RDMABuffer, int, Any]], *, timeout: float = 60) -> Future[None]:
    """Copy ``(buffer, offset, dst)`` ranges, from any number of buffers, as one transfer.

    Bytes ``offset .. offset + len(dst)`` of each buffer land in ``dst`` (a
    1-D contiguous writable CPU tensor or memoryview). Same host, the ranges
    of all buffers of one owner process are one scatter copy by the kernel,
    every buffer's registration checked before and after it; other buffers
    (another host, no ``process_vm`` access) are read buffer by buffer with
    :meth:`RDMABuffer.read_ranges`'s paths, one owner's on its own thread
    (they wait on the network). Raises ValueError at once as ``read_ranges``
    does; the future fails as its does (OwnerGoneError, BufferDroppedError,
    RDMATimeoutError), with the first failure when several owners fail.
    """
    by_owner: dict[tuple[str, int], dict[int, tuple[RDMABuffer, list[tuple[int, Region]]]]] = {}
    for buf, offset, dst in reads:
        h = buf._handle
        owner = by_owner.setdefault((h.host, h.pid), {})
        owner.setdefault(h.reg_id, (buf, []))[1].extend(buf._check_ranges([(offset, dst)]))
    deadline = time.monotonic() + _check_timeout(timeout)
    groups = [list(group.values()) for group in by_owner.values()]
    for group in groups:
        for buf, _ in group:
            if buf._dropped:
                return buf._dropped_here()
    return submit(lambda: _read_all(groups, deadline))


def _read_all(groups: list[list[tuple[RDMABuffer, list[tuple[int, Region]]]]], deadline: float) -> None:
    """Same-host owners one after another on this thread (each copy keeps a core busy); others at once."""
    far = [g for g in groups if _backend_name(g[0][0]) == "tcp"]
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_collect, args=(_read_group, g, deadline, errors), daemon=True) for g in far]
    for t in threads:
        t.start()
    for g in groups:
        if not any(g is f for f in far):
            _collect(_read_group, g, deadline, errors)
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0) + 5)
    if errors:
        raise errors[0]


def _collect(fn: Any, group: Any, deadline: float, errors: list[BaseException]) -> None:
    try:
        fn(group, deadline)
    except BaseException as exc:  # handed to the caller, not lost in a thread
        errors.append(exc)


def _read_group(group: list[tuple[RDMABuffer, list[tuple[int, Region]]]], deadline: float) -> None:
    """One owner's reads: one scatter list when every buffer's first backend is ``vm``, else buffer by buffer."""
    vm = BACKENDS.get("vm")
    # one owner process: the same backends reach all its CPU buffers (asked once, not per buffer)
    if vm is not None and _backend_name(group[0][0]) == "vm" and all(buf._handle.device == "cpu" for buf, _ in group):
        reads = [(buf._handle, [(offset, local.address, local.nbytes) for offset, local in regions if local.nbytes])
                 for buf, regions in group]
        try:
            vm.read_scattered(reads, deadline)  # type: ignore[attr-defined]
        except Unusable:
            pass  # access denied: the other paths below
        else:
            for buf, _ in group:
                buf._backend = "vm"
            return
    for buf, regions in group:
        buf._transfer_ranges(regions, deadline)


def _backend_name(buf: RDMABuffer) -> str:
    try:
        return backends_for(buf._handle)[0].name
    except (RDMAError, ValueError):
        return "none"
