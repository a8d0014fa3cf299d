"""Endpoint adverbs: how a message to an actor mesh is cast and answered.

``call`` gathers one reply per member into a ValueMesh (first error in rank
order wins), ``call_one`` needs exactly one member, ``choose`` picks one at
random, ``stream`` yields futures in arrival order, ``broadcast`` expects no
answer (a failure goes to the mesh's owner). Arguments are checked against the
endpoint's signature and pickled once, at the call site, in the caller's thread:
wrong arguments and unpicklable values raise TypeError there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from ..errors import SupervisionError
from ..config import get_config
from ..runtime import CastPlan, Future, GatherPort, gather, OnePort, Port, StreamPort, mark_if_self_call, pick_random
from ..telemetry import STATE as _TELEMETRY
from ..telemetry import call_context
from ..transport import dumps
from ._shape import Shape
from ._tensor_methods import need_engine
from ._value_mesh import ValueMesh
from ._views import _cast_hooks, cast_plan, run_cast_hooks

if TYPE_CHECKING:
    from ._actor_mesh import ActorMesh

__all__ = ["Endpoint", "Accumulator", "send", "NotAnEndpoint", "as_endpoint"]

P = ParamSpec("P")
R = TypeVar("R")
A = TypeVar("A")


_NO_ARGS = dumps(((), {}))


class Endpoint(Generic[P, R]):
    """An endpoint of an actor mesh (``mesh.method``), with the adverbs.

    Typed by the method it wraps: for ``def incr(self, by: int) -> int``,
    ``mesh.incr.call_one(1)`` is a ``Future[int]`` and ``mesh.incr.call_one("x")``
    is a type error.
    """

    __slots__ = ("_mesh", "_prop", "_what")

    def __init__(self, mesh: ActorMesh[Any], prop: Any) -> None:
        self._mesh = mesh
        self._prop = prop
        #: ``mesh.endpoint``, as errors and spans name this endpoint (made once, not per call).
        self._what = f"{mesh._name}.{prop.name}"

    def __repr__(self) -> str:
        return f"<Endpoint {self._mesh._name}.{self._prop.name}>"

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        self._prop.bind_check(args, kwargs)
        if _cast_hooks:
            run_cast_hooks(self._mesh)
        if _TELEMETRY.tracing:
            carried = call_context(self._what)  # the callee's endpoint span continues this trace
            if carried is not None:
                return dumps((args, kwargs, carried))
        if not args and not kwargs:
            return _NO_ARGS  # immutable bytes: safe to share between messages
        return dumps((args, kwargs))

    def _dead(self) -> SupervisionError | None:
        """The error calls on this mesh (view) fail with, if the owner knows they cannot succeed."""
        return self._mesh._status_error(self._what)

    def _tree(self, payload: list[Any], reply: tuple[str, int] | None) -> CastPlan:
        """Cast to the whole view along a tree; the plan's ``owed`` gives, per member,
        the address of the top-level subtree root that owes its reply."""
        mesh = self._mesh
        shape = mesh._shape
        plan = cast_plan(mesh, get_config().max_cast_fanout)
        whole = len(shape) == len(mesh._addresses)  # a view of all the ranks is the whole mesh
        mesh._runtime().cast(mesh._mesh_name, self._prop.name, reply, shape.labels, shape.sizes, plan, payload, whole)
        return plan

    def _use_tree(self) -> bool:
        return len(self._mesh._shape) > get_config().max_cast_fanout

    def _cast(self, payload: list[Any], reply: tuple[str, int] | None, indices: range | list[int]) -> None:
        mesh = self._mesh
        rt = mesh._runtime()
        shape = mesh._shape
        labels, sizes = shape.labels, shape.sizes
        actor, ep, addrs = mesh._mesh_name, self._prop.name, mesh._addresses
        rank_at = shape.rank_at
        call = rt.call_actor
        for i in indices:
            call(addrs[rank_at(i)], actor, ep, reply, i, labels, sizes, payload)

    def _describe(self, index: int) -> str:
        return self._mesh._member(self._mesh._shape.rank_at(index))

    def _targets(self) -> list[str]:
        shape, addrs = self._mesh._shape, self._mesh._addresses
        return [addrs[shape.rank_at(i)] for i in range(len(shape))]

    def call(self, *args: P.args, **kwargs: P.kwargs) -> Future[ValueMesh[R]]:
        """Call every member; the Future holds a ValueMesh of the replies."""
        payload = self._prepare(args, kwargs)
        problem = self._dead()
        if problem:
            return Future.failed(problem)
        shape = self._mesh._shape
        result_shape = Shape.row_major(shape.labels, shape.sizes)
        rt = self._mesh._runtime()
        build = lambda values: ValueMesh(result_shape, values)  # noqa: E731
        if self._use_tree():
            port = GatherPort(rt, self._what, [], build, self._describe, expected=len(shape))
            plan = self._tree(payload, (rt.address, port.port_id))
            port.await_addresses(plan.owed, plan.roots)
            mark_if_self_call(port.future, self._mesh._mesh_name, self._targets, self._what)  # listed only for a self-call
            return port.future
        targets = self._targets()
        port = GatherPort(rt, self._what, targets, build, self._describe)
        self._cast(payload, (rt.address, port.port_id), range(len(shape)))
        mark_if_self_call(port.future, self._mesh._mesh_name, targets, self._what)
        return port.future

    def call_one(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call the only member of a one-member mesh (ValueError otherwise)."""
        n = len(self._mesh._shape)
        if n != 1:
            raise ValueError(f"call_one requires exactly 1 actor, but mesh has {n}")
        return self._one(0, args, kwargs)

    def choose(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call one member chosen uniformly at random."""
        n = len(self._mesh._shape)
        if n == 0:
            raise ValueError("choose() on an empty mesh")
        return self._one(pick_random(n), args, kwargs)

    def _one(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future[R]:
        payload = self._prepare(args, kwargs)
        mesh = self._mesh
        what = self._what
        record = mesh._record
        if record is None or record.stopped is not None or record.failed:  # else nothing to check: the hot path
            problem = mesh._status_error(what, [index])
            if problem:
                return Future.failed(problem)
        shape = mesh._shape
        g = shape.rank_at(index)
        addr = mesh._addresses[g]
        rt = mesh._runtime()
        port = OnePort(rt, what, addr, lambda _: mesh._member(g), index)
        rt.call_actor(addr, mesh._mesh_name, self._prop.name, (rt.address, port.port_id), index, shape.labels, shape.sizes, payload)
        mark_if_self_call(port.future, mesh._mesh_name, (addr,), what)
        return port.future

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> Iterator[Future[R]]:
        """Call every member; yield one Future per member, completed in arrival order."""
        payload = self._prepare(args, kwargs)
        problem = self._dead()
        if problem:
            futures = [Future.failed(problem) for _ in range(len(self._mesh._shape))]
        else:
            targets = self._targets()
            port = StreamPort(self._mesh._runtime(), self._what, targets, self._describe)
            self._cast(payload, (port.runtime.address, port.port_id), range(len(self._mesh._shape)))
            futures = port.futures
            for f in futures:
                mark_if_self_call(f, self._mesh._mesh_name, targets, self._what)
        return iter(futures)

    def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Send to every member, expecting no reply. Errors go to the mesh's owner."""
        payload = self._prepare(args, kwargs)
        problem = self._dead()
        if problem:
            raise problem
        if self._use_tree():
            self._tree(payload, None)
            return
        self._cast(payload, None, range(len(self._mesh._shape)))

    def rref(self, *args: Any, **kwargs: Any) -> Any:
        """Inside ``mesh.activate()``: call every member as a tensor-engine command and
        return its per-proc result as a distributed tensor (needs ``propagate=``)."""
        return need_engine("Endpoint.rref()").endpoint_rref(self._mesh, self._prop, args, kwargs)

    def _send(self, args: tuple[Any, ...], kwargs: dict[str, Any], port: Port[Any] | None, selection: str) -> None:
        payload = self._prepare(args, kwargs)
        ref = port.ref if port is not None else None
        n = len(self._mesh._shape)
        if selection == "all":
            self._cast(payload, ref, range(n))
        elif selection == "choose":
            self._cast(payload, ref, [pick_random(n)])
        else:
            raise ValueError(f"selection must be 'all' or 'choose', got {selection!r}")


class NotAnEndpoint:
    """What a plain (non-endpoint) method looks like on an actor mesh."""

    def __init__(self, mesh: Any, name: str) -> None:
        self._mesh = mesh
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"Actor {self._mesh._class.__qualname__}.{self._name} is not annotated as an endpoint; add @endpoint or use as_endpoint().")

    def __getattr__(self, name: str) -> Any:
        if name in ("call", "call_one", "choose", "stream", "broadcast", "rref"):
            return self
        raise AttributeError(name)


def as_endpoint(method: Any, *, propagate: Any = None, explicit_response_port: bool = False) -> Endpoint[..., Any]:
    """Call a plain (non-``@endpoint``) method of a mesh's actors as an endpoint.

    Example: ``as_endpoint(counters.helper).call(3)``. ValueError for anything
    that is not a plain method looked up on an actor mesh.
    """
    if not isinstance(method, NotAnEndpoint):
        raise ValueError(f"as_endpoint() needs a plain method looked up on an actor mesh (mesh.method), got {method!r}")
    from ..runtime import EndpointProperty

    fn = getattr(method._mesh._class, method._name)
    prop: EndpointProperty[Any] = EndpointProperty(fn, explicit_response_port=explicit_response_port, propagate=propagate)
    prop.name = method._name
    return Endpoint(method._mesh, prop)


def send(endpoint: Endpoint[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], port: Port[Any] | None = None, selection: str = "all") -> None:
    """Low-level send: replies (one per member) go to ``port``; no port = broadcast."""
    endpoint._send(tuple(args), dict(kwargs), port, selection)


class Accumulator(Generic[R, A]):
    """Fold the replies of an endpoint, in arrival order.

    Example::

        total = Accumulator(counters.value, 0, lambda acc, v: acc + v).accumulate().get()
    """

    def __init__(self, endpoint: Endpoint[..., R], identity: A, combine: Callable[[A, R], A]) -> None:
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine

    def accumulate(self, *args: Any, **kwargs: Any) -> Future[A]:
        """Call every member now; the Future holds the folded result."""
        futures = list(self._endpoint.stream(*args, **kwargs))
        identity, combine = self._identity, self._combine

        def fold(values: list[Any]) -> A:
            acc = identity
            for v in values:
                acc = combine(acc, v)
            return acc

        return gather(futures, what="accumulate").then(fold)
