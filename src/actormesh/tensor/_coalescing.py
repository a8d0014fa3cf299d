"""``coalescing()``: the commands recorded inside go to the workers together.

Monarch records the block and sends it as one message at its end. actormesh
records every command anyway and sends batches; inside ``coalescing()`` the
block's commands leave at its end in one flush (per mesh) unless something in
the block needs them earlier: a fetch, an actor call on the mesh, or the size
bound (``FLUSH_EVERY`` commands). Nested blocks join the outer one. The flush
happens also when the block raises, so the handles made inside stay valid.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ._client import flush_all

__all__ = ["coalescing"]

_tls = threading.local()


@contextmanager
def coalescing() -> Iterator[None]:
    """``with coalescing():`` send the block's tensor commands together at its end."""
    depth = getattr(_tls, "depth", 0)
    _tls.depth = depth + 1
    try:
        yield
    finally:
        _tls.depth = depth
        if depth == 0:
            flush_all()
