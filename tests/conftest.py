"""Shared fixtures: no test may leave a process behind, and no unhandled
supervision event may kill the test runner."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01) -> Any:
    """Poll ``predicate`` until truthy or ``timeout`` (then AssertionError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


class FaultRecorder:
    """Stands in for ``unhandled_fault_hook``: records failures, wakes waiters."""

    def __init__(self) -> None:
        self.failures: list[Any] = []
        self._cond = threading.Condition()

    def __call__(self, failure: Any) -> None:
        with self._cond:
            self.failures.append(failure)
            self._cond.notify_all()

    def wait(self, count: int = 1, timeout: float = 10.0) -> list[Any]:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.failures) >= count, timeout):
                raise AssertionError(f"expected {count} unhandled failure(s), got {self.failures}")
            return list(self.failures)


@pytest.fixture(autouse=True)
def faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultRecorder]:
    """Unhandled supervision events are recorded instead of ending pytest."""
    import actormesh.actor as am

    recorder = FaultRecorder()
    monkeypatch.setattr(am, "unhandled_fault_hook", recorder)
    yield recorder


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    """Fail a test that leaves a child process running (and kill the leftovers)."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield

    def leftovers() -> list[psutil.Process]:
        alive = []
        for p in me.children(recursive=True):
            try:
                if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    deadline = time.monotonic() + 10
    left = leftovers()
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = leftovers()
    if left:
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        pytest.fail(f"test left {len(left)} process(es) running: {[p.cmdline() for p in left]}")


@pytest.fixture
def spawn_procs() -> Iterator[Callable[..., Any]]:
    """``spawn_procs(per_host={...}, **kw)``: proc meshes stopped after the test, pass or fail."""
    from actormesh.actor import this_host

    made: list[Any] = []

    def make(per_host: dict[str, int] | None = None, **kw: Any) -> Any:
        pm = this_host().spawn_procs(per_host=per_host, **kw)
        made.append(pm)
        return pm

    yield make
    for pm in made:
        try:
            pm.stop().get(timeout=15)
        except Exception:
            pass


def module_procs(per_host: dict[str, int], timeout: float = 60) -> Iterator[Any]:
    """Body of a module-scoped proc-mesh fixture: ``yield from module_procs({"gpus": 2})``.

    The procs are up before the first test's leak check lists child processes,
    and stopped after the module, pass or fail.
    """
    from actormesh.actor import this_host

    pm = this_host().spawn_procs(per_host=per_host)
    try:
        pm.initialized.get(timeout=timeout)
        yield pm
    finally:
        pm.stop().get(timeout=30)
