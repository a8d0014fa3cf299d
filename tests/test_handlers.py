"""A runtime's handlers of the kinds that are neither calls nor replies: one typed
interface (runtime/_handlers.py), given at construction or filled in by the parts
that own each kind; no process is spawned."""

from __future__ import annotations

from typing import Any

from actormesh.runtime import Handlers, ProcRuntime
from actormesh.runtime import messages as M


def test_handlers_given_at_construction_get_their_kinds_and_nothing_else_is_attached() -> None:
    seen: list[Any] = []
    handlers = Handlers(stop_proc=seen.append, join=[lambda *a: seen.append(a)])
    rt = ProcRuntime(name="handlers-test", handlers=handlers)
    try:
        assert rt.handlers is handlers
        rt._dispatch(M.StopProc(M.STOP_PROC, None), (), None)
        rt._dispatch(M.Join(M.JOIN, "tcp:h:1", "h", 7), (), None)
        assert seen == [M.StopProc(M.STOP_PROC, None), ("tcp:h:1", "h", 7)]
        assert not any(name.startswith("on_") for name in vars(rt))
    finally:
        rt.close()


def test_a_kind_nobody_handles_is_dropped_or_refused() -> None:
    rt = ProcRuntime(name="handlers-none")
    try:
        assert rt.handlers.stop_proc is None and rt.handlers.relay is None
        rt._dispatch(M.StopProc(M.STOP_PROC, None), (), None)  # dropped, no error
    finally:
        rt.close()
