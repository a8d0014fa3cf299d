"""Monarch 0.7.0's side of the cross-host data-plane figures, run by
``bench.dataplane_monarch`` under the Monarch venv's interpreter.

``python -m bench._dataplane_monarch worker ADDRESS`` serves a Monarch host in
the namespace; ``python -m bench._dataplane_monarch client ADDRESS NS THERE
[--quick]`` attaches to it from the other end of the veth pair and measures
what ``bench.dataplane_bench`` measures for actormesh (64 MiB echo of a tensor
and of ``bytes`` against a plain-socket echo in the same run; noop p50/p99 idle
and during a stream of large transfers on the same link). Prints one
``RESULT {json}`` line. Imports no actormesh: the plain-socket baseline and the
measurements are ``bench.dataplane_bench``'s own (they drive any actor with
``call_one``), and it needs only the standard library at import.
"""

from __future__ import annotations

import json
import sys
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


def _client(address: str, ns: str, there: str, quick: bool) -> None:
    import torch
    from monarch._rust_bindings.monarch_hyperactor.channel import ChannelTransport
    from monarch.actor import attach_to_workers
    from monarch.config import configure

    from bench.dataplane_bench import PlainSocket, _echo, _noop_during

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
