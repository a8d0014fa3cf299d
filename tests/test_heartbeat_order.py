"""The spawner's liveness round reports a dead child before it kills it
(runtime/_heartbeat.py): the report's bytes leave before the child's own
connections close, so a remote controller hears the verdict, not a bare
"connection lost". No processes: a fake runtime whose loop runs callbacks in order."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from actormesh.errors import Cause, CauseKind
from actormesh.runtime._heartbeat import Heartbeat
from actormesh.runtime._liveness import Death, Policy, Verdict


class _Loop:
    def __init__(self) -> None:
        self.soon: list[tuple[Any, tuple[Any, ...]]] = []

    def call_soon(self, fn: Any, *args: Any) -> None:
        self.soon.append((fn, args))

    def call_later(self, delay: float, fn: Any, *args: Any) -> None:
        pass

    def run(self) -> None:
        while self.soon:
            fn, args = self.soon.pop(0)
            fn(*args)


def test_a_dead_child_is_reported_before_it_is_killed() -> None:
    events: list[str] = []
    loop = _Loop()
    child = SimpleNamespace(address="p0", name="p0", ready=SimpleNamespace(done=lambda: True), stopping=False,
                            popen=SimpleNamespace(pid=1), policy=Policy(), rss_bytes=0)
    cause = Cause("was stopped", CauseKind.HUNG)

    def peer_gone(address: str, reason: Cause) -> None:
        # as a host agent's hook does: the report is sent, and a send on the loop
        # thread is written by a flush scheduled on the loop
        loop.call_soon(events.append, f"report {address}: {reason}")

    rt = SimpleNamespace(closed=False, loop=loop, children={"p0": child}, peer_gone=peer_gone,
                         _routes={"p0": SimpleNamespace(conn=SimpleNamespace(last_rx=0.0))},
                         config=SimpleNamespace(heartbeat_interval=1.0))
    judge = SimpleNamespace(tick=lambda peers: SimpleNamespace(ping=[], deaths=[Death(p.key, Verdict.STOPPED, cause) for p in peers]),
                            rss_bytes=lambda key: 0)
    hb = Heartbeat(rt, judge, lambda c: events.append(f"kill {c.address}"))  # type: ignore[arg-type]
    hb._round()
    loop.run()
    assert events == ["report p0: was stopped", "kill p0"]
