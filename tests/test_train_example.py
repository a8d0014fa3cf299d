"""examples/train.py end to end, as a user runs it: a real controller process and its 4 procs.

Each test starts the demo in its own session (as a shell starts a foreground
job), so "Ctrl-C" is SIGINT to its whole process group, procs included, as a
terminal sends it. Waits are on the demo's own output lines, never on sleeps.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRESS_LINE = re.compile(r"^step +\d+/\d+ +loss [\d.]+ +[\d,]+ tok/s$")


class Demo:
    """``python examples/train.py ARGS``, its merged stdout/stderr read line by line on a thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "examples/train.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_line(self, pattern: re.Pattern[str], timeout_s: float) -> str:
        """The next output line matching ``pattern`` (AssertionError on EOF or timeout, with the output so far)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern.pattern!r} within {timeout_s}s:\n{self.output}") from None
            if line is None:
                raise AssertionError(f"the demo ended without a line matching {pattern.pattern!r}:\n{self.output}")
            self.lines.append(line)
            if pattern.search(line):
                return line

    def finish(self, timeout_s: float) -> int:
        """Wait for the exit and the rest of the output; the exit code."""
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def procs(self) -> list[psutil.Process]:
        """The demo's descendants (its actormesh procs)."""
        return psutil.Process(self.proc.pid).children(recursive=True)

    def kill(self) -> None:
        """Never leak: SIGKILL the demo's process group (its procs are in it too)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def demo() -> Iterator[Callable[..., Demo]]:
    started: list[Demo] = []

    def start(*args: str) -> Demo:
        d = Demo(*args)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()


def all_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The processes still alive (not zombies) after waiting up to ``timeout_s``."""
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    left = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.mark.timeout(60)
def test_short_run_prints_the_plan_and_the_loss_falls(demo: Callable[..., Demo]) -> None:
    d = demo("--steps", "12", "--log-every", "4")
    code = d.finish(timeout_s=55)
    out = d.output
    assert code == 0, out
    assert re.search(r"^Chose \w+ \(dp=\d, fsdp=\d, tp=\d, pp=\d", out, re.M), out
    assert "auto_plan: 4 ranks, batch 16" in out and "<- chosen" in out, out
    assert [int(m) for m in re.findall(r"^step +(\d+)/12 ", out, re.M)] == [1, 4, 8, 12], out
    done = re.search(r"^done: 12 steps, loss ([\d.]+) -> ([\d.]+), ([\d,]+) tokens/s; wall time [\d.]+s", out, re.M)
    assert done, out
    first, last = float(done[1]), float(done[2])
    assert last < first - 1.0, out  # the successor rule is learnt: from ~4.4 to under 2


@pytest.mark.timeout(60)
def test_ctrl_c_stops_training_and_every_proc(demo: Callable[..., Demo]) -> None:
    d = demo("--steps", "100000", "--log-every", "20")
    d.wait_line(PROGRESS_LINE, timeout_s=50)
    procs = d.procs()
    assert len(procs) >= 4, [p.cmdline() for p in procs]
    os.killpg(d.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the procs get it too
    code = d.finish(timeout_s=30)
    assert code == 130, d.output
    assert re.search(r"^interrupted at step \d+", d.output, re.M), d.output
    assert "Traceback" not in d.output and "failed" not in d.output, d.output
    assert not all_gone(procs, timeout_s=10)


@pytest.mark.timeout(60)
def test_a_killed_rank_is_a_failure_not_an_interrupt(demo: Callable[..., Demo]) -> None:
    d = demo("--steps", "100000", "--log-every", "20")
    d.wait_line(PROGRESS_LINE, timeout_s=50)
    procs = d.procs()
    victim = next(p for p in procs if "actormesh.worker" in p.cmdline())
    victim.kill()
    code = d.finish(timeout_s=30)
    assert code == 1, d.output
    assert re.search(r"^training failed at step \d+: rank \d failed: .*Killed\(sig=9\)", d.output, re.M), d.output
    assert "interrupted" not in d.output, d.output
    assert not all_gone(procs, timeout_s=10)
