"""The one exception tree of actormesh, split by blame and by certainty.

::

    Exception
    ├── ActorError                 user code raised in a remote endpoint; the actor lives.
    │                              ``except ValueError`` still catches a remote ValueError:
    │                              the instance is also an instance of the user's class.
    ├── RuntimeError
    │   ├── SupervisionError       the actor (or its process) died or was stopped; the call
    │   │                          may or may not have run. Names actor, rank and cause.
    │   ├── MeshStoppedError(SupervisionError)  the mesh was stopped on purpose.
    │   └── TransportError         the system failed to move bytes (connection lost,
    │       │                      peer unreachable, timed out connecting).
    │       ├── ProtocolError      the peer broke protocol: malformed or oversized frame.
    │       ├── AuthenticationError  the peer failed the HMAC handshake.
    │       └── ResourceExhaustedError  a process ran out of descriptors or memory taking
    │                              in one message: that message failed (it never ran),
    │                              the process lives. Names the process and the resource.
    └── ConfigError(ValueError)    a setting was unknown or had the wrong type.

Lower layers raise the transport errors; the runtime translates them into
SupervisionError at the boundary (``raise SupervisionError(...) from exc``).
"""

from __future__ import annotations

import types
from typing import Any

__all__ = [
    "ActorError",
    "RemoteException",
    "SupervisionError",
    "MeshStoppedError",
    "PortClosedError",
    "TransportError",
    "ProtocolError",
    "AuthenticationError",
    "ResourceExhaustedError",
    "ConfigError",
]


class TransportError(RuntimeError):
    """Bytes could not be moved: a connection failed or was lost."""


class ProtocolError(TransportError):
    """The peer sent bytes that break the framing protocol (blame: the peer)."""


class AuthenticationError(TransportError):
    """The peer did not prove knowledge of the job secret."""


class ResourceExhaustedError(TransportError):
    """A process could not take in one message: it ran out of file descriptors or
    memory (opening shared memory, mapping, decoding). The message was not run;
    the process serves on. ``resource`` is ``"file descriptors"`` or ``"memory"``."""

    def __init__(self, message: str, resource: str = "") -> None:
        super().__init__(message)
        self.resource = resource


class ConfigError(ValueError):
    """A configuration key was unknown or its value had the wrong type."""


class SupervisionError(RuntimeError):
    """The actor a caller waits on failed or stopped; the call may or may not have run.

    ``endpoint`` names the endpoint that was being called, when known.
    """

    def __init__(self, message: str, *, endpoint: str | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint


class MeshStoppedError(SupervisionError):
    """The mesh was stopped on purpose; calls on it fail at once."""


class PortClosedError(RuntimeError):
    """``recv()`` on a port that was closed, or on a ``once`` port already used up.

    Nothing more will arrive on that port: open a new ``Channel`` to go on.
    """


class RemoteException(Exception):
    """A tensor-engine command (an op or a remote function) failed on a worker.

    Raised where its result is fetched, not where it was issued: ``rank`` is the
    proc, ``worker_traceback`` the worker's traceback, ``issued_at`` the
    controller line that issued the failing command. The worker keeps serving;
    tensors that do not depend on the failed one are unaffected.
    """

    def __init__(self, rank: int, message: str, worker_traceback: str = "", issued_at: str = "") -> None:
        self.rank = rank
        self.message = message
        self.worker_traceback = worker_traceback
        self.issued_at = issued_at
        text = f"A remote function has failed asynchronously on rank {rank}: {message}"
        if issued_at:
            text += f"\n Issued by the controller at: {issued_at}"
        if worker_traceback:
            text += f"\n Traceback on the worker (most recent call last):\n{worker_traceback}"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemoteException, (self.rank, self.message, self.worker_traceback, self.issued_at))


class ActorError(Exception):
    """A remote endpoint raised: ``.exception`` is the original exception.

    ``str()`` carries the remote traceback. The actor that raised keeps serving.
    Instances returned by the runtime are also instances of the original
    exception's class when that class can be subclassed, so ``except ValueError``
    catches a remote ``ValueError``.
    """

    def __init__(
        self,
        exception: BaseException,
        message: str = "A remote actor call has failed.",
        exception_formatted: str | None = None,
    ) -> None:
        Exception.__init__(self, message)
        self.exception = exception
        self.message = message
        self.exception_formatted = exception_formatted or repr(exception)

    def __str__(self) -> str:
        return (
            f"{self.message}\n Traceback of where the remote call failed (most recent call last):\n"
            f"{self.exception_formatted}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_actor_error, (self.exception, self.message, self.exception_formatted))


_mixed_classes: dict[type, type] = {}


def _rebuild_actor_error(exc: BaseException, message: str, formatted: str) -> ActorError:
    return make_actor_error(exc, message, formatted)


def make_actor_error(exc: BaseException, message: str, formatted: str) -> ActorError:
    """Build an ActorError that is also an instance of ``type(exc)`` when possible."""
    cls = type(exc)
    mixed = _mixed_classes.get(cls)
    if mixed is None:
        try:
            mixed = type(f"ActorError[{cls.__name__}]", (ActorError, cls), {"__module__": __name__})
        except TypeError:  # final classes or incompatible layouts
            mixed = ActorError
        _mixed_classes[cls] = mixed
    err = _instantiate(mixed, exc)
    # Exception attributes of the user's class (errno, args...) mirror the original.
    try:
        err.__dict__.update(getattr(exc, "__dict__", {}))
    except Exception:
        pass
    try:
        ActorError.__init__(err, exc, message, formatted)
    except AttributeError:  # the class claims one of our names read-only (ExceptionGroup.message)
        _mixed_classes[cls] = mixed = ActorError
        err = ActorError.__new__(ActorError)
        ActorError.__init__(err, exc, message, formatted)
    err.args = getattr(exc, "args", ())
    if mixed is not ActorError:
        _copy_builtin_fields(err, exc)
    return err


# Fields that belong to the ActorError, or that the caller's side sets itself.
_OWN_FIELDS = frozenset({"__class__", "args", "__dict__", "__weakref__", "__traceback__", "__context__", "__cause__", "__suppress_context__", "__notes__"})


def _copy_builtin_fields(err: BaseException, exc: BaseException) -> None:
    """Mirror the C-level fields of builtin exceptions (``OSError.errno``,
    ``StopIteration.value``, ``SystemExit.code``...), which live outside ``__dict__``."""
    for klass in type(exc).__mro__:
        if klass.__module__ != "builtins" or klass is object or klass is BaseException:
            continue
        for name, descriptor in vars(klass).items():
            if name in _OWN_FIELDS or not isinstance(descriptor, (types.MemberDescriptorType, types.GetSetDescriptorType)):
                continue
            try:
                setattr(err, name, getattr(exc, name))
            except (AttributeError, TypeError):
                pass


def _instantiate(mixed: type, exc: BaseException) -> ActorError:
    """A bare instance of ``mixed`` (``__init__`` not run).

    Builtins with their own ``__new__`` refuse some callers: ``MemoryError``
    only lets its C base allocate a subclass (``BaseException.__new__``), and
    ``ExceptionGroup`` insists on its arguments. Try the mixed class's own
    allocator first, then the base one, with and without the original args.
    """
    args = getattr(exc, "args", ())
    for new in (mixed.__new__, BaseException.__new__):
        for new_args in ((), args) if args else ((),):
            try:
                return new(mixed, *new_args)  # type: ignore[no-any-return]
            except TypeError:
                continue
    return ActorError.__new__(ActorError)


class PortableException:
    """Pickles an exception without calling its ``__init__`` on the other side.

    Exceptions whose constructor takes other arguments than ``self.args`` do not
    survive plain pickling; this rebuilds them with ``__new__`` plus their args
    and attributes, so ``except TheirClass`` still works at the caller.
    """

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self) -> tuple[Any, ...]:
        exc = self.exc
        return (_rebuild_exception, (type(exc), exc.args, dict(getattr(exc, "__dict__", {}))))


def _rebuild_exception(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc
