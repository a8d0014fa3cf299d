"""``python -m bench.compat.report``: merge the two results JSONs into the committed tables.

Reads ``bench/compat/results/{monarch,actormesh}.json`` and writes
``bench/compat/outcomes.csv`` (one row per test: outcome on each implementation and
the first line of each failure message) and prints the per-file table used in
RESULTS.md plus the gaps (passes on Monarch, not on actormesh) grouped by their
first error line, the raw material of GAPS.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTCOMES = ("passed", "failed", "error", "skipped", "hang", "xfailed", "xpassed")


def _rows(path: Path) -> dict[tuple[str, str], dict]:
    doc = json.loads(path.read_text())
    return {(r["file"], r["test"]): r for f in doc["files"].values() for r in f["rows"]}


def first_line(message: str) -> str:
    return (message.strip().splitlines() or [""])[0].strip()


def _norm(line: str) -> str:
    """Group key: the error line with addresses, numbers in reprs and paths blurred."""
    line = re.sub(r"0x[0-9a-f]+", "0x…", line)
    line = re.sub(r"/[\w./-]+/", "…/", line)
    return line[:240]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compat.report")
    ap.add_argument("--results", default=str(HERE / "results"))
    ap.add_argument("--csv", default=str(HERE / "outcomes.csv"))
    args = ap.parse_args(argv)
    mon = _rows(Path(args.results) / "monarch.json")
    am = _rows(Path(args.results) / "actormesh.json")
    keys = sorted(set(mon) | set(am))
    with open(args.csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "file", "test", "monarch", "actormesh", "monarch_message", "actormesh_message", "actormesh_where"])
        for k in keys:
            m, a = mon.get(k, {}), am.get(k, {})
            kind = m.get("kind") or a.get("kind")
            w.writerow([kind, k[0], k[1], m.get("outcome", "absent"), a.get("outcome", "absent"), first_line(m.get("message", "")), first_line(a.get("message", "")), a.get("where", "")])
    _per_file(mon, am)
    _gaps(mon, am, keys)
    return 0


def _per_file(mon: dict, am: dict) -> None:
    by_file: dict[str, list[Counter]] = defaultdict(lambda: [Counter(), Counter()])
    for i, rows in enumerate((mon, am)):
        for (file, _), r in rows.items():
            by_file[file][i][r["outcome"]] += 1
    print("| file | Monarch 0.7.0 pass/fail/skip | actormesh pass/fail/skip |")
    print("|---|---|---|")
    tot = [Counter(), Counter()]
    for file in sorted(by_file):
        cells = []
        for i in (0, 1):
            c = by_file[file][i]
            tot[i].update(c)
            cells.append(_cell(c))
        print(f"| {file} | {cells[0]} | {cells[1]} |")
    print(f"| **total** | {_cell(tot[0])} | {_cell(tot[1])} |")


def _cell(c: Counter) -> str:
    fail = c["failed"] + c["error"] + c["hang"] + c["xpassed"]
    extra = f" ({c['hang']} hang)" if c["hang"] else ""
    return f"{c['passed'] + c['xfailed']}/{fail}/{c['skipped']}{extra}"


def _gaps(mon: dict, am: dict, keys: list) -> None:
    groups: dict[str, list[str]] = defaultdict(list)
    for k in keys:
        if mon.get(k, {}).get("outcome") == "passed" and am.get(k, {}).get("outcome") != "passed":
            a = am.get(k, {})
            groups[_norm(first_line(a.get("message", a.get("outcome", "absent"))))].append(f"{k[0]}::{k[1]} [{a.get('outcome', 'absent')}] {a.get('where', '')}")
    print(f"\n{sum(map(len, groups.values()))} tests pass on Monarch and not on actormesh, {len(groups)} distinct first lines\n")
    for line, tests in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print(f"## ({len(tests)}) {line}")
        for t in tests:
            print(f"- {t}")


if __name__ == "__main__":
    raise SystemExit(main())
