"""``python -m bench.compat``: run Monarch 0.7.0's public-API tests under actormesh or Monarch.

Writes ``bench/compat/results/<impl>.json`` (git-ignored working copy; the committed
table is ``bench/compat/outcomes.csv``, made by ``python -m bench.compat.report``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

from bench.compat import runner, selection

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TESTS = os.environ.get("COMPAT_MONARCH_TESTS", "/work/monarch-wheel/unz/tests")
DEFAULT_EXAMPLES = os.environ.get("COMPAT_MONARCH_EXAMPLES", "/work/monarch-wheel/docs-examples")
DEFAULT_PY = {
    "actormesh": os.environ.get("COMPAT_ACTORMESH_PYTHON", sys.executable),
    "monarch": os.environ.get("COMPAT_MONARCH_PYTHON", "/work/monarch-venv/bin/python"),
}


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.compat", description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=("actormesh", "monarch"), required=True)
    ap.add_argument("--python", help="interpreter to run pytest with (default: this interpreter for actormesh, /work/monarch-venv for monarch)")
    ap.add_argument("--src", default=str(REPO / "src"), help="actormesh source put on PYTHONPATH (actormesh only; default: this checkout's src/)")
    ap.add_argument("--extra-path", default=os.environ.get("COMPAT_EXTRA_PATH", ""), help="more PYTHONPATH entries (os.pathsep-separated), e.g. a --target dir with pytest-asyncio")
    ap.add_argument("--tests", default=DEFAULT_TESTS, help="the wheel's tests/ directory")
    ap.add_argument("--examples", default=DEFAULT_EXAMPLES, help="directory with Monarch's docs examples (empty string: skip)")
    ap.add_argument("--files", nargs="*", help="only these test files / examples (names as in selection.py)")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression")
    ap.add_argument("--timeout", type=int, default=60, help="per-test limit, seconds (pytest-timeout)")
    ap.add_argument("--file-limit", type=int, default=900, help="wall-clock limit per test file, seconds")
    ap.add_argument("--example-limit", type=int, default=180, help="wall-clock limit per example, seconds")
    ap.add_argument("--out", help="results JSON (default: bench/compat/results/<impl>.json)")
    ap.add_argument("--merge", action="store_true", help="update only the files run in an existing results JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    extra = [p for p in args.extra_path.split(os.pathsep) if p]
    impl = runner.Impl(args.impl, args.python or DEFAULT_PY[args.impl], ([args.src] if args.impl == "actormesh" else []) + extra)
    problem = runner.check_impl(impl)
    if problem:
        runner.eprint(problem)
        return 2
    tests_dir = Path(args.tests)
    if not (tests_dir / "conftest.py").exists():
        runner.eprint(f"--tests {tests_dir}: not Monarch's tests/ directory (no conftest.py); see bench/compat/README.md")
        return 2
    wanted = set(args.files or [])
    unknown = wanted - set(selection.TEST_FILES) - set(selection.EXAMPLE_FILES)
    if unknown:
        runner.eprint(f"--files: not in bench/compat/selection.py: {sorted(unknown)}")
        return 2
    work = runner.make_workdir()
    tests_dir = runner.prepare_tests_dir(tests_dir, work, selection.REWRITES)
    out = Path(args.out) if args.out else REPO / "bench/compat/results" / f"{args.impl}.json"
    files = _load(out) if args.merge else {}
    for name in selection.TEST_FILES:
        if wanted and name not in wanted:
            continue
        res = runner.run_test_file(impl, tests_dir, name, args.keyword, args.timeout, args.file_limit, work)
        files[name] = res
        _say(res)
    if args.examples:
        for name in selection.EXAMPLE_FILES:
            if wanted and name not in wanted:
                continue
            res = runner.run_example(impl, Path(args.examples), name, args.example_limit, work)
            files[name] = res
            _say(res)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"impl": args.impl, "python": impl.python, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "files": files}
    out.write_text(json.dumps(doc, indent=1))
    runner.eprint(f"wrote {out} (logs in {work})")
    return 0


def _load(path: Path) -> dict:
    return json.loads(path.read_text())["files"] if path.exists() else {}


def _say(res: dict) -> None:
    counts: dict[str, int] = {}
    for row in res["rows"]:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no tests"
    runner.eprint(f"{res['file']}: {summary} ({res['seconds']} s, rc={res['rc']})")
