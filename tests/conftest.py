"""Shared fixtures: no test may leave a process behind, and no unhandled
supervision event may kill the test runner."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
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


def _every_thread_stopped(pid: int) -> bool:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that exited stops nothing
        if state not in ("T", "t"):
            return False
    return True


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped.

    ``kill`` only queues the signal: each thread stops when it next leaves the
    kernel, so a test that acts right after it can race a thread still running
    (a gateway relaying one more message)."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: _every_thread_stopped(pid), timeout, interval=0.001)


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


def _kept_zygote(p: psutil.Process, owners: set[int]) -> bool:
    """A zygote lives as long as the runtime of the process that started it (this one,
    or a host agent that outlives the test): tests/test_zygote.py checks that it goes
    with it. The workers it forks are leaks like any other."""
    return p.ppid() in owners and "actormesh.zygote" in p.cmdline()


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
                if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE and not _kept_zygote(p, before | {me.pid}):
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


class Bridged:
    """Network namespaces on a bridge of their own: this side is ``net.1``, namespace i is ``net.{11 + i}``."""

    def __init__(self, tag: str, net: str, count: int) -> None:
        self.tag = tag
        self.net = net
        self.bridge = f"{tag}br"
        self.namespaces = [f"{tag}n{i}" for i in range(count)]
        #: the bridge-side end of each namespace's link (set it down to cut that host off)
        self.ports = [f"{tag}h{i}" for i in range(count)]

    def address(self, i: int | None = None) -> str:
        """The IP of namespace ``i`` (None: this side's, on the bridge)."""
        return f"{self.net}.1" if i is None else f"{self.net}.{11 + i}"


@contextlib.contextmanager
def bridged_namespaces(count: int, prefix: str) -> Iterator[Bridged]:
    """``count`` network namespaces on a bridge, removed afterwards; skips the test
    where namespaces cannot be made. Names and the /24 are per process, so a second
    test run beside this one gets its own."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 to create network namespaces")
    b = Bridged(f"{prefix}{os.getpid() % 100000}", f"198.18.{20 + os.getpid() % 200}", count)

    def ip(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)

    try:
        if ip("link", "add", b.bridge, "type", "bridge").returncode != 0:
            pytest.skip("cannot create a bridge here")
        ip("addr", "add", f"{b.address()}/24", "dev", b.bridge)
        ip("link", "set", b.bridge, "up")
        for i, (ns, host_end) in enumerate(zip(b.namespaces, b.ports)):
            if ip("netns", "add", ns).returncode != 0:
                pytest.skip("cannot create network namespaces here")
            ns_end = f"{b.tag}v{i}"
            for args in (
                ("link", "add", host_end, "type", "veth", "peer", "name", ns_end),
                ("link", "set", ns_end, "netns", ns),
                ("link", "set", host_end, "master", b.bridge),
                ("link", "set", host_end, "up"),
                ("netns", "exec", ns, "ip", "addr", "add", f"{b.address(i)}/24", "dev", ns_end),
                ("netns", "exec", ns, "ip", "link", "set", ns_end, "up"),
                ("netns", "exec", ns, "ip", "link", "set", "lo", "up"),
            ):
                r = ip(*args)
                assert r.returncode == 0, (args, r.stderr)
        yield b
    finally:
        for ns in b.namespaces:
            ip("netns", "del", ns)
        for port in b.ports:
            ip("link", "del", port)
        ip("link", "del", b.bridge)


def run_controller(tmp_path: Any, script: str, args: list[str], timeout: float) -> dict[str, Any]:
    """Run a controller script (``python script *args``) in a session of its own, killed if it outlives
    ``timeout``; its ``RESULT {json with "phase"}`` lines as ``phase -> figures``. Fails the test if it failed."""
    path = tmp_path / "controller.py"
    path.write_text(script)
    proc = subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=10)
    phases = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            phases[r.pop("phase")] = r
    assert proc.returncode == 0, f"controller failed ({proc.returncode}):\n{err[-4000:]}"
    print(json.dumps(phases, indent=1))  # the figures, shown with -s or on failure
    return phases
