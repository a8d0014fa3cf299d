"""The messages processes send each other: one named type per kind, and their wire form.

Every message is a ``NamedTuple`` whose field 0 is its ``kind``. On the wire it
is the plain tuple of its fields (pickled with builtins only, so no class
reference travels and the envelope stays as small as a bare tuple); ``decode``
gives it its type back from the kind. User payloads travel as separate segments
after the envelope (see transport._frames).

Only the runtime builds envelopes: the mesh layer calls the verbs of
``ProcRuntime`` (``call_actor``, ``cast``, ``spawn_actor``, ``stop_actor`` ...).

``reply`` is a port reference ``(address, port_id)`` or None. ``owner`` is an
actor reference ``(address, actor_name)``. ``(sender, seq)`` of ``Call`` and
``StopActor`` number messages per destination actor (see _ordering.py).
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple, Optional, Union

CALL = 0
REPLY = 1
SPAWN = 2
STOP_ACTOR = 3
STOP_PROC = 4
HELLO = 5
FAILURE = 6
SINGLETON = 7
PING = 8
PONG = 9
JOIN = 10
CAST = 11
REPLY_MULTI = 12
RELAY_LOST = 13
STATS = 14
BATCH = 15

#: HELLO's ``extra`` from a dialer that revived the peer (see _peers.revive).
RESTART = "restart"

OK = 0
ERROR = 1
SUPERVISION = 2

#: Payloads with out-of-band data above this wait until the kernel has the bytes
#: before the sender goes on, so the sender may change its tensor afterwards.
BIG_PAYLOAD_BYTES = 1 << 20

PortRef = tuple[str, int]
ActorRef = tuple[str, str]


class Call(NamedTuple):
    """Run ``endpoint`` of the local actor ``actor`` as member ``member`` (its index in
    the mesh ``labels``/``sizes``, and its slot in ``reply``)."""

    kind: int
    actor: str
    endpoint: str
    reply: Optional[PortRef]
    member: int
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    sender: Optional[str] = None
    seq: Optional[int] = None
    prev: Optional[int] = None  # the number of ``sender``'s previous message to ``actor``


class Reply(NamedTuple):
    """The answer for slot ``slot`` of port ``port`` (status: OK | ERROR | SUPERVISION)."""

    kind: int
    port: int
    slot: int
    status: int
    sender: str


class ReplyMulti(NamedTuple):
    """The replies of a cast subtree: ``entries`` are ``(index, status, nseg)``, their
    payload segments concatenated in entry order."""

    kind: int
    port: int
    entries: tuple[tuple[int, int, int], ...]
    sender: str


class Spawn(NamedTuple):
    """Create member ``rank`` of the actor mesh ``actor`` here (the payload holds class and arguments)."""

    kind: int
    actor: str
    rank: int
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    owner: Optional[ActorRef]
    reply: Optional[PortRef]
    display: str
    is_async: bool


class StopActor(NamedTuple):
    """Stop the local actor ``actor`` after what it has queued; answer slot ``slot`` of ``reply``."""

    kind: int
    actor: str
    reply: Optional[PortRef]
    slot: int
    sender: Optional[str] = None
    seq: Optional[int] = None
    prev: Optional[int] = None  # the number of ``sender``'s previous message to ``actor``


class Cast(NamedTuple):
    """A call to many members along a tree. This node's subtree is the members
    ``lo, lo + 1, ...`` (message indices), at ``addrs`` in that order; the first
    is this node's own. ``table``: ``(id, len(addrs))`` when the sender's subtree
    roots keep ``addrs`` under ``id``, sent once; later casts name it and leave
    ``addrs`` None (see _cast.CastTables). All take the number ``seq`` and follow
    ``prev``, except those in ``exceptions`` (index -> their own ``prev``; see
    _numbering.SeqOut)."""

    kind: int
    actor: str
    endpoint: str
    reply: Optional[PortRef]
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    sender: str
    lo: int
    addrs: Optional[tuple[str, ...]]
    table: Optional[tuple[int, int]]
    seq: int
    prev: int
    exceptions: Optional[dict[int, int]]


class StopProc(NamedTuple):
    kind: int
    reply: Optional[PortRef]


class Hello(NamedTuple):
    """A connection's first frame: who dialed. ``error``: why it cannot serve (its
    bootstrap failed). ``extra``: a relay request for a gateway (see _gateway.py), or
    RESTART (the dialer had given this peer up and numbers its messages afresh)."""

    kind: int
    address: str
    pid: int
    error: Optional[str]
    extra: Any = None


class Failure(NamedTuple):
    """Member ``rank`` of ``mesh_name``, owned by the actor ``owner_actor`` here, failed."""

    kind: int
    owner_actor: str
    mesh_name: str
    rank: int
    cause: Any
    display: str
    source: str


class Singleton(NamedTuple):
    """get_or_spawn_controller lookup at the root (the payload holds class and arguments)."""

    kind: int
    name: str
    reply: PortRef


class Ping(NamedTuple):
    """Liveness probe from a spawner; answered by ``Pong``."""

    kind: int


class Pong(NamedTuple):
    kind: int


class Join(NamedTuple):
    """A host agent announces itself to a controller."""

    kind: int
    address: str
    hostname: str
    pid: int


class RelayLost(NamedTuple):
    """Gateway -> attached client: its leg to ``address`` is gone."""

    kind: int
    address: str
    reason: Any


class Stats(NamedTuple):
    """Ask a process for its telemetry snapshot (see _stats.py)."""

    kind: int
    reply: PortRef


#: The kinds a busy route sends together in a :class:`Batch`: the hot path's two.
BATCHED = frozenset({CALL, REPLY})


class Batch(NamedTuple):
    """Small calls and replies on one route, sent together while its connection is busy
    (see _routes.Route): ``items`` are ``(wire tuple, payload bytes or None)`` in send order."""

    kind: int
    items: list[tuple[tuple[Any, ...], bytes | None]]


Message = Union[Call, Reply, ReplyMulti, Spawn, StopActor, Cast, StopProc, Hello, Failure, Singleton, Ping, Pong, Join, RelayLost, Stats, Batch]

_BY_KIND: dict[int, Any] = {
    CALL: Call,
    REPLY: Reply,
    SPAWN: Spawn,
    STOP_ACTOR: StopActor,
    STOP_PROC: StopProc,
    HELLO: Hello,
    FAILURE: Failure,
    SINGLETON: Singleton,
    PING: Ping,
    PONG: Pong,
    JOIN: Join,
    CAST: Cast,
    REPLY_MULTI: ReplyMulti,
    RELAY_LOST: RelayLost,
    STATS: Stats,
    BATCH: Batch,
}
# kind -> (type, number of fields): decode checks the length once, so a field read
# never meets a short tuple.
_LAYOUT = {kind: (cls, len(cls._fields)) for kind, cls in _BY_KIND.items()}
_new = tuple.__new__
_loads = pickle.loads
_dumps = pickle.dumps


def encode(msg: tuple[Any, ...]) -> bytes:
    """The wire form of a message: its fields as a plain tuple, pickled."""
    return _dumps(tuple(msg), 5)


def typed(msg: tuple[Any, ...]) -> Any:
    """A message given its type back from its kind: the verbs' two hottest paths (a call,
    a reply) build the plain wire tuple and skip the NamedTuple; this is for the places
    that read one before the wire does (a local route, an undeliverable message)."""
    if type(msg) is not tuple:
        return msg
    return _new(_LAYOUT[msg[0]][0], msg)


def decode(data: Any) -> Any:
    """A message from its wire form; ValueError if it is not one (a protocol error).

    On the hot path (every frame) this costs one lookup, one length check and one
    tuple copy (``tuple.__new__`` gives it its type) over the unpickling."""
    return from_wire(_loads(data))


def from_wire(t: Any) -> Any:
    """A message from its unpickled wire tuple (ValueError if it is not one): for a
    :class:`Batch`'s items, which come unpickled with the batch."""
    try:  # free in the common case (3.11's zero-cost try), unlike checks before the lookup
        cls, n = _LAYOUT[t[0]]
    except (KeyError, TypeError, IndexError):  # no kind, an unknown one, or not a sequence
        raise ValueError(f"not a message: {type(t).__name__}") from None
    if len(t) == n and type(t) is tuple:
        return _new(cls, t)
    if cls is Hello and len(t) == n - 1:
        return Hello(*t)  # peers send ``extra`` only when they have one
    raise ValueError(f"a malformed {cls.__name__} message: {type(t).__name__} of {len(t)} fields, not a tuple of {n}")


#: The liveness probe and its answer, encoded once.
PING_BYTES = encode(Ping(PING))
PONG_BYTES = encode(Pong(PONG))
