"""Actor classes used by the workloads (importable in workers of both implementations).

No torch import here: the RSS workload asserts a noop worker never loads it.
Sync and async endpoints live in separate classes (Monarch refuses to mix them).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from bench._api import Actor, endpoint


class Noop(Actor):
    """Sync actor: a no-op endpoint plus a couple of introspection endpoints."""

    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def loaded(self, module: str) -> bool:
        return module in sys.modules


class AsyncNoop(Actor):
    """Async actor with a no-op endpoint."""

    @endpoint
    async def noop(self) -> None:
        return None


class Tensors(Actor):
    """Receives tensors: ``sum`` returns a float, ``echo`` sends the tensor back.

    torch runs single-threaded here (as in the controller, see bench/payload.py):
    on a 2-core shared machine an OpenMP barrier in ``t.sum()`` otherwise waits
    for a descheduled thread and adds milliseconds of scheduler noise.
    """

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)

    @endpoint
    def sum(self, t: Any) -> float:
        return float(t.sum())

    @endpoint
    def echo(self, t: Any) -> Any:
        return t
