"""What a process does with the message kinds that are neither calls nor replies.

The runtime dispatches calls, casts and replies itself (``_receive.py``). Every
other kind goes to the part of the process that owns it, through one small,
typed interface, :class:`Handlers`: one field per kind, each set once by its
owner (the runtime's cells, supervision, spawning and stats in ``_context``;
a worker's stop; the mesh layer's singletons; a host agent's gateway), and two
lists that several parts may join (peers lost, agents joining). A runtime
takes a ``Handlers`` at construction or makes an empty one; nothing else is
attached to it from outside.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..transport import Connection, Segment
from . import _messages as M

__all__ = ["Handlers"]


@dataclass(slots=True)
class Handlers:
    """The handlers of one process, by message kind (all run on its loop thread).

    ``None`` means nobody here handles the kind: a SPAWN, STOP_PROC, FAILURE or
    STATS is dropped, a SINGLETON answered with an error.
    """

    #: SPAWN: create the actor the message describes (the runtime's cells).
    spawn: Callable[[M.Spawn, Sequence[Segment]], None] | None = None
    #: FAILURE: a member of a mesh this process owns failed (supervision).
    failure: Callable[[M.Failure], None] | None = None
    #: STOP_PROC: stop every actor, then the process (a worker).
    stop_proc: Callable[[M.StopProc], None] | None = None
    #: SINGLETON: a process of this job asks for a named process-wide actor (the mesh layer).
    singleton: Callable[[M.Singleton, Sequence[Segment]], None] | None = None
    #: STATS: answer with this process's figures (stats).
    stats: Callable[[M.Stats], None] | None = None
    #: The first HELLO on a connection; True: it took the connection (a spawned child dialling in).
    hello: Callable[[Connection, M.Hello], bool] | None = None
    #: A HELLO that asks to be relayed elsewhere (a host agent's gateway; None: refused).
    relay: Callable[[Connection, M.Hello], None] | None = None
    #: ``(address, why)`` of each peer lost for good, unless its loss was expected.
    peer_lost: list[Callable[[str, str], None]] = field(default_factory=list)
    #: ``(address, hostname, pid)`` of each JOIN (a host agent dialling in).
    join: list[Callable[[str, str, int], None]] = field(default_factory=list)
