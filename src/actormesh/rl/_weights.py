"""Weight sync from the trainer to the generator replicas."""

from __future__ import annotations

import time
from typing import Any

from ..parallel import gather_state_dict

__all__ = ["push_weights"]


def push_weights(trainer: Any, generator: Any, timeout_s: float) -> float:
    """The trainer's current weights into every generator replica (each swaps between two decode
    steps, running sequences go on with the new weights); returns the seconds it took.

    Raises ValueError (nothing swapped) if a replica refuses them, naming the first mismatch.
    """
    t0 = time.perf_counter()
    generator.update_weights(gather_state_dict(trainer, timeout=timeout_s), timeout_s=timeout_s)
    return time.perf_counter() - t0
