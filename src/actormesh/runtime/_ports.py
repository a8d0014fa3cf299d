"""Reply ports on the caller's side: what turns incoming replies into futures.

Handlers run on the loop thread (``deliver``) and when a peer is lost
(``peer_lost``). Each knows which peer addresses it still waits on, so a dead
peer fails exactly the replies it owed, at once.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import PortClosedError, make_actor_error, supervision_error
from ..transport import Segment, loads
from ._future import Future
from ._messages import ERROR, OK, SUPERVISION, Reply, ReplyMulti

if TYPE_CHECKING:
    from ._proc import ProcRuntime

__all__ = ["decode_reply", "GatherPort", "StreamPort", "OnePort", "QueuePort"]


def decode_reply(
    status: int, payload: Sequence[Segment], what: str, rank: int | None = None, describe: Callable[[int], str] | None = None
) -> Any:
    """Turn a reply payload into its value, or raise what it carries. ``rank`` and
    ``describe(rank)`` name the member in a SupervisionError."""
    if status == OK:
        return loads(payload)
    if status == ERROR:
        exc, formatted = loads(payload)
        raise make_actor_error(exc, f"Actor call {what} failed.", formatted)
    if type(payload) is _Gone:
        raise payload.error(what)
    cause = loads(payload)  # a Cause from a peer that knew why (or text from an older one)
    actor = describe(rank) if describe is not None and rank is not None else None
    raise supervision_error(f"Endpoint call {what}() failed, {cause}", cause, endpoint=what, actor=actor, rank=rank)


class _Gone:
    """The reply owed by a peer that is gone, told here (not sent over the wire)."""

    __slots__ = ("cause", "actor", "rank")

    def __init__(self, cause: str, describe: Callable[[int], str] | None, index: int, rank: int | None = None) -> None:
        self.cause = cause
        self.actor = describe(index) if describe is not None else None
        self.rank = index if rank is None else rank

    def error(self, what: str) -> Exception:
        text = self.cause if self.actor is None else f"The actor {self.actor} and all its descendants have failed:\n  {self.cause}"
        return supervision_error(f"Endpoint call {what}() failed, {text}", self.cause, endpoint=what, actor=self.actor, rank=self.rank)


class _PortBase:
    """Registration bookkeeping shared by the handlers below."""

    def __init__(self, runtime: ProcRuntime, what: str) -> None:
        self.runtime = runtime
        self.what = what
        self.port_id = runtime.register_port(self)

    def close(self) -> None:
        self.runtime.unregister_port(self.port_id)


class _Abortable:
    """``abort``: the runtime closes, so every reply still owed fails now."""

    _addresses: Sequence[str]

    def abort(self, reason: str) -> None:
        for addr in set(self._addresses):
            self.peer_lost(addr, reason)  # type: ignore[attr-defined]


class GatherPort(_Abortable, _PortBase):
    """Collects one reply per rank; completes a Future with ``build(values)``.

    ``call()`` semantics: waits for every rank, then raises the first error in
    rank order, else returns ``build(list_of_values)``. ``addresses[i]`` is the
    peer that owes reply ``i``.
    """

    def __init__(
        self,
        runtime: ProcRuntime,
        what: str,
        addresses: Sequence[str],
        build: Callable[[list[Any]], Any],
        describe: Callable[[int], str] | None = None,
        expected: int | None = None,
    ) -> None:
        super().__init__(runtime, what)
        self._describe = describe
        n = len(addresses) if expected is None else expected
        self.future: Future[Any] = Future._create()
        self._replies: list[Any] = [None] * n
        self._missing = n
        self._addresses: Sequence[str] = list(addresses) if expected is None else ()
        self._unique: Collection[str] = set(addresses)  # the peers awaited, once each
        self._build = build
        self._lock = threading.Lock()
        if expected is None:
            for addr in set(addresses):
                runtime.await_peer(addr, self)
        if n == 0:
            self._finish()

    def await_addresses(self, addresses: Sequence[str], unique: Sequence[str] | None = None) -> None:
        """Say which peer owes each reply (for casts whose tree is built after the port);
        ``unique``: those peers once each, if the caller knows them (a cast plan does)."""
        self._addresses = addresses  # read only (peer_lost, abort): no copy per cast
        self._unique = set(addresses) if unique is None else unique
        for addr in self._unique:
            self.runtime.await_peer(addr, self)

    def deliver(self, env: Reply, payload: Sequence[Segment]) -> None:
        self._store(env.slot, (env.status, payload))

    def deliver_many(self, env: ReplyMulti, payload: Sequence[Segment]) -> None:
        """The replies of a whole cast subtree in one message (REPLY_MULTI), stored
        under one lock: a call's gather costs the controller per message, little per member."""
        pos, stored, replies = 0, 0, self._replies
        with self._lock:
            for index, status, nseg in env.entries:
                if replies[index] is None:  # else a duplicate: the first one wins
                    replies[index] = (status, payload[pos : pos + nseg])
                    stored += 1
                pos += nseg
            self._missing -= stored
            done = stored > 0 and self._missing == 0
        if done:
            self._finish()

    def _store(self, index: int, item: Any) -> None:
        with self._lock:
            if self._replies[index] is not None:
                return  # duplicate (e.g. failure raced a late reply): first one wins
            self._replies[index] = item
            self._missing -= 1
            done = self._missing == 0
        if done:
            self._finish()

    def peer_lost(self, address: str, reason: str) -> None:
        for i, addr in enumerate(self._addresses):
            if addr == address:
                self._store(i, (SUPERVISION, _Gone(reason, self._describe, i)))

    def _finish(self) -> None:
        self.close()
        for addr in self._unique:
            self.runtime.unawait_peer(addr, self)
        replies, what, build, describe = self._replies, self.what, self._build, self._describe

        def thunk() -> Any:
            return build([loads(payload) if status == OK else decode_reply(status, payload, what, rank, describe)
                          for rank, (status, payload) in enumerate(replies)])

        self.future._set_thunk(thunk)


class StreamPort(_Abortable, _PortBase):
    """N futures completed in arrival order (``stream()``), or one (``call_one``/``choose``)."""

    def __init__(self, runtime: ProcRuntime, what: str, addresses: Sequence[str], describe: Callable[[int], str] | None = None) -> None:
        super().__init__(runtime, what)
        self._describe = describe
        self.futures: list[Future[Any]] = [Future._create() for _ in addresses]
        self._next = 0
        self._addresses = list(addresses)
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        for addr in set(addresses):
            runtime.await_peer(addr, self)

    def deliver(self, env: Reply, payload: Sequence[Segment]) -> None:
        self._complete(env.slot, env.status, payload)

    def _complete(self, index: int, status: int, payload: Any) -> None:
        with self._lock:
            if index in self._seen or self._next >= len(self.futures):
                return
            self._seen.add(index)
            fut = self.futures[self._next]
            self._next += 1
            done = self._next == len(self.futures)
        what = self.what
        if type(payload) is _Gone:
            fut._set_exception(payload.error(what))
        else:
            fut._set_thunk(lambda: decode_reply(status, payload, what, index, self._describe))
        if done:
            self.close()
            for addr in set(self._addresses):
                self.runtime.unawait_peer(addr, self)

    def peer_lost(self, address: str, reason: str) -> None:
        for i, addr in enumerate(self._addresses):
            if addr == address:
                self._complete(i, SUPERVISION, _Gone(reason, self._describe, i))


class OnePort:
    """One reply from one peer (``call_one``/``choose``): the lean path."""

    __slots__ = ("runtime", "what", "port_id", "future", "_address", "_describe", "_rank")

    def __init__(self, runtime: ProcRuntime, what: str, address: str, describe: Callable[[int], str] | None = None, rank: int = 0) -> None:
        self.runtime = runtime
        self.what = what
        self.future: Future[Any] = Future._create()
        self._address = address
        self._describe = describe
        self._rank = rank
        self.port_id = runtime.register_port(self)
        runtime.await_peer(address, self)

    def deliver(self, env: Reply, payload: Sequence[Segment]) -> None:
        rt = self.runtime
        rt.ports.pop(self.port_id, None)
        waiting = rt._waiting_on.get(self._address)  # rt.unawait_peer, inline: every reply's path
        if waiting is not None:
            waiting.discard(self)
        status, what = env.status, self.what
        if status == OK:
            self.future._set_thunk(lambda: loads(payload))
        else:
            rank, describe = self._rank, self._describe
            self.future._set_thunk(lambda: decode_reply(status, payload, what, rank, describe and (lambda _: describe(0))))

    def abort(self, reason: str) -> None:
        self.peer_lost(self._address, reason)

    def peer_lost(self, address: str, reason: str) -> None:
        self.runtime.ports.pop(self.port_id, None)
        self.future._set_exception(_Gone(reason, self._describe, 0, self._rank).error(self.what))


class QueuePort(_PortBase):
    """An open port: every message is queued for ``recv()`` (Channel.open).

    A ``recv()`` future claims its message when it is first observed (``get``,
    ``await``, ``done``, a callback), not when it is made, so a discarded
    ``recv()`` takes nothing (Monarch's rule). Closing fails every waiter and
    every later ``recv()``, like trio's channels; a ``once`` port, after its one
    message, fails further receives the same way.
    """

    def __init__(self, runtime: ProcRuntime, what: str = "port", once: bool = False) -> None:
        super().__init__(runtime, what)
        self._items: deque[tuple[int, Any, Any]] = deque()
        self._waiters: deque[Future[Any]] = deque()
        self._lock = threading.Lock()
        self._once = once
        self._closed: str | None = None  # why receives fail once the queue is empty

    def deliver(self, env: Reply, payload: Sequence[Segment]) -> None:
        item = (env.status, payload, env.slot)
        with self._lock:
            if self._closed is not None and not self._once:
                return  # closed by the receiver: later sends are dropped
            fut = self._waiters.popleft() if self._waiters else None
            if fut is None:
                self._items.append(item)
            if self._once:
                self._closed = "the once=True port already delivered its one message to an earlier recv()"
                rest, self._waiters = list(self._waiters), deque()
            else:
                rest = []
        if fut is not None:
            self._settle(fut, item)
        if self._once:
            super().close()
            self._fail(rest)

    def _settle(self, fut: Future[Any], item: tuple[int, Any, Any]) -> None:
        status, payload, rank = item
        if status == ERROR:
            # Port.exception(e): the receiver sees ``e`` itself, not an ActorError.
            fut._set_thunk(lambda: _raise(loads(payload)[0]))
        else:
            fut._set_thunk(lambda: (rank, loads(payload)) if self.ranked else loads(payload))

    ranked = False

    def recv(self) -> Future[Any]:
        """A future of the next message, claimed when first observed."""
        return _Receive._lazy(self)

    def _claim(self, fut: Future[Any]) -> None:
        """``fut`` was observed: give it the oldest message, or queue it."""
        with self._lock:
            item = self._items.popleft() if self._items else None
            closed = self._closed
            if item is None and closed is None:
                self._waiters.append(fut)
        if item is not None:
            self._settle(fut, item)
        elif closed is not None:
            fut._set_exception(PortClosedError(f"recv() on a closed port: {closed}"))

    def close(self, reason: str = "PortReceiver.close() was called") -> None:
        """Stop receiving: fail every pending and later ``recv()``; drop later sends."""
        with self._lock:
            if self._closed is None or self._once:
                self._closed = reason
            self._items.clear()
            waiters, self._waiters = list(self._waiters), deque()
        super().close()
        self._fail(waiters)

    def abort(self, reason: str) -> None:
        """The runtime is closing: nothing will arrive any more."""
        self.close(reason)

    def _fail(self, waiters: list[Future[Any]]) -> None:
        for fut in waiters:
            fut._set_exception(PortClosedError(f"recv() on a closed port: {self._closed}"))

    def peer_lost(self, address: str, reason: str) -> None:
        pass


class _Receive(Future[Any]):
    """A ``recv()`` future: asks its port for a message on first observation."""

    __slots__ = ("_port",)
    _port: QueuePort | None  # None once it has asked

    @classmethod
    def _lazy(cls, port: QueuePort) -> _Receive:
        fut = cls._create()
        fut._port = port
        return fut

    def _observe(self) -> None:
        port = self._port
        if port is not None:
            with port._lock:
                mine, self._port = self._port is not None, None
            if mine:
                port._claim(self)

    def done(self) -> bool:
        self._observe()
        return super().done()

    def get(self, timeout: float | None = None) -> Any:
        self._observe()
        return super().get(timeout)

    def _add_done_callback(self, cb: Callable[[Future[Any]], None]) -> None:
        self._observe()
        super()._add_done_callback(cb)


def _raise(exc: BaseException) -> Any:
    raise exc


def pick_random(n: int) -> int:
    """Uniform choice of a rank for ``choose()``."""
    return random.randrange(n)
