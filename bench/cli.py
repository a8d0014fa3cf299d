"""``python -m bench``: run the workloads, print the table, write bench/results/latest.json.

Every workload runs in its own subprocess (``bench._runner``) with a wall-clock
limit, so one that hangs or crashes is reported and the rest still run. With
``--monarch`` the same workload code also runs under the Monarch venv's
interpreter (``BENCH_IMPL=monarch``), interleaved with the actormesh run of the
same workload so both see the same machine load.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._report import MONARCH_WORKLOADS, ROWS, advantage, fmt, fmt_target, meets
from bench._runner import WORKLOADS

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
DEFAULT_MONARCH_PY = os.environ.get("BENCH_MONARCH_PYTHON", "/work/monarch-venv/bin/python")
ALIASES = {"tensor": "payload", "tensors": "payload", "100actors": "actors", "many": "actors", "memory": "rss"}
#: Wall-clock limit per workload run (s): (full, quick).
LIMITS = {
    "baseline": (60, 30),
    "noop": (90, 40),
    "pipelined": (90, 40),
    "broadcast": (120, 60),
    "payload": (150, 60),
    "spawn": (90, 45),
    "actors": (90, 45),
    "rss": (60, 40),
}
EXIT_GRACE_S = 20.0
PYCACHE = os.path.join(tempfile.gettempdir(), "actormesh-bench-pycache")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return ""


def machine_facts() -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    mem_gb = None
    try:
        with open("/proc/meminfo") as f:
            mem_gb = round(int(f.readline().split()[1]) / 1e6, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu,
        "mem_total_gb": mem_gb,
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "loadavg_start": os.getloadavg(),
        "git_head": _sh(["git", "rev-parse", "--short", "HEAD"]),
        "git_src_dirty": bool(_sh(["git", "status", "--porcelain", "--", "src"])),
    }


def run_one(workload: str, impl: str, python: str, quick: bool, params: dict[str, Any], logdir: Path, bytecode_cache: bool = False) -> dict[str, Any]:
    """Run one workload in a subprocess; always returns a result dict (ok or not)."""
    limit = LIMITS[workload][1 if quick else 0]
    out = logdir / f"{workload}-{impl}.json"
    log = logdir / f"{workload}-{impl}.log"
    env = os.environ.copy()
    env["BENCH_IMPL"] = impl
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    if bytecode_cache:  # workers read compiled bytecode, as on a normal install
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = PYCACHE
    cmd = [python, "-m", "bench._runner", workload, "--out", str(out), "--params", json.dumps(params), "--hang-dump-s", str(max(5, limit - 8))]
    if quick:
        cmd.append("--quick")
    _log(f"  {workload:<10} [{impl}] ...")
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    note = None
    with open(log, "wb") as logf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + limit
            while proc.poll() is None and time.monotonic() < deadline:
                if out.exists():  # finished its work: give it a bounded time to exit cleanly
                    try:
                        proc.wait(EXIT_GRACE_S)
                    except subprocess.TimeoutExpired:
                        note = f"runner finished but did not exit within {EXIT_GRACE_S:.0f}s (shutdown hang?); killed"
                    break
                time.sleep(0.05)
            if proc.poll() is None and note is None and not out.exists():
                note = f"timed out after {limit}s; killed (stack dump in the log)"
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait(10)
    wall = time.perf_counter() - t0
    if out.exists():
        result = json.loads(out.read_text())
        if note:
            result.setdefault("notes", []).append(note)
    else:
        result = {"workload": workload, "impl": impl, "ok": False, "error": note or f"runner exited with code {proc.returncode} and no result"}
    if result.get("leftover_procs"):
        result.setdefault("notes", []).append(f"{len(result['leftover_procs'])} child process(es) still alive after the workload (killed): {result['leftover_procs']}")
    result["log"] = str(log)
    result["log_tail"] = log.read_text(errors="replace")[-3000:] if not result.get("ok") or note else ""
    result["subprocess_wall_s"] = wall
    result["loadavg_1m_before"] = load_before
    status = "ok" if result.get("ok") else f"FAILED: {result.get('error')}"
    _log(f"  {workload:<10} [{impl}] {status} ({wall:.1f} s)")
    return result


def _best_baseline(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Merge two baseline runs: lowest latencies, highest rate; both kept in ``runs``."""
    runs = [r for r in (first, second) if r.get("ok")]
    if not runs:
        return first
    best = dict(runs[0])
    best["metrics"] = {
        "rtt_p50_us": min(r["metrics"]["rtt_p50_us"] for r in runs),
        "rtt_p99_us": min(r["metrics"]["rtt_p99_us"] for r in runs),
        "pipelined_msgs_s": max(r["metrics"]["pipelined_msgs_s"] for r in runs),
    }
    best["runs"] = [{"metrics": r.get("metrics"), "info": r.get("info"), "loadavg_1m_before": r.get("loadavg_1m_before")} for r in (first, second)]
    return best


def monarch_probe(python: str) -> str | None:
    """None if ``python`` can import monarch.actor, else why not."""
    if not Path(python).exists():
        return f"no Monarch interpreter at {python} (create it: python3.11 -m venv /work/monarch-venv && /work/monarch-venv/bin/pip install torch==2.13.0 torchmonarch==0.7.0)"
    try:
        r = subprocess.run([python, "-c", "import monarch.actor"], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return f"{python} -c 'import monarch.actor' timed out"
    if r.returncode:
        return f"{python} cannot import monarch.actor: {r.stderr.strip()[-500:]}"
    return None


def build_rows(results: dict[str, dict[str, Any]], monarch: bool) -> list[dict[str, Any]]:
    def value(impl: str, workload: str, metric: str) -> Any:
        res = results.get(workload, {}).get(impl)
        if not res or not res.get("ok"):
            return None
        return res.get("metrics", {}).get(metric)

    rows = []
    for row in ROWS:
        if row.workload not in results:
            continue
        ours = value("actormesh", row.workload, row.metric)
        ref = value("actormesh", *row.ref) if row.ref else None
        theirs = value("monarch", row.workload, row.metric) if monarch and row.monarch else None
        rows.append(
            {
                "workload": row.workload,
                "metric": row.metric,
                "label": row.label,
                "unit": row.unit,
                "better": row.better,
                "actormesh": ours,
                "failed": results[row.workload].get("actormesh", {}).get("ok") is False,
                "target": row.target,
                "target_met": meets(row, ours),
                "ref_ratio": (ours / (ref * row.ref_scale)) if (ref and ours is not None and not isinstance(ours, bool)) else None,
                "ref_name": row.ref_name,
                "monarch_issue": row.monarch_issue,
                "monarch": theirs,
                "monarch_failed": bool(monarch and row.monarch and results[row.workload].get("monarch", {}).get("ok") is False),
                "advantage": advantage(row, ours, theirs),
                "_row": row,
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], meta: dict[str, Any], monarch: bool, monarch_note: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200 if monarch else 170)
    title = f"actormesh benchmarks - {meta['date']} - {meta['nproc']} cores - Python {meta['python']}" + (" - QUICK (smoke run)" if meta.get("quick") else "")
    if meta.get("bytecode_cache"):
        title += " - bytecode cache on"
    table = Table(title=title, show_lines=False, header_style="bold")
    table.add_column("workload")
    table.add_column("actormesh", justify="right")
    table.add_column("target", justify="right")
    table.add_column("met", justify="center")
    table.add_column("÷ ref", justify="right")
    table.add_column("Monarch 0.7.0 (issue)", justify="right")
    if monarch:
        table.add_column("Monarch (this run)", justify="right")
        table.add_column("actormesh advantage", justify="right")
    last = None
    for r in rows:
        row = r["_row"]
        if last is not None and r["workload"] != last:
            table.add_section()
        last = r["workload"]
        ours = "[red]ERROR[/red]" if r["failed"] else fmt(r["actormesh"], row.unit)
        met = {True: "[green]✓[/green]", False: "[red]✗[/red]", None: ""}[r["target_met"]]
        ratio = f"{r['ref_ratio']:.2f}x {r['ref_name']}" if r["ref_ratio"] is not None else ""
        cells = [row.label, ours, fmt_target(row), met, ratio, fmt(row.monarch_issue, row.unit) if row.monarch_issue is not None else ""]
        if monarch:
            theirs = "[red]ERROR[/red]" if r["monarch_failed"] else (fmt(r["monarch"], row.unit) if row.monarch else "")
            adv = r["advantage"]
            cells += [theirs, "" if adv is None else (f"[green]{adv:.2f}x[/green]" if adv >= 1 else f"[red]{adv:.2f}x[/red]")]
        table.add_row(*cells)
    console.print(table)
    console.print(
        "÷ ref: this figure divided by the baseline row of the same kind (latency: >1 = slower than plain uvloop; "
        "throughput: <1 = fewer per second) or, for tensors, by torch copy_ of the same size. "
        "* baseline: the better of a run at the start and one at the end of the suite. "
        + ("actormesh advantage: >1 = actormesh better than Monarch measured in this run." if monarch else "")
    )
    if monarch_note:
        console.print(f"[yellow]Monarch comparison: {monarch_note}[/yellow]")


def markdown_table(rows: list[dict[str, Any]], monarch: bool) -> str:
    """The table as GitHub markdown (for bench/RESULTS.md)."""
    head = ["workload", "actormesh", "target", "met", "÷ ref", "Monarch 0.7.0 (issue)"]
    if monarch:
        head += ["Monarch (this run)", "actormesh advantage"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        row = r["_row"]
        cells = [
            row.label,
            "ERROR" if r["failed"] else fmt(r["actormesh"], row.unit),
            fmt_target(row).replace("<=", "≤").replace(">=", "≥"),
            {True: "✓", False: "✗", None: ""}[r["target_met"]],
            f"{r['ref_ratio']:.2f}x {r['ref_name']}" if r["ref_ratio"] is not None else "",
            fmt(row.monarch_issue, row.unit) if row.monarch_issue is not None else "",
        ]
        if monarch:
            cells.append("ERROR" if r["monarch_failed"] else (fmt(r["monarch"], row.unit) if row.monarch else ""))
            cells.append("" if r["advantage"] is None else f"{r['advantage']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description="actormesh benchmarks (see bench/README.md)")
    ap.add_argument("workloads", nargs="*", metavar="WORKLOAD", help=f"any of {', '.join(WORKLOADS)} (default: all)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations: a smoke run (< 60 s for all)")
    ap.add_argument("--monarch", action="store_true", help=f"also run the Monarch-comparable workloads under Monarch ({DEFAULT_MONARCH_PY})")
    ap.add_argument("--monarch-python", default=DEFAULT_MONARCH_PY, help="interpreter of a venv with torchmonarch installed")
    ap.add_argument("--out", default=str(RESULTS / "latest.json"), help="JSON results file (default: bench/results/latest.json)")
    ap.add_argument(
        "--bytecode-cache",
        action="store_true",
        help="let every process read/write compiled bytecode (unsets PYTHONDONTWRITEBYTECODE, cache under PYTHONPYCACHEPREFIX in the temp dir)",
    )
    ap.add_argument("--markdown", metavar="FILE", help="also write the table as markdown to FILE")
    ap.add_argument("--keep-logs", action="store_true", help="keep the per-workload logs even when everything passed")
    args = ap.parse_args(argv)

    selected: list[str] = []
    for name in args.workloads:
        name = ALIASES.get(name, name)
        if name not in WORKLOADS:
            ap.error(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        if name not in selected:
            selected.append(name)
    if not selected:
        selected = list(WORKLOADS)
    selected.sort(key=WORKLOADS.index)

    meta = machine_facts()
    meta["quick"] = args.quick
    meta["workloads"] = selected
    meta["bytecode_cache"] = args.bytecode_cache
    meta["env_PYTHONDONTWRITEBYTECODE"] = os.environ.get("PYTHONDONTWRITEBYTECODE")
    if meta["loadavg_start"][0] > 0.5 * (meta["nproc"] or 1):
        _log(f"warning: load average {meta['loadavg_start'][0]:.2f} on {meta['nproc']} cores: something else is running, figures will be noisy")
    monarch_note = None
    if args.monarch:
        monarch_note = monarch_probe(args.monarch_python)
        meta["monarch_python"] = args.monarch_python
        meta["monarch_available"] = monarch_note is None
    use_monarch = args.monarch and monarch_note is None

    logdir = Path(tempfile.mkdtemp(prefix="bench-logs-"))
    _log(f"actormesh bench: {', '.join(selected)}{' (quick)' if args.quick else ''}; logs in {logdir}")
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for name in selected:
        results[name] = {"actormesh": run_one(name, "actormesh", sys.executable, args.quick, {}, logdir, args.bytecode_cache)}
        if use_monarch and name in MONARCH_WORKLOADS:
            results[name]["monarch"] = run_one(name, "monarch", args.monarch_python, args.quick, MONARCH_WORKLOADS[name], logdir, args.bytecode_cache)
    if "baseline" in results and len(selected) > 1:
        # The floor is measured again at the end and the better figure of the two
        # runs is the reference: a load spike from elsewhere on a shared machine
        # should not make actormesh look close to the floor.
        again = run_one("baseline", "actormesh", sys.executable, args.quick, {}, logdir, args.bytecode_cache)
        results["baseline"]["actormesh"] = _best_baseline(results["baseline"]["actormesh"], again)
    meta["total_s"] = time.perf_counter() - t0
    meta["loadavg_end"] = os.getloadavg()
    if use_monarch:
        mres = next((r["monarch"] for r in results.values() if "monarch" in r), {})
        meta["monarch_version"] = mres.get("impl_version")
    if args.monarch and use_monarch and any(not r.get("monarch", {}).get("ok", True) for r in results.values()):
        failed = [n for n, r in results.items() if not r.get("monarch", {}).get("ok", True)]
        monarch_note = f"Monarch run failed for: {', '.join(failed)} (see errors below); no figures shown for those"

    rows = build_rows(results, use_monarch)
    print_table(rows, meta, use_monarch, monarch_note)

    failures = [(n, impl, r) for n, per in results.items() for impl, r in per.items() if not r.get("ok") or r.get("notes")]
    for name, impl, r in failures:
        print(f"\n[{name} / {impl}] {r.get('error') or ''} {'; '.join(r.get('notes', []))}\n  log: {r.get('log')}")
        if r.get("traceback"):
            print("  " + r["traceback"].strip().replace("\n", "\n  ")[-2500:])
        elif r.get("log_tail"):
            print("  ..." + r["log_tail"][-1500:].replace("\n", "\n  "))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": meta,
        "rows": [{k: v for k, v in r.items() if k != "_row"} for r in rows],
        "results": results,
        "monarch_note": monarch_note,
    }
    text = json.dumps(doc, indent=1, default=str)
    out.write_text(text)
    if out.resolve() == (RESULTS / "latest.json").resolve():
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        (RESULTS / f"run-{stamp}{'-quick' if args.quick else ''}.json").write_text(text)
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(rows, use_monarch))
        print(f"wrote {args.markdown}")
    print(f"\nwrote {out} ({meta['total_s']:.0f} s total)")
    if not failures and not args.keep_logs:
        shutil.rmtree(logdir, ignore_errors=True)
    return 1 if any(not r.get("ok") for per in results.values() for r in per.values()) else 0
