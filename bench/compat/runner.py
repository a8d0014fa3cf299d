"""Runs Monarch's test files and examples under one implementation, file by file.

Each test file is one pytest process in its own session (process group), with
pytest-timeout per test and a wall-clock limit per file; the ``compat_record``
plugin streams outcomes to a JSON-lines file so a killed run keeps what it reached.
For ``actormesh`` the alias directory goes first on ``PYTHONPATH`` (its
``sitecustomize`` maps ``monarch.*`` to ``actormesh.*`` in every child process too).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ALIAS_DIR = HERE / "alias"
PLUGIN_DIR = HERE / "plugins"

# Monarch's own pytest settings (its pyproject.toml), minus its 300 s default timeout.
_INI = """[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
markers =
    oss_skip: marks tests to skip in OSS CI
timeout = {timeout}
"""


@dataclass
class Impl:
    """An implementation under test: its interpreter and extra ``PYTHONPATH`` entries."""

    name: str  # "actormesh" or "monarch"
    python: str
    pythonpath: list[str] = field(default_factory=list)

    def env(self, record: Path) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(PLUGIN_DIR)]
        if self.name == "actormesh":
            paths.insert(0, str(ALIAS_DIR))
        paths += self.pythonpath
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["COMPAT_RECORD"] = str(record)
        env["COMPAT_IMPL"] = self.name
        env.pop("PYTEST_ADDOPTS", None)
        return env


def check_impl(impl: Impl) -> str | None:
    """None when the interpreter can run the harness, else what to install."""
    code = "import pytest, pytest_timeout, pytest_asyncio; import monarch.actor"
    env = impl.env(Path(os.devnull))
    try:
        proc = subprocess.run([impl.python, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{impl.python}: {exc}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"{impl.python} cannot run the harness ({last}); see bench/compat/README.md"
    return None


def _run_group(cmd: list[str], env: dict[str, str], cwd: str, limit_s: float, log: Path) -> tuple[int | None, float]:
    """Run ``cmd`` in its own session; kill what it started at ``limit_s``. Returns (rc or None, seconds).

    Monarch's ``isolate_in_subprocess`` starts its children in new sessions, so the
    process group does not reach them; every process started here carries a unique
    ``COMPAT_RUN_ID`` in its environment, and whatever still carries it at the end is killed.
    """
    run_id = uuid.uuid4().hex
    env = dict(env, COMPAT_RUN_ID=run_id)
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            rc = None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = _marked(run_id)
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            if not pids:
                break
            if sig == signal.SIGTERM:
                _wait_gone(run_id, 2.0)
        proc.wait()
    return rc, time.monotonic() - start


def _marked(run_id: str) -> list[int]:
    """Pids of live processes whose environment holds ``COMPAT_RUN_ID=run_id``."""
    marker = f"COMPAT_RUN_ID={run_id}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:  # gone, or not ours
            pass
    return pids


def _wait_gone(run_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _marked(run_id) and time.monotonic() < deadline:
        time.sleep(0.1)


def _read_record(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


_RANK = {"passed": 0, "xfailed": 0, "skipped": 1, "xpassed": 2, "failed": 3, "error": 3}


def _outcomes(rows: list[dict], file_name: str, killed: bool) -> list[dict]:
    """One row per test: the worst of its phase outcomes; the running test at a kill is ``hang``."""
    tests: dict[str, dict] = {}
    started: list[str] = []
    for row in rows:
        if row["event"] == "started":
            started.append(row["nodeid"])
        elif row["event"] == "collect_error":
            tests[row["nodeid"] or file_name] = {"outcome": "error", "message": "collection: " + row["message"], "where": "", "duration": 0.0}
        elif row["event"] == "outcome":
            prev = tests.get(row["nodeid"])
            if prev is None or _RANK[row["outcome"]] > _RANK[prev["outcome"]]:
                tests[row["nodeid"]] = {k: row[k] for k in ("outcome", "message", "where", "duration")}
                if row.get("when") in ("setup", "teardown") and row["outcome"] == "error":
                    tests[row["nodeid"]]["message"] = f"{row['when']}: " + row["message"]
    if killed and started and started[-1] not in tests:
        tests[started[-1]] = {"outcome": "hang", "message": "file wall-clock limit reached while this test ran", "where": "", "duration": 0.0}
    out = []
    for nodeid, res in tests.items():
        test = nodeid.split("::", 1)[1] if "::" in nodeid else nodeid
        out.append({"kind": "test", "file": file_name, "test": test, **res})
    return out


def run_test_file(impl: Impl, tests_dir: Path, name: str, keyword: str | None, timeout_s: int, file_limit_s: int, work: Path) -> dict:
    """Run one Monarch test file under ``impl``; returns its summary and per-test rows."""
    record = work / f"{impl.name}-{name}.jsonl"
    record.unlink(missing_ok=True)
    ini = work / "pytest.ini"
    ini.write_text(_INI.format(timeout=timeout_s))
    cmd = [impl.python, "-m", "pytest", "-c", str(ini), "--rootdir", str(tests_dir), "-p", "compat_record", "-p", "no:cacheprovider", "-q", "-rA", "--timeout", str(timeout_s)]
    if impl.name == "actormesh":
        cmd += ["-p", "monarch_alias"]
    if keyword:
        cmd += ["-k", keyword]
    cmd.append(str(tests_dir / name))
    log = work / f"{impl.name}-{name}.log"
    rc, secs = _run_group(cmd, impl.env(record), str(work), file_limit_s, log)
    rows = _outcomes(_read_record(record), name, killed=rc is None)
    if not rows and rc not in (0, 5):
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        rows = [{"kind": "test", "file": name, "test": name, "outcome": "error", "message": f"pytest rc={rc}: {tail[0]}", "where": "", "duration": 0.0}]
    return {"file": name, "rc": rc, "seconds": round(secs, 1), "log": str(log), "rows": rows}


def run_example(impl: Impl, examples_dir: Path, name: str, limit_s: int, work: Path) -> dict:
    """Run one docs example as a script under ``impl``; pass means exit status 0 within ``limit_s``."""
    log = work / f"{impl.name}-example-{name}.log"
    rc, secs = _run_group([impl.python, str(examples_dir / name)], impl.env(Path(os.devnull)), str(work), limit_s, log)
    text = log.read_text(errors="replace").strip().splitlines()
    if rc == 0:
        outcome, msg = "passed", ""
    elif rc is None:
        outcome, msg = "hang", f"no exit within {limit_s} s"
    else:
        outcome, msg = "failed", (text[-1] if text else f"exit {rc}")
    row = {"kind": "example", "file": name, "test": name, "outcome": outcome, "message": msg[:2000], "where": "", "duration": round(secs, 1)}
    return {"file": name, "rc": rc, "seconds": round(secs, 1), "log": str(log), "rows": [row]}


def make_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="compat-"))


def prepare_tests_dir(tests_dir: Path, work: Path, rewrites: dict[str, tuple[tuple[str, str], ...]]) -> Path:
    """A copy of ``tests_dir`` with the ``rewrites`` applied to their files.

    A copy, not symlinks: the tests' subprocesses re-import test modules by name
    from ``sys.path``, and a symlinked file would resolve to the unrewritten one.
    Each (old, new) pair must match exactly one line of its file, so a changed wheel
    fails loudly instead of silently running the private import.
    """
    shadow = work / "tests"
    shutil.copytree(tests_dir, shadow, ignore=shutil.ignore_patterns("__pycache__"))
    for name, pairs in rewrites.items():
        path = shadow / name
        lines = path.read_text().splitlines(keepends=True)
        for old, new in pairs:
            hits = [i for i, ln in enumerate(lines) if ln.rstrip("\n") == old]
            if len(hits) != 1:
                raise SystemExit(f"{tests_dir / name}: expected one line {old!r}, found {len(hits)}; update bench/compat/selection.py REWRITES")
            lines[hits[0]] = new + "  # bench.compat rewrite of: " + old + "\n"
        path.write_text("".join(lines))
    return shadow


def eprint(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)
