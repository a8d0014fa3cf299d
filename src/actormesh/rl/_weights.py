"""Weight sync from the trainer's ranks to the generator replicas, the controller out of the data path."""

from __future__ import annotations

import time
from typing import Any

from ..parallel import publish_weights

__all__ = ["push_weights"]


def push_weights(trainer: Any, generator: Any, version: int, timeout_s: float) -> float:
    """The trainer's current weights into every generator replica; returns the seconds it took.

    The trainer's ranks publish their full tensors as RDMA buffers (FSDP and
    TP shards gathered by torch on each stage's first rank); only the handles
    pass through here, and every rank of every replica reads the bytes
    directly, checks them and swaps between two decode steps (running
    sequences go on with the new weights). Raises ValueError (nothing
    swapped) if a replica refuses them, naming the first mismatch.
    """
    t0 = time.perf_counter()
    published = publish_weights(trainer, version, timeout=timeout_s)
    generator.update_weights(published, timeout_s=timeout_s)
    return time.perf_counter() - t0
