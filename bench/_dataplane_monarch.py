"""Monarch 0.7.0's side of the cross-host data-plane figures, run by
``bench.dataplane_monarch`` under the Monarch venv's interpreter.

``python -m bench._dataplane_monarch worker ADDRESS`` serves a Monarch host in
the namespace; ``python -m bench._dataplane_monarch client ADDRESS NS THERE
[--quick]`` attaches to it from the other end of the veth pair and measures
what ``bench.dataplane_bench`` measures for actormesh (64 MiB echo of a tensor
and of ``bytes`` against a plain-socket echo in the same run; noop p50/p99 idle
and during a stream of large transfers on the same link). Prints one
``RESULT {json}`` line. Imports no actormesh: the plain-socket baseline and the
timing helpers come from ``bench.dataplane_bench``, which needs only the
standard library at import.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from monarch.actor import Actor, endpoint

MiB = 1 << 20


class DataPlane(Actor):
    """The remote end: the same endpoints as actormesh's bench actor."""

    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def echo(self, value: Any) -> Any:
        return value

    @endpoint
    def length(self, value: Any) -> int:
        return len(value)


def _worker(address: str) -> None:
    from monarch.actor import run_worker_loop_forever

    run_worker_loop_forever(address=address, ca="trust_all_connections")


def _echo(actor: Any, plain: Any, quick: bool) -> dict[str, Any]:
    import torch

    from bench.dataplane_bench import _median_rate, _timed

    nbytes = 64 * MiB
    tensor = torch.ones(nbytes // 4, dtype=torch.float32)
    data = bytes(nbytes)
    raw = memoryview(tensor.numpy()).cast("B")
    for value in (tensor, data):
        back = actor.echo.call_one(value).get(timeout=300)
        assert len(back) == len(value)
    plain.echo(raw)
    times: dict[str, list[float]] = {"tensor": [], "bytes": [], "socket": []}
    for _ in range(3 if quick else 8):
        times["socket"].append(_timed(lambda: plain.echo(raw)))
        times["tensor"].append(_timed(lambda: actor.echo.call_one(tensor).get(timeout=300)))
        times["bytes"].append(_timed(lambda: actor.echo.call_one(data).get(timeout=300)))
    rates = {k: _median_rate(2 * nbytes, v) for k, v in times.items()}
    return {"echo_64MiB_tensor_GBs": rates["tensor"], "echo_64MiB_bytes_GBs": rates["bytes"], "socket_echo_64MiB_GBs": rates["socket"],
            "echo_tensor_vs_socket": rates["tensor"] / rates["socket"], "echo_bytes_vs_socket": rates["bytes"] / rates["socket"]}


def _noop_during(actor: Any, control: Any, quick: bool) -> dict[str, Any]:
    import torch

    from bench.dataplane_bench import _noop_p

    n = 300 if quick else 1000
    _noop_p(control, 50)
    idle = _noop_p(control, n)
    big = torch.ones((256 if quick else 1024) * MiB // 4, dtype=torch.float32)
    stop = threading.Event()
    moved = [0]

    def pump() -> None:
        while not stop.is_set():
            actor.length.call_one(big).get(timeout=300)
            moved[0] += big.numel() * 4

    t = threading.Thread(target=pump, daemon=True)
    t0 = time.perf_counter()
    t.start()
    try:
        busy = _noop_p(control, n)
    finally:
        stop.set()
        t.join(timeout=300)
    return {"noop_idle_p50_us": idle["p50_us"], "noop_idle_p99_us": idle["p99_us"], "noop_busy_p50_us": busy["p50_us"],
            "noop_busy_p99_us": busy["p99_us"], "noop_busy_vs_idle_p99": busy["p99_us"] / idle["p99_us"],
            "noop_busy_transfer_GBs": moved[0] / (time.perf_counter() - t0) / 1e9}


def _client(address: str, ns: str, there: str, quick: bool) -> None:
    import torch
    from monarch._rust_bindings.monarch_hyperactor.channel import ChannelTransport
    from monarch.actor import attach_to_workers
    from monarch.config import configure

    from bench.dataplane_bench import PlainSocket

    torch.set_num_threads(1)
    # Monarch's default 30 s deadlines fail on this shared 2-core box under load.
    # TCP by host name, as Monarch's Slurm and Kubernetes jobs set it: the default
    # (abstract Unix sockets) cannot leave this network namespace.
    configure(actor_spawn_max_idle="300s", mesh_proc_spawn_max_idle="300s", host_spawn_ready_timeout="300s",
              default_transport=ChannelTransport.TcpWithHostname)
    hosts = attach_to_workers(workers=[address], ca="trust_all_connections", name="dataplane")
    procs = hosts.spawn_procs(per_host={"gpus": 1})
    actor = procs.spawn("dp", DataPlane)
    control = procs.spawn("ctl", DataPlane)
    actor.noop.call_one().get(timeout=300)
    control.noop.call_one().get(timeout=300)
    plain = PlainSocket(ns, there, 256 * MiB)
    try:
        out = _echo(actor, plain, quick)
        out.update(_noop_during(actor, control, quick))
    finally:
        plain.close()
    print("RESULT " + json.dumps(out), flush=True)
    procs.stop().get(timeout=120)


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        _worker(sys.argv[2])
    else:
        _client(sys.argv[2], sys.argv[3], sys.argv[4], "--quick" in sys.argv[5:])
