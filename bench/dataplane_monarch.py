"""The cross-host data-plane figures for actormesh and Monarch 0.7.0 side by side:
``python -m bench.dataplane_monarch [--quick] [--rounds N] [--monarch-python PATH]``.

Root only. One network namespace behind a veth pair (as in
``bench.dataplane_bench``); in alternating rounds, actormesh (a host agent in
the namespace) and Monarch (``run_worker_loop_forever`` in the namespace,
``attach_to_workers`` from here) measure the 64 MiB echo against a
plain-socket echo in the same round, and noop p50/p99 idle and during large
transfers on the same link; and the floor under that last figure: plain
sockets, a 1-byte ping-pong idle and beside a bulk stream between separate
processes, and one transfer striped over 1, 2 and 4 plain streams
(``bench._socket_noop``).

Monarch finds its own address from the host name, which both ends share on
this one machine: each end runs under its own host name (``unshare -u``), and
both ends' hosts files map both names (``/etc/netns/<ns>/hosts``, which ``ip
netns exec`` mounts, in the namespace; ``unshare -m`` and a bind mount for the
client). Everything made
(namespace, hosts files, the worker) is removed at the end, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from ._socket_noop import ping_during, stripes
from .dataplane_bench import namespace, run

_KEYS = ("echo_tensor_vs_socket", "echo_bytes_vs_socket", "echo_64MiB_tensor_GBs", "echo_64MiB_bytes_GBs", "socket_echo_64MiB_GBs",
         "noop_idle_p50_us", "noop_idle_p99_us", "noop_busy_p50_us", "noop_busy_p99_us", "noop_busy_vs_idle_p99", "noop_busy_transfer_GBs")


# Each end its own host name (a UTS namespace), resolved by both ends' hosts files.
_CLIENT, _WORKER = "amdp-client", "amdp-worker"
_HOSTS = "127.0.0.1 localhost\n{here} %s\n{there} %s\n" % (_CLIENT, _WORKER)


def _wait_listening(host: str, port: int, proc: subprocess.Popen[Any], deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the Monarch worker exited with {proc.returncode} before it listened")
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)  # polling a port another process opens: nothing to wait on
    raise TimeoutError(f"the Monarch worker did not listen on {host}:{port} within {deadline_s:.0f}s")


def _monarch_round(python: str, ns: str, here: str, there: str, quick: bool) -> dict[str, Any]:
    netns_dir = f"/etc/netns/{ns}"
    os.makedirs(netns_dir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    port = 20000 + os.getpid() % 20000
    address = f"tcp://{there}:{port}"
    with tempfile.NamedTemporaryFile("w", suffix=".hosts", delete=False) as here_hosts:
        here_hosts.write(_HOSTS.format(here=here, there=there))
    worker = None
    try:
        with open(f"{netns_dir}/hosts", "w") as f:
            f.write(_HOSTS.format(here=here, there=there))
        serve = f"hostname {_WORKER} && exec {python} -m bench._dataplane_monarch worker {address}"
        worker = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "-u", "sh", "-c", serve], env=env)
        _wait_listening(there, port, worker, 120)
        script = (f"hostname {_CLIENT} && mount --bind {here_hosts.name} /etc/hosts && exec {python} -m bench._dataplane_monarch client "
                  f"{address} {ns} {there}" + (" --quick" if quick else ""))
        done = subprocess.run(["unshare", "-m", "-u", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=1200)
        for line in done.stdout.splitlines():
            if line.startswith("RESULT "):
                return dict(json.loads(line[len("RESULT "):]))
        raise RuntimeError(f"the Monarch client printed no result (exit {done.returncode}):\n{done.stderr[-3000:]}")
    finally:
        if worker is not None:
            worker.kill()
            worker.wait(timeout=30)
        os.unlink(here_hosts.name)
        shutil.rmtree(netns_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--monarch-python", default="/tmp/monarch-venv/bin/python")
    ap.add_argument("--systems", default="actormesh,monarch", help="comma-separated: which to run")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args(argv)
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        print(json.dumps({"skipped": "needs root, iproute2 and unshare for a network namespace"}))
        return 0
    if not os.path.exists(args.monarch_python):
        print(json.dumps({"skipped": f"no Monarch interpreter at {args.monarch_python} (torchmonarch==0.7.0 in its own venv)"}))
        return 0
    rounds: list[dict[str, Any]] = []
    with namespace() as (ns, here, there):
        for _ in range(args.rounds):
            load = os.getloadavg()[0]
            one: dict[str, Any] = {"load_avg": load, "socket": {**ping_during(ns, there, 300 if args.quick else 1000),
                                                                **stripes(ns, there, (256 if args.quick else 1024) << 20)}}
            if "actormesh" in args.systems:
                ours = run(args.quick, here, there, ns, ("echo", "noop"))
                one["actormesh"] = {k: ours[k] for k in _KEYS}
            if "monarch" in args.systems:
                theirs = _monarch_round(args.monarch_python, ns, here, there, args.quick)
                one["monarch"] = {k: theirs[k] for k in _KEYS}
            rounds.append(one)
            print(json.dumps(one), flush=True)
    text = json.dumps({"rounds": rounds}, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
