"""The data plane across hosts: ``python -m bench.dataplane_bench [--quick] [--out PATH]``.

Root only: the bench makes a network namespace behind a veth pair (removed at
the end, also on failure), runs a host agent in it and one proc on that agent;
the controller (this process) stays on the other end of the pair. So every
byte crosses a real TCP connection between two network stacks, as between hosts.

Rows, each measured in the same run as its baseline (ratios, not absolutes,
are the figures: the machine is a shared 2-core box):

- ``echo``: a 64 MiB float32 tensor and a 64 MiB ``bytes`` sent to an endpoint
  that returns its argument (2 x 64 MiB moved per call), against ``socket_echo``:
  plain Python sockets (``sendall`` / ``recv_into`` a preallocated buffer)
  echoing the same bytes between the same two namespaces. Interleaved rounds.
- ``noop_during``: noop ``call_one`` p50/p99 to an actor of the proc while idle,
  and while a background thread keeps sending 1 GiB tensors (256 MiB with
  ``--quick``) to another actor of that proc, over the same connection.
- ``rdma``: ``RDMABuffer.read_into`` of a 256 MiB tensor owned by the remote
  proc against a plain-socket one-way transfer of the same bytes.

GB/s = bytes moved / wall time, GB = 1e9 bytes, median of the reps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MiB = 1 << 20

# A one-connection echo (or sink) server: <u64 n><u8 mode> then n bytes; mode 0 echoes, 1 replies b"k".
_SOCKET_SERVER = textwrap.dedent(
    """
    import socket, struct, sys
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((sys.argv[1], 0)); srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(int(sys.argv[2])); view = memoryview(buf)
    def fill(v):
        got = 0
        while got < len(v):
            n = conn.recv_into(v[got:])
            if not n:
                raise SystemExit(0)
            got += n
    while True:
        head = bytearray(9); fill(memoryview(head))
        n, mode = struct.unpack("<QB", head)
        fill(view[:n])
        conn.sendall(view[:n] if mode == 0 else b"k")
    """
)


@contextmanager
def namespace() -> Iterator[tuple[str, str, str]]:
    """A network namespace behind a veth pair: (namespace, this side's IP, its IP)."""
    tag = f"dp{os.getpid() % 100000}"
    ns, here_dev, there_dev = f"{tag}n", f"{tag}a", f"{tag}b"
    net = f"198.18.{20 + os.getpid() % 200}"
    here, there = f"{net}.1", f"{net}.2"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)

    try:
        ip("netns", "add", ns)
        ip("link", "add", here_dev, "type", "veth", "peer", "name", there_dev)
        ip("link", "set", there_dev, "netns", ns)
        ip("addr", "add", f"{here}/24", "dev", here_dev)
        ip("link", "set", here_dev, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{there}/24", "dev", there_dev)
        ip("netns", "exec", ns, "ip", "link", "set", there_dev, "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, here, there
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", here_dev], capture_output=True)


class PlainSocket:
    """The client end of ``_SOCKET_SERVER`` running in the namespace."""

    def __init__(self, ns: str, there: str, max_bytes: int) -> None:
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _SOCKET_SERVER, there, str(max_bytes)],
                                     stdout=subprocess.PIPE, text=True)
        port = int(self.proc.stdout.readline())  # type: ignore[union-attr]
        self.sock = socket.create_connection((there, port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(max_bytes)

    def _fill(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("socket echo server went away")
            got += n

    def echo(self, data: memoryview) -> None:
        self.sock.sendall(len(data).to_bytes(8, "little") + b"\0")
        self.sock.sendall(data)
        self._fill(memoryview(self.buf)[: len(data)])

    def one_way(self, data: memoryview) -> None:
        self.sock.sendall(len(data).to_bytes(8, "little") + b"\1")
        self.sock.sendall(data)
        self._fill(memoryview(self.buf)[:1])

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(timeout=30)


def _actor_class() -> type:
    """The remote end (defined here so the bench is one file; cloudpickle sends it by value)."""
    from actormesh.actor import Actor, endpoint
    from actormesh.rdma import RDMABuffer

    class DataPlane(Actor):
        def __init__(self) -> None:
            import torch

            torch.set_num_threads(1)
            self.keep: Any = None

        @endpoint
        def noop(self) -> None:
            return None

        @endpoint
        def echo(self, value: Any) -> Any:
            return value

        @endpoint
        def length(self, value: Any) -> int:
            return len(value)

        @endpoint
        def make(self, nbytes: int) -> Any:
            import torch

            t = torch.empty(nbytes, dtype=torch.uint8)
            t.fill_(7)  # every page touched before anything is timed
            self.keep = (t, RDMABuffer(t))
            return self.keep[1]

        @endpoint
        def drop(self) -> None:
            self.keep[1].drop().get(timeout=60)
            self.keep = None

    return DataPlane


def _median_rate(moved: int, times: list[float]) -> float:
    return moved / statistics.median(times) / 1e9


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


SECTIONS = ("echo", "noop", "rdma")


def run(quick: bool, here: str, there: str, ns: str, sections: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
    from actormesh import config

    config.configure(default_transport="tcp", bind_host=here)
    import torch
    from actormesh.mesh import HostMesh
    from actormesh.runtime import current_runtime

    torch.set_num_threads(1)
    rt = current_runtime()
    secret = os.path.join(rt.job_dir, "secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(rt.secret.hex())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    agent = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "actormesh.host", "--address", f"tcp:{there}:0",
                              "--secret-file", secret, "--print-address"], stdout=subprocess.PIPE, text=True, env=env)
    plain = None
    out: dict[str, Any] = {"info": {"load_avg_start": os.getloadavg()}}
    try:
        hosts = HostMesh(agents=[agent.stdout.readline().strip()])  # type: ignore[union-attr]
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        actor = procs.spawn("dp", _actor_class())
        actor.noop.call_one().get(timeout=60)
        control = procs.spawn("ctl", _actor_class())  # same proc, same connection, another actor
        control.noop.call_one().get(timeout=60)
        plain = PlainSocket(ns, there, 256 * MiB)
        if "echo" in sections:
            out.update(_echo(actor, plain, quick))
        if "noop" in sections:
            out.update(_noop_during(actor, control, quick))
        if "rdma" in sections:
            out.update(_rdma(actor, plain, quick))
        procs.stop().get(timeout=60)
    finally:
        if plain is not None:
            plain.close()
        agent.terminate()
        agent.wait(timeout=30)
    out["info"]["load_avg_end"] = os.getloadavg()
    return out


def _echo(actor: Any, plain: PlainSocket, quick: bool) -> dict[str, Any]:
    import torch

    nbytes = 64 * MiB
    tensor = torch.ones(nbytes // 4, dtype=torch.float32)
    data = bytes(nbytes)
    raw = memoryview(tensor.numpy()).cast("B")
    ep = actor.echo
    for value in (tensor, data):
        back = ep.call_one(value).get(timeout=60)
        assert len(back) == len(value)
        del back
    plain.echo(raw)
    times: dict[str, list[float]] = {"tensor": [], "bytes": [], "socket": []}
    for _ in range(3 if quick else 8):
        times["socket"].append(_timed(lambda: plain.echo(raw)))
        times["tensor"].append(_timed(lambda: ep.call_one(tensor).get(timeout=60)))
        times["bytes"].append(_timed(lambda: ep.call_one(data).get(timeout=60)))
    rates = {k: _median_rate(2 * nbytes, v) for k, v in times.items()}
    return {"info_echo_times_ms": {k: [round(x * 1e3, 1) for x in v] for k, v in times.items()}, "echo_64MiB_tensor_GBs": rates["tensor"], "echo_64MiB_bytes_GBs": rates["bytes"],
            "socket_echo_64MiB_GBs": rates["socket"], "echo_tensor_vs_socket": rates["tensor"] / rates["socket"],
            "echo_bytes_vs_socket": rates["bytes"] / rates["socket"]}


def _noop_p(actor: Any, n: int) -> dict[str, float]:
    lat = sorted(_timed(lambda: actor.noop.call_one().get(timeout=60)) for _ in range(n))
    return {"p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6}


def _noop_during(actor: Any, control: Any, quick: bool) -> dict[str, Any]:
    import torch

    n = 300 if quick else 1000
    _noop_p(control, 100)
    idle = _noop_p(control, n)
    big = torch.ones((256 if quick else 1024) * MiB // 4, dtype=torch.float32)
    stop = threading.Event()
    moved = [0]

    def pump() -> None:
        while not stop.is_set():
            actor.length.call_one(big).get(timeout=120)
            moved[0] += big.numel() * 4

    t = threading.Thread(target=pump, daemon=True)
    t0 = time.perf_counter()
    t.start()
    try:
        busy = _noop_p(control, n)
    finally:
        stop.set()
        t.join(timeout=120)
    rate = moved[0] / (time.perf_counter() - t0) / 1e9
    return {"noop_idle_p50_us": idle["p50_us"], "noop_idle_p99_us": idle["p99_us"], "noop_busy_p50_us": busy["p50_us"],
            "noop_busy_p99_us": busy["p99_us"], "noop_busy_vs_idle_p99": busy["p99_us"] / idle["p99_us"],
            "noop_busy_transfer_GBs": rate, "noop_busy_transfer_bytes": big.numel() * 4}


def _rdma(actor: Any, plain: PlainSocket, quick: bool) -> dict[str, Any]:
    import torch

    nbytes = 256 * MiB
    handle = actor.make.call_one(nbytes).get(timeout=60)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    src = torch.ones(nbytes, dtype=torch.uint8)
    raw = memoryview(src.numpy())
    handle.read_into(dst).get(timeout=120)
    assert int(dst[-1]) == 7
    plain.one_way(raw)
    times: dict[str, list[float]] = {"read_into": [], "socket": []}
    for _ in range(2 if quick else 5):
        times["read_into"].append(_timed(lambda: handle.read_into(dst).get(timeout=120)))
        times["socket"].append(_timed(lambda: plain.one_way(raw)))
    actor.drop.call_one().get(timeout=60)
    rates = {k: _median_rate(nbytes, v) for k, v in times.items()}
    return {"rdma_read_256MiB_GBs": rates["read_into"], "socket_one_way_256MiB_GBs": rates["socket"],
            "rdma_read_vs_socket": rates["read_into"] / rates["socket"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", help="write the JSON here too")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    args = ap.parse_args(argv)
    if os.geteuid() != 0 or not shutil.which("ip"):
        print(json.dumps({"skipped": "needs root and iproute2 for a network namespace"}))
        return 0
    with namespace() as (ns, here, there):
        out = run(args.quick, here, there, ns, tuple(args.sections.split(",")))
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
