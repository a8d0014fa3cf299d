"""What a service keeps per request, its settings, and a small future combinator."""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Any

from ..runtime import Future

__all__ = ["ServiceSpec", "Request"]


@dataclass(frozen=True)
class ServiceSpec:
    """How a service builds and serves its replicas (see ``Service`` for each field)."""

    name: str
    actor_class: type
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    per_host: dict[str, int]
    hosts: Any
    max_concurrency: int
    max_queue: int
    idempotent: frozenset[str]
    all_members: frozenset[str]
    max_retries: int
    build_timeout_s: float
    drain_timeout_s: float
    max_rebuilds: int

    def to_all(self, endpoint: str) -> bool:
        """Whether ``endpoint`` goes to every member of a replica (else to rank 0 only)."""
        return "*" in self.all_members or endpoint in self.all_members


class Request:
    """One call through a service: where it is, how often it was tried, its future."""

    __slots__ = ("endpoint", "args", "kwargs", "future", "start", "attempts", "session", "generation", "fanout")

    def __init__(self, endpoint: str, args: tuple[Any, ...], kwargs: dict[str, Any], session: str | None, fanout: bool = False) -> None:
        self.endpoint = endpoint
        self.args = args
        self.kwargs = kwargs
        self.future: Future[Any] = Future._create()
        self.start = perf_counter()
        self.attempts = 1
        self.session = session
        self.generation = -1  #: incarnation of the replica it was sent to
        self.fanout = fanout
