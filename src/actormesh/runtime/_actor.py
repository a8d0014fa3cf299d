"""The user's side of an actor: the ``Actor`` base class, endpoint decorators,
``MeshFailure``, and the per-message ``Context``.

How an actor class is checked before spawning lives here too
(:func:`check_actor_class`), so every spawner applies the same rules.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..extent import Extent, Point

if TYPE_CHECKING:
    from ._proc import ProcRuntime

__all__ = [
    "Actor",
    "endpoint",
    "concurrent_endpoint",
    "EndpointProperty",
    "MeshFailure",
    "Context",
    "Instance",
    "check_actor_class",
    "endpoints_of",
    "ProcView",
    "use_proc_view",
]

R = TypeVar("R")

#: A runtime's process as a one-proc mesh (the mesh layer's ``ProcMesh``).
ProcView = Callable[["ProcRuntime"], Any]

_proc_view: ProcView | None = None


def use_proc_view(view: ProcView) -> None:
    """Register what :attr:`Instance.proc` returns: the mesh layer does, when imported."""
    global _proc_view
    _proc_view = view


class EndpointProperty(Generic[R]):
    """What ``@endpoint`` leaves on the class: the function plus how it is called.

    On an actor instance it behaves like the plain method; on an actor mesh the
    mesh layer turns it into an ``Endpoint`` with the adverbs.
    """

    def __init__(self, fn: Callable[..., Any], *, explicit_response_port: bool = False, concurrent: bool = False, propagate: Any = None, instrument: bool = True) -> None:
        if not callable(fn):
            raise TypeError(f"@endpoint decorates a function, got {fn!r}")
        self._fn = fn
        self.explicit_response_port = explicit_response_port
        self.concurrent = concurrent
        #: how the tensor engine shapes ``rref`` results (Monarch's ``propagate``)
        self.propagate = propagate
        self.is_async = inspect.iscoroutinefunction(fn)
        self.name = fn.__name__
        self.signature = inspect.signature(fn)
        self._fast_arity = _positional_arity(self.signature, 2 if explicit_response_port else 1)
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        getter = getattr(obj, "_endpoint_access", None)
        if getter is not None:  # an actor mesh
            return getter(self)
        return self._fn.__get__(obj, objtype)

    def bind_check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise TypeError if the arguments do not fit the endpoint's signature."""
        fast = self._fast_arity
        if fast is not None and not kwargs and fast[0] <= len(args) <= fast[1]:
            return  # the common case, without inspect's slow bind()
        try:
            if self.explicit_response_port:
                self.signature.bind(None, None, *args, **kwargs)
            else:
                self.signature.bind(None, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"bad arguments for endpoint {self.name!r}: {exc}") from None


def _positional_arity(sig: inspect.Signature, skip: int) -> tuple[int, int] | None:
    """(min, max) positional arguments after ``skip`` leading ones, if the
    signature is plain positional parameters (else None: use bind())."""
    params = list(sig.parameters.values())[skip:]
    low = high = 0
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return None
        high += 1
        if p.default is p.empty:
            if low != high - 1:
                return None
            low += 1
    return (low, high)


def endpoint(method: Callable[..., Any] | None = None, *, propagate: Any = None, explicit_response_port: bool = False, instrument: bool = True) -> Any:
    """Mark an actor method as an endpoint callable on actor meshes.

    Works bare (``@endpoint``) or with options (``@endpoint(explicit_response_port=True)``).
    With ``explicit_response_port`` the method gets a ``Port`` as first argument
    and replies through it; raising from such a method fails the actor.

    Example::

        class Counter(Actor):
            def __init__(self, start: int = 0):
                self.n = start

            @endpoint
            def incr(self) -> int:
                self.n += 1
                return self.n
    """

    def wrap(fn: Callable[..., Any]) -> EndpointProperty[Any]:
        if isinstance(fn, EndpointProperty):
            raise TypeError(f"{fn.name!r} is already an endpoint; apply @endpoint once")
        return EndpointProperty(fn, explicit_response_port=explicit_response_port, propagate=propagate, instrument=instrument)

    return wrap(method) if method is not None else wrap


def concurrent_endpoint(method: Callable[..., Any] | None = None, *, propagate: Any = None, explicit_response_port: bool = False, instrument: bool = True) -> Any:
    """Like :func:`endpoint`, but the actor may take its next message while this
    one awaits. Only for ``async def`` methods; messages start in arrival order.
    """

    def wrap(fn: Callable[..., Any]) -> EndpointProperty[Any]:
        if isinstance(fn, EndpointProperty):
            raise TypeError(f"{fn.name!r} is already an endpoint; do not stack @concurrent_endpoint with @endpoint")
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"@concurrent_endpoint needs an async def method, {fn.__name__!r} is not")
        return EndpointProperty(fn, explicit_response_port=explicit_response_port, concurrent=True, propagate=propagate, instrument=instrument)

    return wrap(method) if method is not None else wrap


def _doc_stub(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn._actormesh_doc_stub = True  # type: ignore[attr-defined]
    return fn


class Actor:
    """Base class of every actor. Subclass it and mark methods with ``@endpoint``.

    ``__init__`` runs on each rank with the arguments given to ``spawn``, before
    any endpoint message. An actor handles one message at a time.
    """

    @functools.cached_property
    def logger(self) -> logging.Logger:
        """A logger named after the actor class."""
        lg = logging.getLogger(type(self).__name__)
        lg.setLevel(logging.DEBUG)
        return lg

    @_doc_stub
    def __supervise__(self, failure: MeshFailure) -> Any:
        """Called on the owner when a mesh it spawned fails. Return True to handle it;
        a falsy return or an exception fails this actor and passes the failure up."""
        return False

    @_doc_stub
    def __cleanup__(self, exc: BaseException | None) -> None:
        """Called once when the actor stops (``exc`` None) or fails."""


def _overrides(cls: type, name: str) -> bool:
    fn = getattr(cls, name, None)
    return fn is not None and not getattr(fn, "_actormesh_doc_stub", False)


def endpoints_of(cls: type) -> dict[str, EndpointProperty[Any]]:
    """All endpoints of an actor class by name (inherited ones included)."""
    found: dict[str, EndpointProperty[Any]] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, EndpointProperty):
                found[name] = value
    return found


_kind_cache: dict[type, bool] = {}


def check_actor_class(cls: Any, reserved: frozenset[str] = frozenset()) -> bool:
    """Validate an actor class for spawning; return True if it is an async actor.

    Raises ValueError for a class that is not an Actor, mixes sync and async
    endpoints or hooks, or has an endpoint named like a mesh attribute.
    """
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise ValueError(f"{cls!r} must subclass actormesh.actor.Actor to spawn it.")
    cached = _kind_cache.get(cls)
    if cached is not None:
        return cached
    eps = endpoints_of(cls)
    clash = sorted(set(eps) & reserved)
    if clash:
        raise ValueError(
            f"ActorMesh has an attribute that collides with an endpoint name: {', '.join(clash)}; rename the endpoint(s) of {cls.__qualname__}."
        )
    kinds = {ep.is_async for ep in eps.values()}
    if len(kinds) > 1:
        raise ValueError(f"{cls.__qualname__} mixes sync and async endpoints; make them all `def` or all `async def`.")
    is_async = kinds.pop() if kinds else False
    for hook in ("__cleanup__", "__supervise__"):
        if eps and _overrides(cls, hook) and inspect.iscoroutinefunction(getattr(cls, hook)) != is_async:
            raise ValueError(f"{cls.__qualname__}.{hook} must be {'async' if is_async else 'sync'} like its endpoints.")
    if not eps:
        is_async = any(_overrides(cls, h) and inspect.iscoroutinefunction(getattr(cls, h)) for h in ("__cleanup__", "__supervise__"))
    _kind_cache[cls] = is_async
    return is_async


@dataclass
class MeshFailure:
    """A failure of a mesh the receiving actor owns (given to ``__supervise__``).

    ``mesh_name`` identifies the mesh (compare with ``mesh._name``), ``crashed_ranks``
    the failed ranks, ``cause`` what happened: a :class:`~actormesh.errors.Cause`,
    text (exit code, signal, traceback) whose ``kind``, ``code`` and ``signal``
    say the same as data.
    """

    mesh_name: str
    crashed_ranks: list[int]
    cause: str
    actor: str = ""
    mesh: Any = None

    def report(self) -> str:
        """A readable account of the failure."""
        who = self.actor or self.mesh_name
        return f"The actor {who} and all its descendants have failed:\n  {self.cause}"

    def __str__(self) -> str:
        return self.report()

    def __repr__(self) -> str:
        return f"MeshFailure(mesh_name={self.mesh_name}, crashed_ranks={self.crashed_ranks}, event={str(self.cause)!r})"


class Instance:
    """The running actor (or the client) as seen by its own code: ``context().actor_instance``."""

    def __init__(self, *, runtime: ProcRuntime, name: str, display: str, rank: Any, class_name: str, cell: Any = None, creator: Any = None) -> None:
        self._runtime = runtime
        self.name = name
        self._display = display
        self.rank = rank
        self.class_name = class_name
        self._cell = cell
        self.creator = creator
        self._proc_mesh: Any = None
        # The proc meshes this actor (or the client) spawned and has not seen stop,
        # newest last; Monarch's test helpers read and prune it (``_children``).
        self._children: list[Any] | None = None

    @property
    def display(self) -> str:
        """How this actor is named in logs and errors (``<root>.<Class name>[rank]``)."""
        return self._display

    def spawned(self, proc_mesh: Any, running: Callable[[Any], bool]) -> None:
        """Note a proc mesh this actor (or the client) spawned; forget the ones no longer ``running``."""
        self._children = [*(m for m in self._children or () if running(m)), proc_mesh]

    @property
    def is_actor(self) -> bool:
        """Whether this is an actor (not the client, nor a worker proc's own context)."""
        return self._cell is not None

    @property
    def actor_id(self) -> str:
        """A unique name for this actor: ``<actor>@<proc address>``."""
        return f"{self.name}@{self._runtime.address}"

    @property
    def proc_id(self) -> str:
        """The address of the process this actor runs in."""
        return self._runtime.address

    @property
    def proc(self) -> Any:
        """A ``ProcMesh`` of just this actor's process (spawn more actors next to it).

        ProcMesh is the mesh layer's type, which registers it (:func:`use_proc_view`)."""
        if _proc_view is None:
            raise RuntimeError("actor_instance.proc needs the mesh layer, which is not loaded in this process: "
                               "import actormesh.actor")
        return _proc_view(self._runtime)

    @property
    def proc_mesh(self) -> Any:
        """Same as :attr:`proc` (the full spawning mesh is not tracked here)."""
        return self.proc

    def stop(self, reason: str | None = None) -> None:
        """Stop this actor gracefully after the current message."""
        if self._cell is not None:
            self._cell.request_stop(None)

    def abort(self, reason: str | None = None) -> None:
        """Fail this actor: a supervision event goes to its owner."""
        if self._cell is not None:
            self._cell.request_stop(reason or "aborted")

    kill = abort

    def __repr__(self) -> str:
        return self._display


class Context:
    """Where a piece of code runs: ``context().actor_instance``, ``context().message_rank``."""

    __slots__ = ("actor_instance", "_extent")

    def __init__(self, actor_instance: Instance) -> None:
        self.actor_instance = actor_instance

    @property
    def message_rank(self) -> Point:
        """This actor's point within the slice the current message was sent to."""
        raw = _message_rank.get()
        if raw is None:
            return _NO_RANK
        return make_point(*raw)


def make_point(rank: int, labels: tuple[str, ...], sizes: tuple[int, ...]) -> Point:
    """The point that a message's raw rank ``(rank, labels, sizes)`` names."""
    return Point(rank, Extent(labels, sizes))


#: Outside any message (the client, a proc's own context): the one point of no dimensions.
_NO_RANK = make_point(0, (), ())
_message_rank: ContextVar[Any] = ContextVar("actormesh_message_rank", default=None)
_context: ContextVar[Context | None] = ContextVar("actormesh_context", default=None)
