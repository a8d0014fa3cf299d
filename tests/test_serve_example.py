"""examples/serve.py end to end, as a user runs it: 2 replicas of TP=2 on 4 procs,
the openai client under load, one replica SIGKILLed and rebuilt."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_serve_example_survives_a_killed_replica() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-u", "examples/serve.py"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=540)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == 0, out[-4000:]
    assert "2 replicas x TP=2 up" in out and "models: ['tiny']" in out
    assert re.search(r"SIGKILL replica 0's rank 0 \(pid \d+\)", out), out[-4000:]
    ok = re.search(r"^\s+(\d+)\s+ok$", out, re.M)
    assert ok and int(ok.group(1)) > 0, out[-4000:]
    failed = sum(int(n) for n in re.findall(r"^\s+(\d+)\s+failed \((?:503|mid-stream)", out, re.M))
    assert int(ok.group(1)) + failed == 6 * 12, out[-4000:]  # every request ended: served, or failed as may-have-run
    assert re.search(r"replica 0: healthy, restarts=1", out), out[-4000:]
    assert re.search(r"replica 1: healthy, restarts=0", out), out[-4000:]
    assert "stopped: every proc is gone" in out
