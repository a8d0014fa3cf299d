"""A Service sent to another process: a handle whose calls go through the service's owner.

Composition (Ray Serve's model composition): an actor, or a replica of another
service, holds a service and calls it. The routing state (replicas, queues,
sessions, the router) lives in the process that created the service, so a handle
sends each call to the service's owner actor there, which checks the arguments
and routes it as a local ``route`` would: the same admission limits, routers and
failure rules, and the value or error comes back. That costs two hops more than
a local ``route``. Pickling a :class:`~actormesh.serve.Service` gives a handle,
so a service can be an endpoint argument or an actor's constructor argument.
"""

from __future__ import annotations

from typing import Any

from ..runtime import Future

__all__ = ["ServiceHandle", "HandleEndpoint"]


class ServiceHandle:
    """A service as seen from another process: ``handle.method.route(...)`` and
    ``handle.method.fanout(...)``, each a Future (``.get()`` or ``await``)."""

    def __init__(self, owner: Any, name: str, endpoints: frozenset[str]) -> None:
        self._owner = owner
        self._name = name
        self._endpoint_names = endpoints

    @property
    def name(self) -> str:
        """The service's name."""
        return self._name

    def __getattr__(self, name: str) -> HandleEndpoint:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._endpoint_names:
            known = ", ".join(sorted(self._endpoint_names)) or "none"
            raise AttributeError(f"service {self._name} has no endpoint {name!r}; its endpoints: {known}")
        return HandleEndpoint(self._owner, name)

    def __reduce__(self) -> Any:
        return (ServiceHandle, (self._owner, self._name, self._endpoint_names))

    def __repr__(self) -> str:
        return f"<ServiceHandle {self._name}>"


class HandleEndpoint:
    """One endpoint of a :class:`ServiceHandle`."""

    __slots__ = ("_owner", "_name")

    def __init__(self, owner: Any, name: str) -> None:
        self._owner = owner
        self._name = name

    def route(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """One request to one replica, as ``Service``'s ``route``. The future raises what a
        local route raises (``ServiceOverloaded``, ``ReplicaFailed``, the endpoint's error,
        a ``TypeError`` for arguments that do not fit), as an ``ActorError`` that is also
        an instance of that class."""
        return self._owner.route.call_one(self._name, args, kwargs, None)

    def route_session(self, session_id: str, *args: Any, **kwargs: Any) -> Future[Any]:
        """``route`` within a session the service's process opened (``svc.session()``)."""
        return self._owner.route.call_one(self._name, args, kwargs, session_id)

    def fanout(self, *args: Any, **kwargs: Any) -> Future[list[Any]]:
        """Every healthy replica, as ``Service``'s ``fanout``: their values in replica order."""
        return self._owner.fanout.call_one(self._name, args, kwargs)
