"""The rows of the results table: what each figure is, its target, and how to print it.

Targets and the "Monarch 0.7.0 (issue)" figures are the ones stated in the
performance issue (Monarch measured on this 2-core machine at the time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOWER, HIGHER, EQUAL = "lower", "higher", "equal"


@dataclass(frozen=True)
class Row:
    workload: str
    metric: str
    label: str
    unit: str
    better: str = LOWER
    target: Any = None
    monarch_issue: Any = None
    ref: tuple[str, str] | None = None  # (workload, metric) this figure is divided by
    ref_scale: float = 1.0  # multiplies the ref value into this row's unit
    ref_name: str = ""
    monarch: bool = False  # also measured in --monarch mode


def _payload_rows() -> list[Row]:
    rows = []
    for size in (1, 16, 128, 512):
        copy = ("payload", f"copy_{size}MiB_GBs")
        rows.append(Row("payload", f"copy_{size}MiB_GBs", f"reference: torch copy_ {size} MiB", "GB/s", HIGHER))
        rows.append(Row("payload", f"sum_{size}MiB_GBs", f"tensor sum {size} MiB (send, get float)", "GB/s", HIGHER, ref=copy, ref_name="copy_"))
        big = size == 128
        rows.append(
            Row(
                "payload",
                f"echo_{size}MiB_GBs",
                f"tensor echo {size} MiB (send + return, 2x bytes)",
                "GB/s",
                HIGHER,
                target=4.0 if big else None,
                monarch_issue=0.45 if big else None,
                ref=copy,
                ref_name="copy_",
                monarch=big,
            )
        )
        rows.append(Row("payload", f"echo_socket_{size}MiB_GBs", f"tensor echo {size} MiB, shared memory off", "GB/s", HIGHER, ref=copy, ref_name="copy_"))
    return rows


BASE_P50, BASE_P99, BASE_PIPE = ("baseline", "rtt_p50_us"), ("baseline", "rtt_p99_us"), ("baseline", "pipelined_msgs_s")

ROWS: list[Row] = [
    Row("baseline", "rtt_p50_us", "baseline: uvloop unix-socket ping-pong p50 *", "µs"),
    Row("baseline", "rtt_p99_us", "baseline: uvloop unix-socket ping-pong p99 *", "µs"),
    Row("baseline", "pipelined_msgs_s", "baseline: uvloop pipelined, 5k in flight *", "msg/s", HIGHER),
    Row("noop", "sync_p50_us", "noop call_one round trip p50 (sync actor)", "µs", target=150, monarch_issue=665, ref=BASE_P50, ref_name="baseline", monarch=True),
    Row("noop", "sync_p99_us", "noop call_one round trip p99 (sync actor)", "µs", ref=BASE_P99, ref_name="baseline", monarch=True),
    Row("noop", "async_p50_us", "noop call_one round trip p50 (async actor)", "µs", target=150, ref=BASE_P50, ref_name="baseline", monarch=True),
    Row("noop", "async_p99_us", "noop call_one round trip p99 (async actor)", "µs", ref=BASE_P99, ref_name="baseline", monarch=True),
    Row("pipelined", "calls_s", "pipelined call_one, 5k in flight", "calls/s", HIGHER, target=100e3, monarch_issue=5.4e3, ref=BASE_PIPE, ref_name="baseline", monarch=True),
    Row("broadcast", "gather_p50_ms", "broadcast+gather call() to 8 procs p50", "ms", target=0.5, monarch_issue=1.78, ref=BASE_P50, ref_scale=1e-3, ref_name="baseline", monarch=True),
    Row("broadcast", "gather_p99_ms", "broadcast+gather call() to 8 procs p99", "ms", ref=BASE_P99, ref_scale=1e-3, ref_name="baseline", monarch=True),
    Row("broadcast", "bcast_s", "fire-and-forget broadcasts to 8 procs", "bcast/s", HIGHER, target=10e3, monarch_issue=3.4e3, monarch=True),
    *_payload_rows(),
    Row("spawn", "median_s", "spawn 4 procs + actor to first reply from all", "s", target=0.25, monarch_issue=0.37, monarch=True),
    Row("actors", "median_s", "100 actor meshes on 2 procs + one call each", "s", target=0.1, monarch_issue=0.15, monarch=True),
    Row("rss", "rss_mb", "worker RSS, one noop actor, after warm-up", "MB", target=40, monarch_issue=113, monarch=True),
    Row("rss", "torch_loaded", "torch in the noop worker's sys.modules", "", EQUAL, target=False, monarch=True),
]

#: Workloads that --monarch also runs, and their extra run() parameters there.
MONARCH_WORKLOADS: dict[str, dict[str, Any]] = {
    "noop": {},
    "pipelined": {},
    "broadcast": {},
    "payload": {"sizes_mib": [128], "ops": ["echo"]},
    "spawn": {},
    "actors": {},
    "rss": {},
}


def fmt(value: Any, unit: str) -> str:
    """A figure in its unit, readable at a glance."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if unit == "µs":
        return f"{value:,.0f} µs"
    if unit == "ms":
        return f"{value:.3f} ms"
    if unit == "s":
        return f"{value:.3f} s"
    if unit in ("GB/s", "MB"):
        return f"{value:.2f} {unit}" if unit == "GB/s" else f"{value:.1f} MB"
    if unit.endswith("/s"):
        return f"{value / 1e3:,.1f}k {unit}" if value >= 1e4 else f"{value:,.0f} {unit}"
    return f"{value}"


def fmt_target(row: Row) -> str:
    if row.target is None:
        return ""
    if row.better == EQUAL:
        return f"= {fmt(row.target, row.unit)}"
    return ("<= " if row.better == LOWER else ">= ") + fmt(row.target, row.unit)


def meets(row: Row, value: Any) -> bool | None:
    if row.target is None or value is None:
        return None
    if row.better == EQUAL:
        return value == row.target
    return value <= row.target if row.better == LOWER else value >= row.target


def advantage(row: Row, ours: Any, theirs: Any) -> float | None:
    """How many times better actormesh is than Monarch (>1 = actormesh better)."""
    if ours is None or theirs is None or isinstance(ours, bool) or row.better == EQUAL or not ours or not theirs:
        return None
    return theirs / ours if row.better == LOWER else ours / theirs
