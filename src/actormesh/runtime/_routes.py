"""Routes: the one path a process uses to send to one peer address.

Per-sender FIFO depends on this: every message from this process to a peer goes
through one Route, and a Route uses one connection for its whole life. Until the
connection is up, messages wait in the route's queue; the queue is flushed into
the connection before the connection is published for direct use, under the
route's lock, so nothing overtakes what was queued earlier.
"""

from __future__ import annotations

import pickle
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import Cause, CauseKind, TransportError
from ..telemetry import FIGURES
from ..telemetry import STATE as _TELEMETRY
from ..transport import Connection, Segment
from . import _messages as M
from ._messages import BIG_PAYLOAD_BYTES, typed

if TYPE_CHECKING:
    from ._proc import ProcRuntime

__all__ = ["Route", "LocalRoute"]

Envelope = Any  # a Message of any kind: code here branches on its .kind, which a type checker cannot narrow


_TO_ACTOR = frozenset({M.CALL, M.STOP_ACTOR, M.CAST})
_TO_PORT = frozenset({M.REPLY, M.REPLY_MULTI})


def order_key(env: Any) -> Any:
    """What a message must stay in order with on its connection (see transport._outgoing):
    messages to one actor (its name, a str), or replies to one port (its id, an int: never
    equal to a name, and no tuple to build per message). Any other kind keeps its place among all."""
    kind = env.kind
    if kind in _TO_ACTOR:
        return env.actor
    if kind in _TO_PORT:
        return env.port
    return None


_dumps = pickle.dumps
_BATCHED = M.BATCHED  # the kinds a busy route sends together (see Route._coalesce)
#: A message joins a batch only with at most one payload segment of this many bytes.
_ITEM_BYTES = 16 << 10
#: A batch holds at most this many messages (its frame stays small).
_BATCH_ITEMS = 256


def _payload_bytes(payload: Sequence[Segment]) -> int:
    if len(payload) < 2:
        return 0
    return sum(memoryview(s).nbytes for s in payload[1:])


class Route:
    """Messages to one remote address, over one connection."""

    __slots__ = ("address", "conn", "_pending", "_lock", "dead", "_runtime", "connecting", "restart", "child", "sent",
                 "reporter", "held", "_batch", "_batch_key", "batched")

    def __init__(self, runtime: ProcRuntime, address: str, *, child: bool = False) -> None:
        self.address = address
        self.conn: Connection | None = None
        self._pending: list[tuple[Envelope, Sequence[Segment]]] = []
        self._lock = threading.Lock()
        #: Why this peer is gone for good (a Cause), or None while it may be reached.
        self.dead: Cause | None = None
        self._runtime = runtime
        self.connecting = False
        #: Made by reviving a peer given up as unreachable: our HELLO says RESTART.
        self.restart = False
        #: A child proc dials us; we never dial it.
        self.child = child
        #: The host agent that spawned this proc and reports how it ended (None: none does).
        self.reporter: str | None = None
        #: Its connection closed and the reporter is alive: messages wait for its report
        #: (as a child's wait for its exit status), and nobody dials it again.
        self.held = False
        #: Messages handed to this route (for benchmarks and diagnostics).
        self.sent = 0
        #: Small calls and replies waiting to go as one Batch (see _coalesce), or None.
        self._batch: list[tuple[tuple[Any, ...], bytes | None]] | None = None
        self._batch_key: Any = None
        #: Of the messages sent, how many went in batches of several.
        self.batched = 0

    def send(self, env: Envelope, payload: Sequence[Segment] = (), key: Any = None) -> None:
        """Send from any thread; fails the message's reply port if the peer is gone.

        ``key`` is the message's :func:`order_key` (the verb that built it knows it)."""
        self.sent += 1  # not atomic across threads: a statistic, not an invariant
        if _TELEMETRY.on:
            FIGURES.bytes_out += sum(len(s) if type(s) is bytes else memoryview(s).nbytes for s in payload)
        conn = self.conn
        if conn is None:
            with self._lock:
                conn = self.conn
                if conn is None:
                    if self.dead is not None:
                        reason = self.dead
                    else:
                        if len(payload) > 1:
                            # Queued until connected: the caller may reuse its memory
                            # before then, so the out-of-band buffers are copied.
                            payload = [payload[0], *(bytearray(s) for s in payload[1:])]
                        self._pending.append((env, payload))
                        if not self.connecting and not self.child and not self.held:
                            self.connecting = True
                            self._runtime.start_dial(self)
                        return
            if conn is None:
                self._runtime.undeliverable(env, self.address, reason)
                return
        if self._batch is not None or conn.flush_scheduled:
            if self._coalesce(conn, env, payload, key):
                return
        big = len(payload) > 1 and _payload_bytes(payload) >= BIG_PAYLOAD_BYTES
        try:
            # tuple(): the wire form is the plain tuple (a plain one passes as itself).
            event = conn.send([_dumps(tuple(env), 5), *payload], wait_flushed=big, order_key=key)
        except TransportError as exc:
            lost = self._closed_under_us(conn, env, payload, exc)
            if lost is not None:
                self._runtime.undeliverable(env, self.address, lost)
            return
        if event is not None and not self._runtime.in_loop():
            # The payload's memory is referenced until the kernel has it.
            event.wait(self._runtime.config.message_delivery_timeout)

    def _coalesce(self, conn: Connection, env: Envelope, payload: Sequence[Segment], key: Any) -> bool:
        """Join a small call or reply to the batch this busy connection will send next
        (True), or send that batch first and let the caller send ``env`` alone (False).

        A batch is opened only while the connection already has a flush scheduled: the
        loop is awake and the message would have waited for it anyway, so one pickle and
        one frame carry the burst instead of one each. An idle connection keeps the
        direct write (latency). Every message of the route joins an open batch or
        flushes it first, under the route's lock, so send order holds."""
        item: tuple[tuple[Any, ...], bytes | None] | None = None
        if env[0] in _BATCHED:
            if not payload:
                item = (tuple(env), None)
            elif len(payload) == 1:
                p = payload[0]
                if type(p) is bytes and len(p) <= _ITEM_BYTES:
                    item = (tuple(env), p)
        lock = self._lock
        lock.acquire()  # acquire/release, not ``with``: every message of a burst comes here
        batch = self._batch
        if item is not None and batch is not None and len(batch) < _BATCH_ITEMS:  # the common case
            batch.append(item)
            if key != self._batch_key:
                self._batch_key = None
            lock.release()
            return True
        lost: list[tuple[Envelope, Cause]] = []
        try:
            if batch is None:
                if item is None or self.conn is not conn:
                    return False
                if not self._runtime.call_soon_anywhere(self._flush_batch):
                    return False  # the loop is closed: the send reports it
                self._batch = [item]
                self._batch_key = key
                return True
            lost = self._send_batch_locked()
            if item is None:
                return False
            self._batch = [item]  # the full batch went: this one opens the next (the flush scheduled sends it)
            self._batch_key = key
            return True
        finally:
            lock.release()
            if lost:
                self._fail_lost(lost)

    def _unbatch_locked(self) -> None:
        """The connection is going: the batch's messages wait at the head of the queue,
        ahead of what comes later, to be sent on the next connection or failed."""
        batch, self._batch = self._batch, None
        if batch:
            self._pending[:0] = [(typed(t), () if p is None else (p,)) for t, p in batch]

    def hold(self) -> None:
        """The connection closed and this peer's spawner will report how it ended:
        messages wait for that report (see _peers.connection_closed). Loop thread."""
        with self._lock:
            self._unbatch_locked()
            self.conn = None
            self.held = not self.child

    def _flush_batch(self) -> None:
        with self._lock:
            lost = self._send_batch_locked()
        self._fail_lost(lost)

    def _fail_lost(self, lost: list[tuple[Envelope, Cause]]) -> None:
        """Fail the replies of batched messages the connection did not take (outside the lock)."""
        for env, cause in lost:
            self._runtime.undeliverable(env, self.address, cause)

    def _send_batch_locked(self) -> list[tuple[Envelope, Cause]]:
        """Hand the batch to the connection; the messages it could not take, and why."""
        batch, self._batch = self._batch, None
        conn = self.conn
        if not batch:
            return []
        if conn is None:  # cannot happen (every way to None unbatches), kept as a guard
            self._batch = batch
            self._unbatch_locked()
            return []
        if len(batch) == 1:
            t, p = batch[0]
            segments: list[Segment] = [_dumps(t, 5)] if p is None else [_dumps(t, 5), p]
        else:
            segments = [_dumps((M.BATCH, batch), 5)]
            self.batched += len(batch)
        try:
            conn.send(segments, order_key=self._batch_key)
        except TransportError as exc:
            lost = []
            for t, p in batch:
                env = typed(t)
                cause = self._closed_locked(conn, env, () if p is None else (p,), exc)
                if cause is not None:
                    lost.append((env, cause))
            return lost
        return []

    def _closed_under_us(self, conn: Connection, env: Envelope, payload: Sequence[Segment],
                         exc: TransportError) -> Cause | None:
        """The connection closed before the loop heard of it. A child's message, or one to
        a proc whose host agent reports its end, is held as if the loop had (see
        ``_peers.connection_closed``), so it fails with the exit status its spawner
        reports, not a bare "connection lost" (None: held). Else
        the cause to fail it with: the peer's known end, or the lost connection."""
        with self._lock:
            return self._closed_locked(conn, env, payload, exc)

    def _closed_locked(self, conn: Any, env: Envelope, payload: Sequence[Segment], exc: TransportError) -> Cause | None:
        if self.dead is not None:
            return self.dead
        if (self.child or self.reported()) and (self.conn is None or self.conn is conn):
            self.held = not self.child
            if len(payload) > 1:
                payload = [payload[0], *(bytearray(s) for s in payload[1:])]
            self._pending.append((env, payload))
            return None
        return Cause(f"connection lost: {exc}", CauseKind.UNREACHABLE, error=exc)

    def reported(self) -> bool:
        """Whether a live host agent will report how this proc ended."""
        return self.reporter is not None and self._runtime.peer_dead(self.reporter) is None

    def publish(self, conn: Connection) -> None:
        """Make ``conn`` this route's connection (loop thread). First one wins."""
        with self._lock:
            if self.conn is not None or self.dead is not None:
                return
            pending, self._pending = self._pending, []
            for env, payload in pending:
                conn.send([_dumps(tuple(env), 5), *payload], order_key=order_key(typed(env)))
            self.conn = conn
            self.connecting = False
            self.held = False

    @property
    def sending(self) -> bool:
        """Whether messages to this peer are still on their way out of this process
        (waiting for the dial, or not yet in the kernel). Loop thread."""
        if self.dead is not None:
            return False
        if self._pending or self._batch:
            return True
        conn = self.conn
        return conn is not None and not getattr(conn, "drained", True)

    def replace(self, conn: Connection) -> Connection | None:
        """Make ``conn`` this route's connection instead of the one it has
        (loop thread); return the old one. For a peer that dialed us again
        because it gave up on the old connection (a healed partition)."""
        with self._lock:
            self._unbatch_locked()
            old, self.conn = self.conn, None
        self.publish(conn)
        return old

    def fail(self, reason: Cause) -> list[tuple[Envelope, Sequence[Segment]]]:
        """Mark the peer gone; return what was still queued (to fail its replies)."""
        with self._lock:
            if self.dead is None:
                self.dead = reason
            self._unbatch_locked()
            self.conn = None
            pending, self._pending = self._pending, []
            self.connecting = False
        return pending


class LocalRoute:
    """Messages to this very process: dispatched on the loop thread, in send order.

    A burst from one thread costs one loop wake-up (same trick as Connection.send).
    """

    __slots__ = ("address", "_queue", "_scheduled", "_runtime", "dead", "_dispatch")

    def __init__(self, runtime: ProcRuntime, address: str, dispatch: Callable[[Envelope, Sequence[Segment], Any], None]) -> None:
        self.address = address
        self._queue: deque[tuple[Envelope, Sequence[Segment]]] = deque()
        self._scheduled = False
        self._runtime = runtime
        self.dead: Cause | None = None
        self._dispatch = dispatch

    def send(self, env: Envelope, payload: Sequence[Segment] = (), key: Any = None) -> None:
        """Queue for dispatch on the loop thread (``key``: unused, one connection-less queue).

        Out-of-band buffers still alias the sender's memory here (no socket in
        between), so they are copied once: a message is a copy, as across procs.
        """
        if len(payload) > 1:
            payload = [payload[0], *(bytearray(s) for s in payload[1:])]
        self._queue.append((typed(env), payload))
        if not self._scheduled:
            self._scheduled = True
            if self._runtime.in_loop():
                self._runtime.loop.call_soon(self._drain)
            else:
                try:
                    self._runtime.loop.call_soon_threadsafe(self._drain)
                except RuntimeError:
                    self._scheduled = False

    def _drain(self) -> None:
        self._scheduled = False
        q = self._queue
        dispatch = self._dispatch
        while q:
            env, payload = q.popleft()
            dispatch(env, payload, None)
