"""The one exception tree of actormesh, split by blame and by certainty.

::

    Exception
    ├── ActorError                 user code raised in a remote endpoint; the actor lives.
    │                              ``except ValueError`` still catches a remote ValueError:
    │                              the instance is also an instance of the user's class.
    ├── RuntimeError
    │   ├── SupervisionError       the actor a call waits on is gone or out of reach; the
    │   │   │                      call may or may not have run. Names endpoint, actor,
    │   │   │                      rank and cause (a Cause: its kind tells them apart).
    │   │   ├── ActorDiedError     it died: its process exited, was killed by a signal or
    │   │   │                      found hung (and killed), or the actor itself failed
    │   │   │                      (raised in __init__ or a broadcast). It will not answer.
    │   │   ├── ActorUnreachableError  it could not be reached: the connection broke and
    │   │   │                      nothing better is known. It may still be alive, and
    │   │   │                      the call may or may not have run.
    │   │   └── MeshStoppedError   the mesh (or its proc mesh) was stopped on purpose.
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

Failure causes travel as data: a :class:`Cause` is a ``str`` (the readable
account, as before) that also carries a :class:`CauseKind` and the exit code or
signal number, so callers can branch on ``err.cause.kind`` instead of parsing
text. :func:`supervision_error` picks the SupervisionError subclass from it.
"""

from __future__ import annotations

import enum
import types
from typing import Any

__all__ = [
    "ActorError",
    "RemoteException",
    "Cause",
    "CauseKind",
    "SupervisionError",
    "ActorDiedError",
    "ActorUnreachableError",
    "MeshStoppedError",
    "supervision_error",
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


class CauseKind(enum.Enum):
    """What kind of failure a :class:`Cause` is."""

    #: The process exited by itself; ``Cause.code`` is its exit code.
    EXITED = "exited"
    #: The process was killed by a signal; ``Cause.signal`` is its number.
    SIGNALED = "signaled"
    #: Its spawner found the process hung, frozen (SIGSTOP: ``Cause.signal`` is
    #: SIGSTOP's number) or unresponsive, and killed it.
    HUNG = "hung"
    #: The process could not be reached (connection lost, refused, timed out).
    UNREACHABLE = "unreachable"
    #: Stopped on purpose (``stop()``, a job shut down): not a failure.
    STOPPED = "stopped"
    #: The actor's own code raised (in ``__init__``, a broadcast endpoint, ``abort()``).
    RAISED = "raised"


#: Kinds by their wire number (append only: the position is what travels).
_KINDS = list(CauseKind)


class Cause(str):
    """Why an actor or a process is gone: readable text that is also data.

    It is a ``str`` (``"failed: Killed(sig=9)"``, a traceback...), so code that
    prints or matches the text keeps working, and it carries ``kind`` (a
    :class:`CauseKind`) plus ``code`` (EXITED) or ``signal`` (SIGNALED, a frozen
    HUNG). Small on the wire: it pickles as its text, the kind's name and one int.

    Example::

        >>> c = Cause("the process exited with non-zero code 3", CauseKind.EXITED, code=3)
        >>> c.kind, c.code, "code 3" in c
        (<CauseKind.EXITED: 'exited'>, 3, True)
    """

    kind: CauseKind
    code: int | None
    signal: int | None
    #: The lower-layer exception behind it, in the process that saw it (not sent
    #: on): a SupervisionError made from this cause there has it as ``__cause__``.
    error: BaseException | None

    def __new__(
        cls, text: str, kind: CauseKind, *, code: int | None = None, signal: int | None = None, error: BaseException | None = None
    ) -> Cause:
        self = super().__new__(cls, text)
        self.kind = kind
        self.code = code
        self.signal = signal
        self.error = error
        return self

    @classmethod
    def of(cls, reason: str, kind: CauseKind = CauseKind.UNREACHABLE) -> Cause:
        """``reason`` itself if it is a Cause, else a Cause of ``kind`` with its text."""
        return reason if isinstance(reason, Cause) else cls(str(reason), kind)

    def reworded(self, text: str) -> Cause:
        """The same cause (kind, code, signal) told with ``text``."""
        return Cause(text, self.kind, code=self.code, signal=self.signal, error=self.error)

    @property
    def died(self) -> bool:
        """Whether the actor is gone for good (not merely unreachable or stopped)."""
        return self.kind not in (CauseKind.UNREACHABLE, CauseKind.STOPPED)

    def __reduce__(self) -> tuple[Any, ...]:
        number = self.code if self.code is not None else self.signal
        return (_cause, (str(self), _KINDS.index(self.kind), number))

    def __repr__(self) -> str:
        extra = f", code={self.code}" if self.code is not None else f", signal={self.signal}" if self.signal is not None else ""
        return f"Cause({str(self)!r}, {self.kind}{extra})"


def _cause(text: str, kind: int, number: int | None) -> Cause:
    k = _KINDS[kind]
    if k is CauseKind.EXITED:
        return Cause(text, k, code=number)
    return Cause(text, k, signal=number)


class SupervisionError(RuntimeError):
    """The actor a caller waits on failed, stopped or is out of reach; the call may
    or may not have run.

    ``endpoint`` names the endpoint that was being called, ``actor`` the member
    (its qualified name), ``rank`` its rank in the mesh, ``cause`` the
    :class:`Cause`; each is None when not known. The subclasses tell died,
    unreachable and stopped apart; ``except SupervisionError`` catches all three.
    """

    def __init__(
        self,
        message: str,
        *,
        endpoint: str | None = None,
        actor: str | None = None,
        rank: int | None = None,
        cause: Cause | None = None,
    ) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.actor = actor
        self.rank = rank
        self.cause = cause


class ActorDiedError(SupervisionError):
    """The actor died: its process exited, was killed or was found hung (and killed),
    or its own code failed it. It will not answer; a call in flight when it died
    may have run partly. ``cause.kind`` says which."""


class ActorUnreachableError(SupervisionError):
    """The actor could not be reached (the connection broke, nothing better is
    known): it may still be alive, and the call may or may not have run."""


class MeshStoppedError(SupervisionError):
    """The mesh (or the proc mesh under it) was stopped on purpose; calls on it fail at once."""


def supervision_error(
    message: str,
    cause: str | None,
    *,
    endpoint: str | None = None,
    actor: str | None = None,
    rank: int | None = None,
) -> SupervisionError:
    """The SupervisionError subclass that fits ``cause`` (a plain SupervisionError
    when ``cause`` is not a :class:`Cause`)."""
    if isinstance(cause, Cause):
        cls: type[SupervisionError] = (
            MeshStoppedError if cause.kind is CauseKind.STOPPED
            else ActorUnreachableError if cause.kind is CauseKind.UNREACHABLE
            else ActorDiedError
        )
        err = cls(message, endpoint=endpoint, actor=actor, rank=rank, cause=cause)
        err.__cause__ = cause.error  # raise ... from the transport error, where it is known
        return err
    return SupervisionError(message, endpoint=endpoint, actor=actor, rank=rank)


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
