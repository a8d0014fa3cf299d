"""Telemetry snapshots of a process, and asking other processes for theirs.

Every runtime answers ``STATS`` with :func:`stats_snapshot`: who it is
(address, host, pid), its usage (RSS, CPU), what it sent, and one row per
actor (status, failure cause with traceback, owner, mailbox depth, counters,
latency histogram). The controller's dashboard gathers these with
:func:`gather_stats`; every wait has a deadline and a process that is gone or
silent yields None instead of a row.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..config import get_config
from ..telemetry import FIGURES, STATE, enable, process_usage
from ..transport import dumps
from . import _messages as M
from ._ports import OnePort

if TYPE_CHECKING:
    from ._proc import ProcRuntime

__all__ = ["install", "stats_snapshot", "gather_stats", "telemetry_wanted", "serve_telemetry", "DashboardStarter", "use_dashboard"]

log = logging.getLogger("actormesh.runtime")

_HOST = socket.gethostname()

#: Serves the controller's dashboard on (port, host) for a runtime; returns its URL.
DashboardStarter = Callable[[int, str, "ProcRuntime"], str]

_dashboard: DashboardStarter | None = None


def use_dashboard(starter: DashboardStarter) -> None:
    """Register how this process serves a dashboard (the dashboard layer does, when
    imported; the ``actormesh.actor`` facade registers one that imports it on first use)."""
    global _dashboard
    _dashboard = starter


def telemetry_wanted() -> bool:
    """Whether the settings in force ask for telemetry (``telemetry`` or a dashboard port)."""
    cfg = get_config()
    return bool(cfg.telemetry or cfg.dashboard_port)


def install(rt: ProcRuntime) -> None:
    """Answer STATS on ``rt``; turn telemetry on when the settings ask for it."""
    if telemetry_wanted():
        enable(service=f"actormesh-{rt.name}")
    STATE.snapshot = lambda: stats_snapshot(rt)
    STATE.current_actor = _current_actor

    def on_stats(env: M.Stats) -> None:
        rt.reply(env.reply, 0, M.OK, dumps(stats_snapshot(rt)))

    rt.handlers.stats = on_stats
    cfg = get_config()
    if cfg.dashboard_port and rt.name == "client" and rt.parent_address is None:
        _start_dashboard(rt, cfg.dashboard_port, cfg.dashboard_host)


def serve_telemetry(rt: ProcRuntime, dashboard: tuple[str, int] | None = None) -> str | None:
    """Turn telemetry on in this running process; with ``dashboard`` (host, port),
    serve the dashboard there too (once per process) and return its URL."""
    enable(service=f"actormesh-{rt.name}")
    if dashboard is None:
        return None
    host, port = dashboard
    return _start_dashboard(rt, port, host)


def _start_dashboard(rt: ProcRuntime, port: int, host: str) -> str | None:
    """The controller serves the dashboard (``configure(dashboard_port=...)``); its URL.

    The dashboard sits above this layer (and needs FastAPI): it is reached through
    what registered with :func:`use_dashboard`. A dashboard that cannot start is
    logged, and the job runs on without it.
    """
    if _dashboard is None:
        log.error("the dashboard could not start (dashboard_port=%s): no dashboard is loaded in this process; "
                  "import actormesh.dashboard (or actormesh.actor) before the first spawn", port)
        return None
    try:
        return _dashboard(port, host, rt)
    except Exception as exc:
        log.error("the dashboard could not start (dashboard_port=%s): %s", port, exc)
        return None


def _current_actor() -> str | None:
    from ._actor import _context

    ctx = _context.get()
    return None if ctx is None else ctx.actor_instance._display


def stats_snapshot(rt: ProcRuntime) -> dict[str, Any]:
    """This process's telemetry as builtins (see the module docstring)."""
    cells = list(rt.actors.values())
    rss, cpu = process_usage()
    if STATE.on:
        FIGURES.prune({c.name for c in cells})
    return {
        "address": rt.address,
        "name": rt.name,
        "hostname": _HOST,
        "pid": os.getpid(),
        "parent": rt.parent_address,
        "time": time.time(),
        "started": FIGURES.started,
        "telemetry": STATE.on,
        "rss_bytes": rss,
        "cpu_s": cpu,
        "messages_out": rt.messages_sent(),
        "bytes_out": FIGURES.bytes_out,
        "actors": [c.snapshot_row() for c in cells],
    }


def gather_stats(rt: ProcRuntime, addresses: Sequence[str], timeout_s: float) -> list[dict[str, Any] | None]:
    """Snapshots of the processes at ``addresses`` (None for one that did not answer in time).

    Call from any thread but ``rt``'s loop thread. ``rt``'s own address is
    answered locally.
    """
    ports: list[OnePort | None] = []
    for addr in addresses:
        if addr == rt.address:
            ports.append(None)
            continue
        port = OnePort(rt, "stats", addr)
        rt.ask_stats(addr, (rt.address, port.port_id))
        ports.append(port)
    deadline = time.monotonic() + timeout_s
    out: list[dict[str, Any] | None] = []
    for addr, asked in zip(addresses, ports):
        if asked is None:
            out.append(stats_snapshot(rt))
            continue
        try:
            out.append(asked.future.get(timeout=max(0.0, deadline - time.monotonic())))
        except Exception:
            out.append(None)  # gone, or busy past the deadline: the caller shows it as silent
            rt.unregister_port(asked.port_id)  # a late answer is dropped; nothing waits on it
            rt.unawait_peer(addr, asked)
    return out
