"""pytest plugin: appends one JSON line per test outcome to ``$COMPAT_RECORD``.

Each line is written and flushed as soon as pytest knows the outcome, so a run that
is killed at the file deadline still leaves the outcomes it reached, plus a
``started`` line naming the test that was running when it was killed.
"""

from __future__ import annotations

import json
import os
import time

import pytest

_PATH = os.environ.get("COMPAT_RECORD")


def _write(row: dict) -> None:
    if _PATH is None:
        return
    with open(_PATH, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def _message(report: pytest.TestReport) -> str:
    """The one line that says why: the crash message, or the skip reason."""
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # skip: (path, line, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return str(crash.message)
    text = str(longrepr)
    lines = [ln for ln in text.splitlines() if ln.startswith("E ")]
    return (lines[-1] if lines else text.strip().splitlines()[-1] if text.strip() else "")[:2000]


def _location(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is None:
        return ""
    return f"{os.path.basename(str(crash.path))}:{crash.lineno}"


def pytest_runtest_logstart(nodeid: str, location) -> None:  # noqa: ANN001
    _write({"event": "started", "nodeid": nodeid, "t": time.time()})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    failed_setup_or_teardown = report.when != "call" and report.outcome == "failed"
    if report.when == "call" or report.outcome == "skipped" or failed_setup_or_teardown:
        outcome = report.outcome
        if failed_setup_or_teardown:
            outcome = "error"
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.outcome == "skipped" else "xpassed"
        _write(
            {
                "event": "outcome",
                "nodeid": report.nodeid,
                "when": report.when,
                "outcome": outcome,
                "duration": round(report.duration, 3),
                "message": _message(report),
                "where": _location(report),
            }
        )


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _write(
            {
                "event": "collect_error",
                "nodeid": report.nodeid,
                "outcome": "error",
                "message": _collect_message(report),
            }
        )


def _collect_message(report: pytest.CollectReport) -> str:
    text = str(report.longrepr)
    lines = [ln[2:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    return (lines[-1] if lines else text.strip().splitlines()[-1])[:2000]
