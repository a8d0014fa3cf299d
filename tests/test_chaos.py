"""Chaos: numbered calls in flight across procs while one proc is killed.

Every future must resolve exactly once (a value or an error), no call may run
twice, and every call that succeeded must have run exactly once (at-most-once
delivery with failure notification, like Monarch and Ray).
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections import Counter

from actormesh.actor import Actor, SupervisionError, endpoint


class Worker(Actor):
    """Logs each call number to a per-proc file before replying."""

    def __init__(self, log_dir: str) -> None:
        self.log = open(os.path.join(log_dir, f"calls-{os.getpid()}.log"), "a", buffering=1)

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def work(self, n: int) -> int:
        self.log.write(f"{n}\n")  # line-buffered: reaches the file before the reply leaves
        return n


def test_chaos_kill_one_proc_while_10000_calls_in_flight(spawn_procs, tmp_path, faults):
    procs = spawn_procs(per_host={"gpus": 4})
    workers = procs.spawn("workers", Worker, str(tmp_path))
    pids = workers.pid.call().get(timeout=30).values()
    rng = random.Random(1234)  # the kill moment is random but reproducible
    total = 10_000
    kill_at = rng.randrange(total // 5, total // 2)
    victim = rng.randrange(4)

    futures = []
    resolutions = Counter()
    lock = threading.Lock()

    def count(i: int):
        def cb(_):
            with lock:
                resolutions[i] += 1

        return cb

    for n in range(total):
        if n == kill_at:
            os.kill(pids[victim], signal.SIGKILL)
        member = workers.slice(gpus=n % 4)
        fut = member.work.call_one(n)
        fut._add_done_callback(count(n))
        futures.append(fut)

    ok, failed = [], []
    for n, fut in enumerate(futures):
        try:
            assert fut.get(timeout=30) == n
            ok.append(n)
        except SupervisionError:
            failed.append(n)

    executed = Counter()
    for name in os.listdir(tmp_path):
        with open(tmp_path / name) as f:
            executed.update(int(line) for line in f if line.strip())

    duplicated = [n for n, c in executed.items() if c > 1]
    assert duplicated == []
    assert all(resolutions[n] == 1 for n in range(total)), "a future resolved twice or never"
    assert len(ok) + len(failed) == total
    assert all(executed[n] == 1 for n in ok), "a successful call has no execution record"
    # Only calls to the killed proc may fail; all others succeed.
    assert all(n % 4 == victim for n in failed)
    assert failed, "the kill should have failed some calls in flight"
    assert faults.wait(1)[0].crashed_ranks == [victim]
    print(f"issued={total} succeeded={len(ok)} failed={len(failed)} duplicated={len(duplicated)}")
