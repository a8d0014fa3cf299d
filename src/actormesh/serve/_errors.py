"""The errors a service's callers see, split by whether the request ran.

::

    Exception
    ├── ServiceError                    a request could not be served (base class)
    │   ├── ServiceOverloaded           every replica's queue is full: refused at once, it did not run
    │   ├── ServiceUnavailable          no replica can take requests (all failed or gone): it did not run
    │   ├── ServiceStopped              the service was stopped; later calls fail at once
    │   └── UnknownSession(LookupError) a session id that was never opened here or was closed
    └── RuntimeError
        └── SupervisionError
            └── ReplicaFailed           the replica died with the request in flight: it may or
                                        may not have run (idempotent endpoints are retried instead)

Errors raised by the endpoint itself reach the caller as ``ActorError`` (also an
instance of the endpoint's exception class), as with a direct call.
"""

from __future__ import annotations

from ..errors import SupervisionError

__all__ = ["ServiceError", "ServiceOverloaded", "ServiceUnavailable", "ServiceStopped", "UnknownSession", "ReplicaFailed"]


class ServiceError(Exception):
    """A request to a service could not be served; ``service`` names the service."""

    def __init__(self, message: str, *, service: str = "") -> None:
        super().__init__(message)
        self.service = service


class ServiceOverloaded(ServiceError):
    """Every eligible replica is at its concurrency limit with a full queue.

    Raised at once by ``route``; the request did not run. Retry later, raise
    ``max_queue``/``max_concurrency``, or add replicas (``svc.scale(n)``).
    """


class ServiceUnavailable(ServiceError):
    """No replica is healthy or starting (all gave up rebuilding, or none left); it did not run."""


class ServiceStopped(ServiceError):
    """The service was stopped: a request made after the stop did not run; one that
    was queued at the stop did not run either; one in flight may have."""


class UnknownSession(ServiceError, LookupError):
    """A session id that this service never opened, or that was closed."""


class ReplicaFailed(SupervisionError):
    """The replica serving the request died (proc killed, actor failed) while the
    request was in flight: it may or may not have run. ``replica`` is its slot."""

    def __init__(self, message: str, *, endpoint: str | None = None, replica: int = -1) -> None:
        super().__init__(message, endpoint=endpoint)
        self.replica = replica
