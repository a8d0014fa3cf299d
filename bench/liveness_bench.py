"""What watching links to other hosts costs and how fast it sees a partition:
``python -m bench.liveness_bench [--quick]``.

1. noop ``call_one`` p50 over TCP with the link watch on vs off (stopped in the
   controller and the proc), interleaved rounds, same run;
2. heartbeat bytes per idle link per second: an idle controller <-> proc TCP
   link for 10 s, bytes both ways from the kernel's own counters (``ss -ti``);
3. detection time over 10 partitions (root only: a host agent in a network
   namespace of its own behind a veth pair; its link set down with a call in
   flight, the time until that call fails, the link set up, a new proc mesh;
   ``link_timeout`` 2 s so that the run takes a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from typing import Any

from bench._util import latency_stats, time_calls

_IDLE_S = 10.0


def _watch_cost(rounds: int, n: int) -> dict[str, Any]:
    """Noop p50 with the watch on vs off, and idle bytes, over a local host agent on TCP
    loopback: controller -> agent and controller <-> proc are watched links (a child
    link is not: its spawner's heartbeat covers it)."""
    from actormesh import config
    from actormesh.actor import Actor, endpoint
    from actormesh.mesh import HostMesh
    from actormesh.runtime import current_runtime

    class Probe(Actor):
        @endpoint
        def noop(self) -> None:
            return None

        @endpoint
        def watch(self, on: bool) -> None:
            rt = current_runtime()
            rt.loop.call_soon_threadsafe(rt.links.resume if on else rt.links.stop)

    config.configure(default_transport="tcp")
    rt = current_runtime()
    secret = os.path.join(rt.job_dir, "bench-secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(rt.secret.hex())
    agent = subprocess.Popen([sys.executable, "-m", "actormesh.host", "--address", "tcp:127.0.0.1:0", "--secret-file", secret,
                              "--print-address"], stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout is not None
        procs = HostMesh(agents=[agent.stdout.readline().strip()]).spawn_procs(per_host={"gpus": 1})
        p = procs.spawn("probe", Probe)
        p.noop.call_one().get(timeout=60)
        idle = _idle_bytes()
        p50: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(rounds):
            for mode in ("on", "off"):
                on = mode == "on"
                p.watch.call_one(on).get(timeout=60)
                rt.loop.call_soon_threadsafe(rt.links.resume if on else rt.links.stop)
                time_calls(lambda: p.noop.call_one().get(timeout=60), n // 10)
                p50[mode].append(latency_stats(time_calls(lambda: p.noop.call_one().get(timeout=60), n))["p50"])
        rt.loop.call_soon_threadsafe(rt.links.resume)
        procs.stop().get(timeout=60)
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    on, off = statistics.median(p50["on"]), statistics.median(p50["off"])
    paired = sorted(a / b for a, b in zip(p50["on"], p50["off"]))  # each pair ran back to back
    return {"noop_p50_us_on": on, "noop_p50_us_off": off, "ratio_on_off": on / off, "paired_ratio_median": statistics.median(paired),
            "paired_ratio_range": [paired[0], paired[-1]], "p50_rounds_us": p50, **idle}


def _idle_bytes() -> dict[str, Any]:
    """Bytes both ways on this process's established TCP links over ``_IDLE_S`` of
    idleness, from the kernel's counters (``ss -ti``), per link per second."""
    if not shutil.which("ss"):
        return {"idle_bytes_per_link_s": None, "why": "no ss(8)"}
    me = f"pid={os.getpid()},"

    def counters() -> tuple[int, int]:
        out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True, timeout=20).stdout
        total, links, mine = 0, 0, False
        for line in out.splitlines():
            if not line[:1].isspace():  # a socket's first line; its figures follow, indented
                mine = me in line
                links += mine
                continue
            if mine:
                total += sum(int(x) for x in re.findall(r"bytes_(?:sent|received):(\d+)", line))
        return total, links

    before, links = counters()
    time.sleep(_IDLE_S)  # the measurement itself: idle links over a fixed window
    after, _ = counters()
    return {"idle_links": links, "idle_bytes_per_link_s": (after - before) / _IDLE_S / max(1, links)}


_DETECT = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from actormesh import config
    config.configure(default_transport="tcp", bind_host=sys.argv[2], link_timeout=2.0, heartbeat_interval=0.5)
    import actormesh.actor as am
    from actormesh.actor import Actor, endpoint
    from actormesh.errors import ActorUnreachableError
    from actormesh.mesh import HostMesh
    from actormesh.runtime import current_runtime

    am.unhandled_fault_hook = lambda failure: None  # the bench's partitions are expected

    class Work(Actor):
        @endpoint
        def work(self, seconds):
            time.sleep(seconds)

    ns, here, there, port, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    rt = current_runtime()
    secret = os.path.join(rt.job_dir, "secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(rt.secret.hex())
    agent = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "actormesh.host", "--address", f"tcp:{there}:0",
                              "--secret-file", secret, "--print-address"], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, ACTORMESH_LINK_TIMEOUT="2.0", ACTORMESH_HEARTBEAT_INTERVAL="0.5"))
    try:
        hosts = HostMesh(agents=[agent.stdout.readline().strip()])
        detect = []
        for _ in range(n):
            w = hosts.spawn_procs(per_host={"gpus": 1}).spawn("w", Work)
            w.work.call_one(0.0).get(timeout=60)
            fut = w.work.call_one(30.0)
            subprocess.run(["ip", "link", "set", port, "down"], check=True)
            cut = time.monotonic()
            try:
                fut.get(timeout=60)
            except ActorUnreachableError:
                detect.append(time.monotonic() - cut)
            subprocess.run(["ip", "link", "set", port, "up"], check=True)
        print(json.dumps(detect), flush=True)
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    """
)


def _detection(n: int) -> dict[str, Any]:
    if os.geteuid() != 0 or not shutil.which("ip"):
        return {"detection": None, "why": "needs root and iproute2 for a network namespace"}
    tag = f"lb{os.getpid() % 100000}"
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
        out = subprocess.run([sys.executable, "-c", _DETECT, ns, here, there, here_dev, str(n)], capture_output=True, text=True,
                             timeout=60 + 15 * n)
        if out.returncode != 0:
            return {"detection": None, "why": out.stderr[-2000:]}
        times = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", here_dev], capture_output=True)
    return {"link_timeout_s": 2.0, "partitions": n, "detected": len(times), "detect_median_s": statistics.median(times),
            "detect_max_s": max(times), "detect_s": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-partitions", action="store_true", help="skip the network-namespace part")
    args = ap.parse_args()
    out = {} if args.no_partitions else _detection(3 if args.quick else 10)
    out.update(_watch_cost(rounds=3 if args.quick else 15, n=500 if args.quick else 2000))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
