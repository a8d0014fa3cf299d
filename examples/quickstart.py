"""actormesh in one page: a local mesh of procs, actors, a broadcast, a failure handled.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import os

from actormesh.actor import Actor, ActorError, Accumulator, SupervisionError, current_rank, endpoint, this_host


class Counter(Actor):
    """Counts; one instance per proc."""

    def __init__(self, start: int) -> None:
        self.value = start

    @endpoint
    def incr(self, by: int = 1) -> None:
        self.value += by

    @endpoint
    def get(self) -> int:
        return self.value

    @endpoint
    def where(self) -> str:
        return f"rank {dict(current_rank())} in pid {os.getpid()}"

    @endpoint
    def divide(self, by: int) -> float:
        return self.value / by

    @endpoint
    def crash(self) -> None:
        os._exit(3)


def main() -> None:
    procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2})
    counters = procs.spawn("counters", Counter, 10)

    for who in counters.where.call().get(timeout=30).values():
        print("hello from", who)

    counters.incr.broadcast(5)  # fire and forget, delivered in order before the next call
    print("after broadcast:", counters.get.call().get(timeout=10).values())

    total = Accumulator(counters.get, 0, lambda acc, v: acc + v).accumulate().get(timeout=10)
    print("sum over the mesh:", total)

    try:
        counters.slice(hosts=0, gpus=0).divide.call_one(0).get(timeout=10)
    except ZeroDivisionError as err:  # a remote ZeroDivisionError is still one
        assert isinstance(err, ActorError)
        print("remote error caught:", type(err.exception).__name__, "- the actor lives on:", counters.slice(hosts=0, gpus=0).get.call_one().get(timeout=10))

    import threading

    import actormesh.actor as am

    reported = threading.Event()

    def on_failure(failure: am.MeshFailure) -> None:  # the owner (us) hears of the crash
        print("supervision:", failure.report().splitlines()[-1].strip())
        reported.set()

    am.unhandled_fault_hook = on_failure
    victim = counters.slice(hosts=1, gpus=1)
    try:
        victim.crash.call_one().get(timeout=10)
    except SupervisionError as err:
        reported.wait(10)
        print("caller saw:", str(err).splitlines()[-1].strip())
    print("the rest still works:", counters.slice(hosts=0).get.call().get(timeout=10).values())

    procs.stop().get(timeout=30)
    print("done")


if __name__ == "__main__":
    main()
