"""The data plane across hosts: a host agent in a network namespace of its own, the
controller (a script in its own process, printing one RESULT line per phase) on
the other side of a bridge, so every byte crosses TCP between two network stacks.
Skipped with the reason where namespaces cannot be made.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Bridged, bridged_namespaces, run_controller

_COMMON = textwrap.dedent(
    """
    import json, os, socket, struct, subprocess, sys, time, zlib
    import numpy as np, torch
    from actormesh import config
    NET = sys.argv[2]
    config.configure(default_transport="tcp", bind_host=f"{NET}.1")
    import actormesh.actor as am
    from actormesh.actor import Actor, endpoint
    from actormesh.mesh import HostMesh
    from actormesh.runtime import current_runtime

    torch.set_num_threads(1)
    failures = []
    am.unhandled_fault_hook = failures.append  # a proc killed on purpose: the controller lives on

    def crc(value):
        if isinstance(value, torch.Tensor):
            value = value.numpy()
        return zlib.crc32(memoryview(value).cast("B")) if len(memoryview(value).cast("B")) else 0

    class Sink(Actor):
        @endpoint
        def check(self, value):
            view = memoryview(value.numpy() if isinstance(value, torch.Tensor) else value)
            return type(value).__name__, view.nbytes, crc(value), view.readonly

        @endpoint
        def echo(self, value):
            return value

        @endpoint
        def pid(self):
            return os.getpid()

        @endpoint
        def log(self, tag):
            self.seen = getattr(self, "seen", [])
            self.seen.append((tag, time.monotonic()))

        @endpoint
        def big(self, value, tag):
            self.seen = getattr(self, "seen", [])
            self.seen.append((tag, time.monotonic()))
            return len(value)

        @endpoint
        def seen_list(self):
            return getattr(self, "seen", [])

        @endpoint
        def make(self, n):
            return pattern(n, 3)

    def wait_for(predicate, timeout):
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def emit(phase, **kw):
        print("RESULT " + json.dumps({"phase": phase, **kw}), flush=True)

    def pattern(n, seed):
        import random
        block = random.Random(seed).randbytes(min(n, 65521) or 1)
        return (block * (n // len(block) + 1))[:n]

    rt = current_runtime()
    secret = os.path.join(rt.job_dir, "secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, rt.secret.hex().encode()); os.close(fd)
    ns = sys.argv[1]
    agent = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "actormesh.host", "--address",
                              f"tcp:{NET}.11:0", "--secret-file", secret, "--print-address"], stdout=subprocess.PIPE, text=True)
    hosts = HostMesh(agents=[agent.stdout.readline().strip()])
    """
)

_SIZES = _COMMON + textwrap.dedent(
    """
    KiB, MiB = 1 << 10, 1 << 20
    sizes = sorted({0, 1, *(t + d for t in (4 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB) for d in (-1, 0, 1))})
    try:
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        sink = procs.spawn("sink", Sink)
        bad = []
        for n in sizes:
            data = pattern(n, n)
            values = {"bytes": data, "bytearray": bytearray(data), "memoryview": memoryview(bytearray(data)),
                      "ndarray": np.frombuffer(data, dtype=np.uint8).copy(),
                      "Tensor": torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)}
            want = zlib.crc32(data)
            for name, value in values.items():
                got = sink.check.call_one(value).get(timeout=60)
                if list(got[:3]) != [name, n, want] or (n and name != "bytes" and got[3]):
                    bad.append(["there", n, name, got])
                back = sink.echo.call_one(value).get(timeout=60)
                if type(back).__name__ != name or crc(back) != want:
                    bad.append(["back", n, name, type(back).__name__])
        emit("sizes", bad=bad, count=len(sizes))

        # A hostile (but authenticated) peer announces a chunk for no frame: only its connection goes.
        from actormesh.transport import HANDSHAKE_BYTES, Handshake
        host, port = procs._addresses[0][len("tcp:"):].rsplit(":", 1)
        closed = {}
        for name, bogus in (("chunk without a frame", struct.pack("<QI", 100, 4 << 16) + bytes(100)),
                            ("segment of unknown kind", struct.pack("<QIQ", 8 + 70000, 1, 70000 | 9 << 56) + bytes(70000))):
            me = Handshake(rt.secret, dialer=True)
            with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as s:
                s.sendall(me.start())
                while not me.done:
                    chunk = s.recv(HANDSHAKE_BYTES)
                    assert chunk, "closed during an authentic handshake"
                    reply = me.receive(chunk)
                    if reply:
                        s.sendall(reply)
                s.sendall(bogus)
                try:
                    closed[name] = s.recv(4096) == b""
                except ConnectionResetError:
                    closed[name] = True
            closed[name + ": still served"] = sink.check.call_one(b"still").get(timeout=30)[2] == zlib.crc32(b"still")
        emit("hostile", closed=closed)
        procs.stop().get(timeout=60)
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    """
)

_GIB = _COMMON + textwrap.dedent(
    """
    try:
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        sink = procs.spawn("sink", Sink)
        data = pattern(1 << 30, 7)
        t0 = time.monotonic()
        got = sink.check.call_one(data).get(timeout=120)
        took = time.monotonic() - t0
        emit("gib", ok=list(got[:3]) == ["bytes", 1 << 30, zlib.crc32(data)], took_s=took)
        procs.stop().get(timeout=60)
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    """
)

_INTERLEAVE = _COMMON + textwrap.dedent(
    """
    import threading, psutil
    try:
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        w = procs.spawn("w", Sink)
        a, b = w, procs.spawn("b", Sink)
        a.log.call_one("warm").get(timeout=60); b.log.call_one("warm").get(timeout=60)
        big = torch.ones(1 << 28)  # 1 GiB
        started, futures = threading.Event(), []

        def sender():  # one thread: the large call, then small calls to the same actor
            started.set()
            futures.append(a.big.call_one(big, "big"))
            futures.extend(a.log.call_one(f"after-{i}") for i in range(5))

        t = threading.Thread(target=sender)
        t.start()
        started.wait(30)
        b_sent = 0
        while b_sent < 300 and not (futures and futures[0].done()):
            b.log.call_one(b_sent).get(timeout=60)  # another actor, same proc, same connection
            b_sent += 1
        t.join(60)
        assert futures[0].get(timeout=120) == 1 << 28
        for f in futures[1:]:
            f.get(timeout=60)
        a_seen = [tag for tag, _ in a.seen_list.call_one().get(timeout=60)]
        big_at = dict(a.seen_list.call_one().get(timeout=60))["big"]
        b_seen = b.seen_list.call_one().get(timeout=60)
        emit("interleave", a_seen=a_seen, b_sent=b_sent, b_order=[tag for tag, _ in b_seen[1:]] == list(range(b_sent)),
             b_before_big=sum(1 for tag, at in b_seen[1:] if at < big_at))

        # The sender of a 512 MiB reply killed mid-transfer: a clear error here, the memory back.
        me = psutil.Process()
        pid = w.pid.call_one().get(timeout=60)
        base = me.memory_info().rss
        fut = w.make.call_one(512 << 20)
        receiving = wait_for(lambda: me.memory_info().rss > base + (128 << 20), 60)
        os.kill(pid, 9)
        t0 = time.monotonic()
        try:
            fut.get(timeout=60)
            error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        failed_s = time.monotonic() - t0
        back = wait_for(lambda: me.memory_info().rss < base + (64 << 20), 30)
        emit("killed", receiving=receiving, error=error, failed_s=failed_s, memory_back=back,
             rss_mb=[base >> 20, me.memory_info().rss >> 20])
        try:
            procs.stop().get(timeout=60)
        except Exception:
            pass  # one of its procs was killed
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    """
)


@pytest.fixture
def one_host() -> Iterator[Bridged]:
    """One host in a network namespace on a bridge (see conftest.bridged_namespaces)."""
    with bridged_namespaces(1, "dp") as net:
        yield net


def _run(tmp_path: Path, script: str, net: Bridged, timeout: float) -> dict[str, Any]:
    """Run a controller script; argv: the namespace, the /24."""
    return run_controller(tmp_path, script, [net.namespaces[0], net.net], timeout)


@pytest.mark.timeout(90)
def test_every_kind_crosses_hosts_intact_at_every_threshold_and_a_hostile_header_costs_one_connection(one_host, tmp_path):
    phases = _run(tmp_path, _SIZES, one_host, timeout=80)
    assert phases["sizes"]["bad"] == [] and phases["sizes"]["count"] == 17
    assert phases["hostile"]["closed"] and all(phases["hostile"]["closed"].values()), phases["hostile"]


@pytest.mark.timeout(90)
def test_a_gibibyte_of_bytes_crosses_hosts_intact(one_host, tmp_path):
    if os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") < 6 << 30:
        pytest.skip("needs about 6 GiB of free memory (sender, receiver, checks)")
    phases = _run(tmp_path, _GIB, one_host, timeout=80)
    assert phases["gib"]["ok"], phases


@pytest.mark.timeout(120)
def test_small_calls_pass_a_large_transfer_on_the_same_connection_and_a_killed_sender_frees_its_memory(one_host, tmp_path):
    phases = _run(tmp_path, _INTERLEAVE, one_host, timeout=110)
    inter = phases["interleave"]
    assert inter["a_seen"] == ["warm", "big", *(f"after-{i}" for i in range(5))]  # one actor: send order kept
    assert inter["b_order"] and inter["b_sent"] >= 1
    assert inter["b_before_big"] >= 1, inter  # calls to another actor went while the 1 GiB was on the wire
    killed = phases["killed"]
    assert killed["receiving"] and killed["error"] is not None and killed["failed_s"] < 30, killed
    assert killed["memory_back"], killed
