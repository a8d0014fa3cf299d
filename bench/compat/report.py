"""``python -m bench.compat.report``: merge results JSONs into the committed tables.

Reads ``bench/compat/results/monarch.json`` and one or more actormesh results
(``--am LABEL=PATH``, default ``actormesh=results/actormesh.json``); writes
``bench/compat/outcomes.csv`` (one row per test: the outcome on each run and the
first line of each failure message) and prints the per-file table used in
RESULTS.md plus, for the first actormesh run, the gaps (passes on Monarch, not on
actormesh) grouped by their first error line: the raw material of GAPS.md.

A file that fails to import on actormesh yields one collection error; here it
counts as an error of every test Monarch collected in that file.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
Rows = dict[tuple[str, str], dict]


def _rows(path: Path) -> Rows:
    doc = json.loads(path.read_text())
    return {(r["file"], r["test"]): r for f in doc["files"].values() for r in f["rows"]}


def _expand_collection_errors(am: Rows, mon: Rows) -> Rows:
    out = {k: v for k, v in am.items() if not (k[0] == k[1] and v["outcome"] == "error" and v["kind"] == "test")}
    for (file, test), r in am.items():
        if file == test and r["outcome"] == "error" and r["kind"] == "test":
            for mk in [mk for mk in mon if mk[0] == file]:
                out[mk] = {**r, "test": mk[1]}
    return out


def first_line(message: str) -> str:
    return (message.strip().splitlines() or [""])[0].strip()


def _norm(line: str) -> str:
    """Group key: the error line with addresses and absolute paths blurred."""
    line = re.sub(r"0x[0-9a-f]+", "0x…", line)
    line = re.sub(r"\(/[^)]*\)", "(…)", line)
    return line[:240]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compat.report")
    ap.add_argument("--monarch", default=str(HERE / "results/monarch.json"))
    ap.add_argument("--am", action="append", help="LABEL=PATH of an actormesh results JSON (repeatable)")
    ap.add_argument("--csv", default=str(HERE / "outcomes.csv"))
    args = ap.parse_args(argv)
    mon = _rows(Path(args.monarch))
    runs = [(lbl, _expand_collection_errors(_rows(Path(p)), mon)) for lbl, p in (a.split("=", 1) for a in (args.am or [f"actormesh={HERE / 'results/actormesh.json'}"]))]
    keys = sorted(set(mon).union(*(set(r) for _, r in runs)))
    with open(args.csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "file", "test", "monarch"] + [lbl for lbl, _ in runs] + ["monarch_message"] + [f"{lbl}_message" for lbl, _ in runs])
        for k in keys:
            m = mon.get(k, {})
            kind = m.get("kind") or next((r[k]["kind"] for _, r in runs if k in r), "")
            outs = [r.get(k, {}).get("outcome", "absent") for _, r in runs]
            msgs = [first_line(r.get(k, {}).get("message", "")) for _, r in runs]
            w.writerow([kind, k[0], k[1], m.get("outcome", "absent")] + outs + [first_line(m.get("message", ""))] + msgs)
    _per_file(mon, runs)
    for lbl, r in runs:
        _gaps(lbl, mon, r, keys)
    return 0


def _per_file(mon: Rows, runs: list[tuple[str, Rows]]) -> None:
    tables = [mon] + [r for _, r in runs]
    by_file: dict[str, list[Counter]] = defaultdict(lambda: [Counter() for _ in tables])
    for i, rows in enumerate(tables):
        for (file, _), r in rows.items():
            by_file[file][i][r["outcome"]] += 1
    print("| file | Monarch 0.7.0 | " + " | ".join(lbl for lbl, _ in runs) + " |")
    print("|---|---" + "|---" * len(runs) + "|")
    tot = [Counter() for _ in tables]
    for file in sorted(by_file, key=lambda f: (f.endswith(".py") and not f.startswith("test_"), f)):
        cells = []
        for i in range(len(tables)):
            tot[i].update(by_file[file][i])
            cells.append(_cell(by_file[file][i]))
        print(f"| {file} | " + " | ".join(cells) + " |")
    print("| **total** | " + " | ".join(_cell(c) for c in tot) + " |")


def _cell(c: Counter) -> str:
    """pass/fail/skip; fail includes errors and hangs."""
    fail = c["failed"] + c["error"] + c["hang"] + c["xpassed"]
    extra = f" ({c['hang']} hang)" if c["hang"] else ""
    return f"{c['passed'] + c['xfailed']}/{fail}/{c['skipped']}{extra}"


def _gaps(label: str, mon: Rows, am: Rows, keys: list) -> None:
    groups: dict[str, list[str]] = defaultdict(list)
    for k in keys:
        if mon.get(k, {}).get("outcome") == "passed" and am.get(k, {}).get("outcome") != "passed":
            a = am.get(k, {})
            groups[_norm(first_line(a.get("message", "")) or a.get("outcome", "absent"))].append(f"{k[0]}::{k[1]} [{a.get('outcome', 'absent')}] {a.get('where', '')}")
    print(f"\n# {label}: {sum(map(len, groups.values()))} tests pass on Monarch and not on actormesh, {len(groups)} distinct first lines\n")
    for line, tests in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print(f"## ({len(tests)}) {line}")
        for t in tests:
            print(f"- {t}")


if __name__ == "__main__":
    raise SystemExit(main())
