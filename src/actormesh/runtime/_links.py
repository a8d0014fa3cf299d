"""Liveness of remote links: a peer across the network that falls silent is unreachable.

A spawner judges its own children through the OS (``_heartbeat.py``). Peers on
other hosts cannot be seen that way: a network partition makes them vanish
without any connection closing, and TCP alone would hold such a link for many
minutes. So every process watches its TCP links to peers that are not its
children (controller to host agents and remote procs, procs to their
controller, procs to procs across hosts):

- traffic is proof of life (``Connection.last_rx``);
- a link silent for ``heartbeat_interval`` gets a PING, which the peer's I/O
  loop answers with PONG (that loop never runs user code);
- a peer silent for ``link_timeout`` is unreachable: every call waiting on it
  fails (``CauseKind.UNREACHABLE``: it may or may not have run), supervision
  hears it, later sends fail at once, and the connection is aborted so that
  the far side, if it still hears us, learns it at once too.

A process that was itself frozen (a late round) judges nobody until the
silence clocks restart: the traffic that arrived meanwhile is not read yet.

Busy is not dead: a proc spawned by a host agent is judged through that agent
(:meth:`LinkWatch.judge_through`). While the agent answers, the proc is kept
however long it is silent (a long call holding the GIL); the agent's own judge
reports it if it really died or hung. Only an agent that falls silent makes
its procs unreachable, all at once, each named with its host.

The far side fences itself with the same rule: an agent that hears nothing
from its controller for ``link_timeout`` stops that controller's procs
(``HostAgent._lost``), so no orphaned work runs after a heal. A partition
shorter than ``link_timeout`` is invisible: TCP delivers what was in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..errors import Cause, CauseKind
from . import _messages as M
from ._routes import Route

if TYPE_CHECKING:
    from ._proc import ProcRuntime

log = logging.getLogger("actormesh.links")

__all__ = ["LinkWatch", "silent_links"]

_PING = M.PING_BYTES


def silent_links(
    links: Iterable[tuple[str, float]],
    judges: dict[str, str],
    now: float,
    timeout_s: float,
) -> list[tuple[str, float, str | None]]:
    """The peers to declare unreachable: ``(address, silent_s, silent judge or None)``.

    ``links`` are ``(address, last_rx)`` of the watched links; ``judges`` maps
    a proc to the agent that judges it. A peer silent past ``timeout_s`` is
    unreachable unless its judge is heard from within ``timeout_s`` (then it is
    busy, not gone). A judge that is not watched (no link) cannot vouch.
    Pure: the rules in virtual time.
    """
    last = dict(links)
    out = []
    for address, rx in last.items():
        silent = now - rx
        if silent <= timeout_s:
            continue
        judge = judges.get(address)
        if judge is not None and judge in last and now - last[judge] <= timeout_s:
            continue  # its host answers: busy, not gone
        out.append((address, silent, judge if judge in last else None))
    return out


class LinkWatch:
    """Watches one runtime's TCP links to peers that are not its children (loop thread)."""

    def __init__(self, runtime: ProcRuntime, clock: Callable[[], float] = time.monotonic) -> None:
        self._rt = runtime
        self._clock = clock
        #: proc address -> the host agent that judges it
        self.judges: dict[str, str] = {}
        self._pinged: dict[int, float] = {}
        self._timer: Any = None
        self._stopped = False
        #: When this watch last ran a round, and since when it may judge silence: a
        #: round that comes late (this process was frozen: GIL held, SIGSTOP) restarts
        #: every silence clock, since what arrived meanwhile is not read yet.
        self._last_round: float | None = None
        self._judging_since = clock()

    def start(self) -> None:
        """Run rounds every ``heartbeat_interval / 2`` (any thread)."""
        self._rt.loop.call_soon_threadsafe(self._round)

    def stop(self) -> None:
        """No more rounds (loop thread)."""
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def resume(self) -> None:
        """Rounds again after :meth:`stop` (loop thread; benchmarks compare on and off)."""
        if self._stopped:
            self._stopped = False
            self._last_round = None
            self._judging_since = self._clock()
            self._round()

    def judge_through(self, addresses: Iterable[str], agent: str) -> None:
        """Judge the procs at ``addresses`` through the host agent at ``agent`` (any thread)."""
        for a in addresses:
            self.judges[a] = agent

    def forget(self, address: str) -> None:
        """A peer is gone: drop what was kept about it (loop thread)."""
        self.judges.pop(address, None)

    def _watched(self) -> dict[str, Any]:
        rt = self._rt
        out = {}
        for address, route in list(rt._routes.items()):
            if type(route) is not Route or route.child or route.dead is not None:
                continue
            conn = route.conn
            if conn is None or conn.closed or not address.startswith("tcp:") or address == rt.parent_address:
                continue  # a spawner is on our own host: its loss closes the socket
            out[address] = conn
        return out

    def _round(self) -> None:
        rt = self._rt
        self._timer = None
        if self._stopped or rt.closed:
            return
        cfg = rt.config
        now = self._clock()
        if self._last_round is not None and now - self._last_round > 2 * cfg.heartbeat_interval:
            self._judging_since = now  # we were frozen, not them
        self._last_round = now
        links = self._watched()
        for conn in links.values():
            if now - conn.last_rx >= cfg.heartbeat_interval and now - self._pinged.get(id(conn), 0.0) >= cfg.heartbeat_interval:
                self._pinged[id(conn)] = now
                try:
                    conn.send([_PING])
                except Exception:
                    pass  # a closed connection is reported by its close
        live = {id(c) for c in links.values()}
        for key in [k for k in self._pinged if k not in live]:
            del self._pinged[key]
        since = self._judging_since
        verdicts = silent_links(((a, max(c.last_rx, since)) for a, c in links.items()), self.judges, now, cfg.link_timeout)
        for address, silent, judge in verdicts:
            self._unreachable(address, links[address], silent, judge, cfg.link_timeout)
        self._timer = rt.loop.call_later(cfg.heartbeat_interval / 2, self._round)

    def _unreachable(self, address: str, conn: Any, silent: float, judge: str | None, timeout_s: float) -> None:
        rt = self._rt
        if address in rt._dead:
            return  # already declared (e.g. with its host agent in this round)
        if judge is not None:
            text = (f"the proc at {address} is unreachable: it and its host agent at {judge} have been silent for "
                    f"{silent:.1f}s (link_timeout is {timeout_s:g}s): a network partition or a frozen host; "
                    "calls to it may or may not have run")
        else:
            text = (f"the process at {address} is unreachable: silent for {silent:.1f}s (link_timeout is {timeout_s:g}s): "
                    "a network partition or a frozen host; calls to it may or may not have run")
        log.warning("%s", text)
        rt.peer_gone(address, Cause(text, CauseKind.UNREACHABLE))
        conn.abort()  # the far side, if it still hears us, learns at once
        for proc, agent in list(self.judges.items()):
            if agent == address and proc not in rt._dead:
                rt.peer_gone(proc, Cause(
                    f"the proc at {proc} is unreachable: its host agent at {address} has been silent for {silent:.1f}s "
                    f"(link_timeout is {timeout_s:g}s): a network partition or a frozen host; calls to it may or may "
                    "not have run", CauseKind.UNREACHABLE))
