"""Monarch 0.7.0's side of the dispatch figure, run by ``bench.tensor_bench --monarch``
under the Monarch venv's interpreter: ``python -m bench._tensor_monarch N REPS``.

The same loop as ours (``t = t + 1`` on a 4x4 tensor inside ``mesh.activate()``
on 4 procs, until ``monarch.inspect(t)`` returns), after 200 warm-up ops,
with Monarch's spawn deadlines raised to 300 s (the defaults time out under load).
Prints one ``RESULT {json}`` line: the best ops/s and every rep's. Imports no
actormesh.
"""

from __future__ import annotations

import json
import sys
import time


def main(n: int, reps: int) -> None:
    import torch

    import monarch
    from monarch.actor import this_host
    from monarch.config import configure

    # Monarch's default 30 s spawn deadlines fail on this shared 2-core box under load;
    # longer ones change nothing once the mesh is up
    configure(actor_spawn_max_idle="300s", mesh_proc_spawn_max_idle="300s", host_spawn_ready_timeout="300s")
    mesh = this_host().spawn_procs({"gpu": 4})
    try:
        with mesh.activate():
            t = torch.zeros(4, 4)
            for _ in range(200):
                t = t + 1
        expect = float(monarch.inspect(t)[0, 0])
        rates = []
        for _ in range(reps):
            t0 = time.perf_counter()
            with mesh.activate():
                for _ in range(n):
                    t = t + 1
            value = float(monarch.inspect(t)[0, 0])
            rates.append(n / (time.perf_counter() - t0))
            expect += n
            if value != expect:
                raise AssertionError(f"Monarch computed {value}, expected {expect}")
        print("RESULT " + json.dumps({"n": n, "ops_s": max(rates), "reps_ops_s": rates}), flush=True)
    finally:
        mesh.stop().get()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
