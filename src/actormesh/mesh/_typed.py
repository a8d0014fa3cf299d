"""What a type checker sees of ``@endpoint``: the method's signature carried to the adverbs.

The runtime's ``endpoint`` makes an ``EndpointProperty``; on an actor mesh the
mesh layer turns it into an :class:`~._endpoint.Endpoint`. The runtime cannot
name ``Endpoint`` (it knows nothing of meshes), so the typed face lives here:
at run time ``endpoint`` *is* the runtime's decorator, and under
``TYPE_CHECKING`` it is declared with ``ParamSpec`` overloads, so that

    class Counter(Actor):
        @endpoint
        def incr(self, by: int) -> int: ...

        @endpoint
        async def name(self) -> str: ...

    counters = procs.spawn("c", Counter)
    counters.incr.call_one(1)   # Future[int]
    counters.name.call()        # Future[ValueMesh[str]]
    counters.incr.call_one("x") # a type error

``explicit_response_port=True`` methods take their ``Port`` first; callers do not
pass it, and the reply type is the port's.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, Generic, Literal, ParamSpec, Protocol, TypeVar, overload

from ..runtime import EndpointProperty as _RuntimeEndpointProperty
from ..runtime import concurrent_endpoint as _runtime_concurrent_endpoint
from ..runtime import endpoint as _runtime_endpoint

P = ParamSpec("P")
R = TypeVar("R")

if TYPE_CHECKING:
    from ..runtime import Port
    from ._endpoint import Endpoint

    class EndpointProperty(Generic[P, R]):
        """Typing view of the runtime's ``EndpointProperty``."""

        name: str

        @overload
        def __get__(self, obj: None, objtype: type | None = None) -> EndpointProperty[P, R]: ...
        @overload
        def __get__(self, obj: object, objtype: type | None = None) -> Endpoint[P, R]: ...
        def __get__(self, obj: object | None, objtype: type | None = None) -> Any: ...

    class _Decorator(Protocol):
        """``@endpoint(...)`` with options: applied to a method, keeps its signature."""

        @overload
        def __call__(self, method: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]], /) -> EndpointProperty[P, R]: ...  # type: ignore[overload-overlap]
        @overload
        def __call__(self, method: Callable[Concatenate[Any, P], R], /) -> EndpointProperty[P, R]: ...

    class _PortDecorator(Protocol):
        """``@endpoint(explicit_response_port=True)``: the Port comes first and sets the reply type."""

        def __call__(self, method: Callable[Concatenate[Any, Port[R], P], Any], /) -> EndpointProperty[P, R]: ...

    @overload
    def endpoint(method: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]], /) -> EndpointProperty[P, R]: ...  # type: ignore[overload-overlap]
    @overload
    def endpoint(method: Callable[Concatenate[Any, P], R], /) -> EndpointProperty[P, R]: ...
    @overload
    def endpoint(
        method: None = None, *, propagate: Any = None, explicit_response_port: Literal[False] = False, instrument: bool = True
    ) -> _Decorator: ...
    @overload
    def endpoint(method: None = None, *, propagate: Any = None, explicit_response_port: Literal[True], instrument: bool = True) -> _PortDecorator: ...
    def endpoint(method: Any = None, **options: Any) -> Any: ...

    @overload
    def concurrent_endpoint(method: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]], /) -> EndpointProperty[P, R]: ...
    @overload
    def concurrent_endpoint(
        method: None = None, *, propagate: Any = None, explicit_response_port: Literal[False] = False, instrument: bool = True
    ) -> _Decorator: ...
    @overload
    def concurrent_endpoint(
        method: None = None, *, propagate: Any = None, explicit_response_port: Literal[True], instrument: bool = True
    ) -> _PortDecorator: ...
    def concurrent_endpoint(method: Any = None, **options: Any) -> Any: ...

else:
    EndpointProperty = _RuntimeEndpointProperty
    endpoint = _runtime_endpoint
    concurrent_endpoint = _runtime_concurrent_endpoint

__all__ = ["EndpointProperty", "endpoint", "concurrent_endpoint"]
