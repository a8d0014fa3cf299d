"""Network partitions between hosts, made for real: host agents in network
namespaces of their own on a bridge, links set down (packets vanish, nothing
closes) or one direction blackholed.

The controller runs as a script in its own process (it creates the partitions
itself at the moments that matter, and prints one RESULT line per phase);
``link_timeout`` is 4 s there so that each phase takes seconds, not minutes.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Bridged, bridged_namespaces, run_controller

LINK_TIMEOUT = 4.0

_COMMON = textwrap.dedent(
    """
    import json, os, subprocess, sys, threading, time
    import psutil
    from actormesh import config
    LINK_S = @LINK@
    NET = sys.argv[3]  # this side is NET.1, host i is NET.{11 + i}
    config.configure(default_transport="tcp", bind_host=f"{NET}.1", link_timeout=LINK_S, heartbeat_interval=0.5)
    import actormesh.actor as am
    from actormesh.actor import Actor, endpoint
    from actormesh.errors import ActorUnreachableError, SupervisionError
    from actormesh.mesh import HostMesh
    from actormesh.runtime import current_runtime

    failures = []
    am.unhandled_fault_hook = failures.append  # the controller lives on

    class Work(Actor):
        def __init__(self):
            self.seen = []

        @endpoint
        def pid(self):
            return os.getpid()

        @endpoint
        def work(self, i, seconds):
            self.seen.append(i)
            time.sleep(seconds)
            return i

        @endpoint
        def seen_list(self):
            return list(self.seen)

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)

    def emit(phase, **kw):
        print("RESULT " + json.dumps({"phase": phase, **kw}), flush=True)

    def outcome(fut, t0, timeout=120):
        try:
            return ("ok", fut.get(timeout=timeout), time.monotonic() - t0)
        except ActorUnreachableError as exc:
            return ("unreachable", str(exc), time.monotonic() - t0)
        except Exception as exc:
            return (type(exc).__name__, str(exc), time.monotonic() - t0)

    rt = current_runtime()
    secret = os.path.join(rt.job_dir, "secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, rt.secret.hex().encode()); os.close(fd)
    namespaces, ports = sys.argv[1].split(","), sys.argv[2].split(",")
    agents, addrs = [], []
    for i, ns in enumerate(namespaces):
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "actormesh.host", "--address",
                              f"tcp:{NET}.{11 + i}:0", "--secret-file", secret, "--print-address"], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, ACTORMESH_LINK_TIMEOUT=str(LINK_S), ACTORMESH_HEARTBEAT_INTERVAL="0.5"))
        agents.append(p)
        addrs.append(p.stdout.readline().strip())
    hosts = HostMesh(agents=addrs)

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    """
).replace("@LINK@", repr(LINK_TIMEOUT))

_CUT_ONE_HOST = _COMMON + textwrap.dedent(
    """
    try:
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        w = procs.spawn("w", Work)
        a, b = w.slice(hosts=0), w.slice(hosts=1)
        b_pid = b.pid.call_one().get(timeout=60)

        # A short partition (well under link_timeout) with calls in flight: invisible.
        t0 = time.monotonic()
        futs = [b.work.call_one(i, 0.2) for i in range(5)]
        ip("link", "set", ports[1], "down")
        late = [b.work.call_one(i, 0.0) for i in range(5, 10)]  # sent during the partition
        time.sleep(1.5)
        ip("link", "set", ports[1], "up")
        results = [outcome(f, t0) for f in futs + late]
        emit("short", results=results, seen=b.seen_list.call_one().get(timeout=60), failures=[str(f) for f in failures])

        # A long partition: a long call running on B, new calls during it, host A keeps working.
        t0 = time.monotonic()
        running = b.work.call_one(100, 3 * LINK_S)
        time.sleep(0.3)
        ip("link", "set", ports[1], "down")
        cut = time.monotonic()
        during, a_lat = [], []
        while time.monotonic() - cut < LINK_S + 3:
            during.append((time.monotonic(), b.work.call_one(200, 0.0)))
            s = time.monotonic()
            assert a.work.call_one(1, 0.0).get(timeout=30) == 1
            a_lat.append(time.monotonic() - s)
            time.sleep(0.25)
        results = [outcome(running, cut)] + [outcome(f, sent) for sent, f in during]
        after = outcome(b.work.call_one(300, 0.0), time.monotonic())  # a new call: fails at once
        # Fencing: B's agent lost its controller and stopped its procs, though nothing told it to.
        deadline = time.monotonic() + LINK_S + 10
        while alive(b_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        fenced = not alive(b_pid)
        ip("link", "set", ports[1], "up")
        emit("long", results=results, after=after, a_max_s=max(a_lat), fenced=fenced,
             failures=[str(f) for f in failures])

        # After the heal the same agents take a new mesh; the old one stays failed.
        procs2 = hosts.spawn_procs(per_host={"gpus": 1})
        w2 = procs2.spawn("w2", Work)
        new = sorted(w2.work.call(7, 0.0).get(timeout=60).values())
        old = outcome(b.work.call_one(400, 0.0), time.monotonic())
        emit("heal", new=new, old=old)
        procs2.stop().get(timeout=60)
    finally:
        for p in agents:
            p.terminate()
            p.wait(timeout=30)
    """
)

_CUT_DIRECTIONS = _COMMON + textwrap.dedent(
    """
    try:
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        w = procs.spawn("w", Work)
        b = w.slice(hosts=1)
        b.pid.call_one().get(timeout=60)

        # Only B -> controller dropped: the controller still reaches B, but hears nothing back.
        t0 = time.monotonic()
        ip("netns", "exec", namespaces[1], "ip", "route", "add", "blackhole", f"{NET}.1/32")
        pending = b.work.call_one(1, 0.0)
        one_way = outcome(pending, t0)
        ip("netns", "exec", namespaces[1], "ip", "route", "del", "blackhole", f"{NET}.1/32")
        emit("one_way", result=one_way)

        # The controller cut off from every host (the bridge down).
        procs2 = hosts.spawn_procs(per_host={"gpus": 1})
        w2 = procs2.spawn("w2", Work)
        w2.pid.call().get(timeout=60)
        t0 = time.monotonic()
        futs = [w2.slice(hosts=i).work.call_one(i, 0.5) for i in range(2)]
        ip("link", "set", ports[2], "down")
        results = [outcome(f, t0) for f in futs]
        ip("link", "set", ports[2], "up")
        procs3 = hosts.spawn_procs(per_host={"gpus": 1})
        new = sorted(procs3.spawn("w3", Work).work.call(9, 0.0).get(timeout=60).values())
        emit("all", results=results, new=new)
        procs3.stop().get(timeout=60)
    finally:
        for p in agents:
            p.terminate()
            p.wait(timeout=30)
    """
)


@pytest.fixture
def two_hosts() -> Iterator[Bridged]:
    """Two hosts in network namespaces on a bridge (see conftest.bridged_namespaces)."""
    with bridged_namespaces(2, "ap") as net:
        yield net


def _run(tmp_path: Path, script: str, net: Bridged | None, timeout: float) -> dict[str, Any]:
    """Run a controller script; argv: namespaces, [host ports..., bridge], the /24."""
    args = [",".join(net.namespaces), ",".join([*net.ports, net.bridge]), net.net] if net is not None else []
    return run_controller(tmp_path, script, args, timeout)


@pytest.mark.timeout(240)
def test_a_cut_off_host_fails_its_calls_in_bounded_time_and_fences_itself(two_hosts, tmp_path):
    phases = _run(tmp_path, _CUT_ONE_HOST, two_hosts, timeout=200)

    short = phases["short"]
    assert [r[:2] for r in short["results"]] == [["ok", i] for i in range(10)], short
    assert sorted(short["seen"]) == list(range(10)), short  # nothing lost, nothing run twice
    assert short["failures"] == []

    long = phases["long"]
    for kind, text, took in long["results"]:
        assert kind == "unreachable", (kind, text)
        assert "unreachable" in text and two_hosts.address(1) in text and "silent for" in text, text
        assert took <= LINK_TIMEOUT + 5, (took, text)  # the deadline plus 5 s at most
    assert long["after"][0] == "unreachable" and long["after"][2] < 1.0, long["after"]  # new calls fail at once
    assert long["a_max_s"] < 2.0, long  # the other host was unaffected
    assert long["fenced"], "the cut-off host's proc kept running for a controller that gave up on it"
    assert len(long["failures"]) >= 1 and all("unreachable" in f for f in long["failures"]), long["failures"]

    heal = phases["heal"]
    assert heal["new"] == [7, 7]
    assert heal["old"][0] != "ok" and heal["old"][2] < 1.0, heal["old"]  # the failed mesh stays failed


@pytest.mark.timeout(240)
def test_one_way_loss_and_a_controller_cut_off_from_every_host(two_hosts, tmp_path):
    phases = _run(tmp_path, _CUT_DIRECTIONS, two_hosts, timeout=200)
    kind, text, took = phases["one_way"]["result"]
    assert kind == "unreachable" and took <= LINK_TIMEOUT + 5, (kind, text, took)
    results = phases["all"]["results"]
    assert all(k == "unreachable" and took <= LINK_TIMEOUT + 5 for k, _, took in results), results
    assert phases["all"]["new"] == [9, 9]


_BUSY = textwrap.dedent(
    """
    import ctypes, json, os, subprocess, sys, time
    from actormesh import config
    config.configure(default_transport="tcp", link_timeout=2.0, heartbeat_interval=0.5)
    from actormesh.actor import Actor, endpoint
    from actormesh.mesh import HostMesh
    from actormesh.runtime import current_runtime

    class Busy(Actor):
        @endpoint
        def hold_gil(self, seconds):
            ctypes.PyDLL(None).sleep(seconds)  # C code that keeps the GIL: the proc's I/O loop is frozen too
            return "done"

    rt = current_runtime()
    secret = os.path.join(rt.job_dir, "secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(rt.secret.hex())
    agent = subprocess.Popen([sys.executable, "-m", "actormesh.host", "--address", "tcp:127.0.0.1:0", "--secret-file", secret,
                              "--print-address"], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, ACTORMESH_LINK_TIMEOUT="2.0", ACTORMESH_HEARTBEAT_INTERVAL="0.5"))
    try:
        procs = HostMesh(agents=[agent.stdout.readline().strip()]).spawn_procs(per_host={"gpus": 1})
        b = procs.spawn("b", Busy)
        t0 = time.monotonic()
        print("RESULT " + json.dumps({"phase": "busy", "result": b.hold_gil.call_one(5).get(timeout=60),
                                      "took": time.monotonic() - t0}), flush=True)
        procs.stop().get(timeout=60)
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    """
)


@pytest.mark.timeout(120)
def test_a_remote_proc_holding_the_gil_past_the_deadline_is_busy_not_unreachable(tmp_path):
    """Its own link is silent for 5 s (link_timeout 2 s), but its host agent answers."""
    phases = _run(tmp_path, _BUSY, None, timeout=100)
    assert phases["busy"]["result"] == "done" and phases["busy"]["took"] >= 5, phases
