"""What a service keeps per request, its settings and the checks of its options."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from ..runtime import Actor, Future, endpoints_of

__all__ = ["ServiceSpec", "Request", "check_class", "check_int", "per_host", "endpoint_names"]


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


# -- checks of a service's options (TypeError/ValueError before any proc starts) -------------
def check_class(cls: Any, args: tuple[Any, ...] | None, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The endpoints of ``cls``; refuses a class that is not an Actor, or ``args`` its ``__init__`` cannot take."""
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise ValueError(f"a service needs an Actor subclass, got {cls!r}")
    if args is not None and cls.__init__ is not object.__init__:
        try:
            inspect.signature(cls.__init__).bind(None, *args, **(kwargs or {}))
        except TypeError as exc:
            raise TypeError(f"bad arguments for {cls.__qualname__}.__init__: {exc}") from None
    return endpoints_of(cls)


def check_int(label: str, value: Any, low: int) -> None:
    """ValueError unless ``value`` is an int (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{label} must be an int >= {low}, got {value!r}")


def per_host(procs: Any) -> dict[str, int]:
    """``procs_per_replica`` as a ``per_host`` dict (an int means that many ``gpus``)."""
    if isinstance(procs, Mapping):
        if not procs:
            raise ValueError("procs_per_replica must not be an empty dict")
        for label, size in procs.items():
            if not isinstance(label, str):
                raise TypeError(f"procs_per_replica keys must be dimension names (str), got {label!r}")
            check_int(f"procs_per_replica[{label!r}]", size, 1)
        return dict(procs)
    check_int("procs_per_replica", procs, 1)
    return {"gpus": procs}


def endpoint_names(label: str, names: Iterable[str], eps: dict[str, Any], cls: type) -> frozenset[str]:
    """``names`` as a set, each an endpoint of ``cls`` (ValueError naming the others)."""
    if isinstance(names, str):
        names = [names]
    out = frozenset(names)
    unknown = sorted(out - set(eps))
    if unknown:
        raise ValueError(f"{label} names {unknown}, which are not endpoints of {cls.__qualname__} (its endpoints: {sorted(eps)})")
    return out
