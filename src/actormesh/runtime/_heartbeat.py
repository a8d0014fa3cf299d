"""The asyncio shell around the liveness judge (``_liveness.py``) of one spawner.

Every ``heartbeat_interval / 2`` on the loop thread, a :class:`Heartbeat` takes
a snapshot of the spawner's ready children (pid, when bytes last arrived, the
policy each was spawned with), asks the judge, and acts: it pings the quiet
ones and, for each child the judge declares dead (stopped, hung), reports the
verdict's Cause and then kills the child (so no late reply can ever arrive).
The rules live in the judge, tested in virtual time; this shell only moves
data in and actions out. It is owned by its runtime (``runtime.heartbeat``)
and ends when the runtime closes or :meth:`Heartbeat.stop` is called.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _messages as M
from ._liveness import LivenessJudge, Peer

if TYPE_CHECKING:
    from ._proc import ProcRuntime

log = logging.getLogger("actormesh.spawn")

__all__ = ["Heartbeat"]

_PING = M.PING_BYTES


class Heartbeat:
    """Liveness rounds for the children of one runtime (loop thread only).

    ``kill(child)`` ends a child the judge declared dead.
    """

    def __init__(self, runtime: ProcRuntime, judge: LivenessJudge, kill: Callable[[Any], None]) -> None:
        self._runtime = runtime
        self._judge = judge
        self._kill = kill
        self._timer: Any = None
        self._stopped = False

    def start(self) -> None:
        """Run the first round soon (any thread)."""
        self._runtime.loop.call_soon_threadsafe(self._round)

    def stop(self) -> None:
        """No more rounds (loop thread)."""
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _round(self) -> None:
        rt = self._runtime
        self._timer = None
        if self._stopped or rt.closed:
            return
        judged = self._observe()
        verdicts = self._judge.tick(peer for _, _, peer in judged.values())
        for key in verdicts.ping:
            try:
                judged[key][1].send([_PING])
            except Exception:
                pass  # a closed connection is reported by its close
        for death in verdicts.deaths:
            child = judged[death.key][0]
            log.warning("proc %s (pid %s) declared %s: %s", child.name, child.popen.pid if child.popen else "?", death.verdict.value, death.reason)
            # Report first, then kill: a host agent's report then leaves before the
            # proc's own connections close, so the controller hears the verdict. The
            # report is written by a flush that its send scheduled on this loop: the
            # kill is scheduled after it, not done now (a kill first let the proc's
            # connection close reach the controller before the report, under load).
            rt.peer_gone(child.address, death.reason)
            rt.loop.call_soon(self._kill, child)
        for key, (child, _, _) in judged.items():
            child.rss_bytes = self._judge.rss_bytes(key)
        interval = min((p.policy.interval_s for _, _, p in judged.values()), default=rt.config.heartbeat_interval)
        self._timer = rt.loop.call_later(interval / 2, self._round)

    def _observe(self) -> dict[str, tuple[Any, Any, Peer]]:
        """The children to judge this round: ready, connected, not being stopped."""
        rt = self._runtime
        judged = {}
        for child in list(rt.children.values()):
            conn = getattr(rt._routes.get(child.address), "conn", None)
            if conn is None or not child.ready.done() or child.stopping or child.popen is None:
                continue
            judged[child.address] = (child, conn, Peer(child.address, child.popen.pid, conn.last_rx, child.policy))
        return judged
