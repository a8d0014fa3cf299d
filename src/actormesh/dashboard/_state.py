"""The dashboard's view of a running job, rebuilt from the runtime's stats snapshots.

A :class:`Collector` thread on the controller asks every known proc for its
snapshot (``runtime.gather_stats``) once per ``interval_s`` (twice that above
``BIG_JOB_ACTORS`` actors, and every ``IDLE_INTERVAL_S`` while nobody watches),
and sooner, within ``fast_s``, when the controller's own supervision records
change (a failure or a restart), so the page shows a failure well within a
second. From two snapshots in a row it derives rates (messages/s, CPU %) and
the mean endpoint latency over the interval. Each state is serialized to JSON
once, on this thread, whatever the number of readers.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..runtime import gather_stats, stats_snapshot
from ..telemetry import LATENCY_BUCKETS_S

log = logging.getLogger("actormesh.dashboard")

__all__ = ["Collector", "LOG_TAIL_LINES"]

#: Forwarded output lines the dashboard keeps (newest last).
LOG_TAIL_LINES = 500
#: Above this many actors, rates refresh every 2 x interval_s (gathering costs the controller CPU).
BIG_JOB_ACTORS = 500
#: Seconds between gathers while no page, ``top`` or API client has looked for WATCH_S seconds.
IDLE_INTERVAL_S = 5.0
WATCH_S = 10.0


def _quantile_s(counts: list[int], q: float) -> float | None:
    """Upper bound (s) of the histogram bucket holding quantile ``q``; None when empty."""
    total = sum(counts)
    if not total:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= rank:
            return LATENCY_BUCKETS_S[i] if i < len(LATENCY_BUCKETS_S) else float(LATENCY_BUCKETS_S[-1])
    return None


def _closed(display: str) -> str:
    """A mesh record's display is an open prefix (``<root>.<Cls name``): close it for showing."""
    return display if display.endswith(">") else display + ">"


class Collector:
    """Gathers snapshots on its own thread and publishes the job's state (``state()``)."""

    def __init__(self, runtime: Any, interval_s: float = 1.0, fast_s: float = 0.1, gather_timeout_s: float = 5.0) -> None:
        self.runtime = runtime
        self.interval_s = interval_s
        self.fast_s = fast_s
        self.gather_timeout_s = gather_timeout_s
        self.logs: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._prev: dict[str, dict[str, Any]] = {}  # address -> last snapshot
        self._known: dict[str, dict[str, Any]] = {}  # address -> last snapshot, also of procs now gone
        self._state: dict[str, Any] = {"version": 0, "hosts": [], "meshes": [], "failures": [], "logs": [], "totals": {}}
        self._json = json.dumps(self._state)
        self._watched = 0.0  # monotonic time a reader last looked
        self.watchers = 0  # open event streams
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="actormesh-dashboard-collector", daemon=True)

    # -- public ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start gathering (first state within one gather)."""
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (bounded)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called (or the runtime closed)."""
        return self._stop.is_set() or bool(getattr(self.runtime, "closed", False))

    def log_line(self, who: str, stream: str, text: str) -> None:
        """A forwarded output line of a proc (``who`` is its rank prefix). Any thread."""
        self.logs.append(f"[{who}] {text}")

    def state(self) -> dict[str, Any]:
        """The latest published state (do not mutate)."""
        self._watched = time.monotonic()
        return self._state

    def state_json(self) -> tuple[int, str]:
        """(version, the latest state as JSON), serialized once per version."""
        self._watched = time.monotonic()
        with self._cond:
            return self._state["version"], self._json

    def wait_newer(self, version: int, timeout_s: float) -> dict[str, Any]:
        """The state once its version exceeds ``version``, or the current one after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._state["version"] <= version and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._state

    def snapshots(self) -> list[dict[str, Any]]:
        """The latest snapshot of every live proc (for ``/metrics``)."""
        return list(self._prev.values())

    # -- the thread --------------------------------------------------------------------------
    def _supervision_mark(self) -> tuple[int, int, int]:
        records = list(getattr(self.runtime, "owned_meshes", {}).values())
        failed = sum(len(r.failed) for r in records)
        restarts = sum(len(r.restart_times) for r in records)
        dead = len(getattr(self.runtime, "_dead", ()))
        return failed, restarts, dead

    def _run(self) -> None:
        last_gather, mark = 0.0, None
        while not self._stop.is_set():
            if getattr(self.runtime, "closed", False):
                return
            now = time.monotonic()
            new_mark = self._supervision_mark()
            if new_mark != mark or now - last_gather >= self._interval(now):
                mark, last_gather = new_mark, now
                try:
                    self._publish(self._build())
                except Exception:
                    log.exception("dashboard: building the job's state failed")
            self._stop.wait(self.fast_s)

    def _interval(self, now: float) -> float:
        if not self.watchers and now - self._watched > WATCH_S:
            return max(self.interval_s, IDLE_INTERVAL_S)
        big = self._state.get("totals", {}).get("actors", 0) > BIG_JOB_ACTORS
        return self.interval_s * (2 if big else 1)

    def _addresses(self) -> list[str]:
        rt = self.runtime
        seen: dict[str, None] = {rt.address: None}
        for child in list(getattr(rt, "children", {}).values()):
            seen.setdefault(child.address, None)
        for record in list(getattr(rt, "owned_meshes", {}).values()):
            for a in record.addresses:
                seen.setdefault(a, None)
        return list(seen)

    def _build(self) -> dict[str, Any]:
        rt = self.runtime
        addresses = self._addresses()
        live = [a for a in addresses if a == rt.address or rt.peer_dead(a) is None]
        snaps = gather_stats(rt, live, self.gather_timeout_s) if len(live) > 1 else [stats_snapshot(rt)]
        procs = []
        current: dict[str, dict[str, Any]] = {}
        for addr, snap in zip(live, snaps):
            if snap is None:
                procs.append(self._silent(addr, "silent: no answer within the deadline"))
                continue
            current[addr] = snap
            procs.append(self._proc_row(snap, self._prev.get(addr)))
        for addr in addresses:
            if addr not in live:
                procs.append(self._silent(addr, f"dead: {rt.peer_dead(addr)}"))
        self._prev = current
        self._known.update(current)
        hosts: dict[str, list[dict[str, Any]]] = {}
        for p in procs:
            hosts.setdefault(p["hostname"], []).append(p)
        rows = {(a["proc"], a["name"]): a for p in procs for a in p["actors"]}
        return {
            "time": time.time(),
            "controller": {"address": rt.address, "pid": current.get(rt.address, {}).get("pid")},
            "hosts": [{"hostname": h, "procs": ps} for h, ps in sorted(hosts.items())],
            "meshes": self._meshes(),
            "failures": self._failures(rows),
            "logs": list(self.logs)[-200:],
            "totals": {"hosts": len(hosts), "procs": len(procs), "actors": len(rows),
                       "failed": sum(1 for a in rows.values() if a["status"] == "failed")},
        }

    def _silent(self, addr: str, status: str) -> dict[str, Any]:
        old = self._known.get(addr, {})
        return {"address": addr, "name": old.get("name", "?"), "hostname": old.get("hostname", "?"), "pid": old.get("pid"),
                "status": status, "rss_bytes": None, "cpu_pct": None, "msgs_out_per_s": None, "actors": []}

    def _proc_row(self, snap: dict[str, Any], prev: dict[str, Any] | None) -> dict[str, Any]:
        dt = snap["time"] - prev["time"] if prev else 0.0
        rate: Callable[[str], float | None] = lambda k: (snap[k] - prev[k]) / dt if prev and dt > 0 else None  # noqa: E731
        cpu = rate("cpu_s")
        before = {a["name"]: a for a in prev["actors"]} if prev else {}
        actors = [self._actor_row(snap["address"], a, before.get(a["name"]), dt) for a in snap["actors"]]
        return {"address": snap["address"], "name": snap["name"], "hostname": snap["hostname"], "pid": snap["pid"],
                "status": "running", "rss_bytes": snap["rss_bytes"], "cpu_pct": None if cpu is None else 100.0 * cpu,
                "msgs_out_per_s": rate("messages_out"), "bytes_out_per_s": rate("bytes_out"), "telemetry": snap["telemetry"],
                "actors": actors}

    @staticmethod
    def _actor_row(proc: str, a: dict[str, Any], prev: dict[str, Any] | None, dt: float) -> dict[str, Any]:
        n, total = a["messages_in"], a["latency_sum_s"]
        dn = n - prev["messages_in"] if prev else 0
        mean = (total - prev["latency_sum_s"]) / dn if prev and dn > 0 else (total / n if n else None)
        p99 = _quantile_s(a["latency_counts"], 0.99)
        return {"proc": proc, "name": a["name"], "display": a["display"], "mesh": a["mesh"], "rank": a["rank"],
                "class": a["class"], "status": a["status"], "cause": a["cause"], "owner": a["owner"],
                "mailbox": a["mailbox"], "messages_in": n, "errors": a["errors"], "restarts": a["restarts"],
                "msgs_per_s": dn / dt if prev and dt > 0 else None,
                "latency_ms": None if mean is None else mean * 1e3, "p99_ms": None if p99 is None else p99 * 1e3}

    def _meshes(self) -> list[dict[str, Any]]:
        out = []
        for r in list(getattr(self.runtime, "owned_meshes", {}).values()):
            status = "stopped" if r.stopped else ("failed" if r.failed else "running")
            out.append({"name": r.name, "display": _closed(r.display), "owner": r.owner, "size": len(r.addresses),
                        "failed": len(r.failed), "restarts": len(r.restart_times), "status": status, "stopped": r.stopped})
        return out

    def _failures(self, rows: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
        out, seen = [], set()
        for r in list(getattr(self.runtime, "owned_meshes", {}).values()):
            for rank, cause in sorted(dict(r.failed).items()):
                seen.add((r.name, rank))
                out.append({"actor": r.member(rank), "mesh": r.name, "rank": rank, "cause": cause,
                            "path": [r.member(rank), _closed(r.display), "<root>" if r.owner == "client" else r.owner]})
        by_name = {(a["proc"], a["name"]): a for a in rows.values()}
        for a in rows.values():
            if a["status"] != "failed" or (a["mesh"], a["rank"]) in seen:
                continue
            path, owner, hops = [a["display"]], a["owner"], 0
            while owner is not None and hops < 16:  # the owner chain up to the controller
                up = by_name.get((owner[0], owner[1]))
                if up is None:
                    path.append("<root>" if owner[1] == "client" else owner[1])
                    break
                path.append(up["display"])
                owner, hops = up["owner"], hops + 1
            out.append({"actor": a["display"], "mesh": a["mesh"], "rank": a["rank"], "cause": a["cause"], "path": path})
        return out

    def _publish(self, state: dict[str, Any]) -> None:
        state["version"] = self._state["version"] + 1
        text = json.dumps(state, separators=(",", ":"))
        with self._cond:
            self._state, self._json = state, text
            self._cond.notify_all()
