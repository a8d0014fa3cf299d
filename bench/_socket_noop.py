"""The floor under the "noop during a transfer" figure: plain sockets, no framework.

A ping-pong of 1 byte over its own TCP connection, idle and while other
processes stream bulk bytes over a second connection between the same two
network stacks as fast as they can. The bulk sender and sink are separate
processes (no shared interpreter lock), so what remains is what the kernel
and the box's cores impose: the lowest busy/idle p99 any framework can reach
here. ``ping_during(ns, there, n)`` runs it; the ends in the namespace
are started with ``ip netns exec`` and removed at the end, also on failure.

``stripes(ns, there, nbytes)``: the same bytes over 1, 2 and 4 plain TCP
streams at once (one sending process each): whether striping a transfer over
several connections could beat one stream between these two network stacks.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from typing import Any

# A server for one connection: mode "echo" returns every byte, "sink" discards.
_SERVER = textwrap.dedent(
    """
    import socket, sys
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((sys.argv[1], 0)); srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(1 << 20)
    while True:
        n = conn.recv_into(buf)
        if not n:
            break
        if sys.argv[2] == "echo":
            conn.sendall(memoryview(buf)[:n])
    """
)

# A sink for many connections at once (one thread each), until killed.
_MULTI_SINK = textwrap.dedent(
    """
    import socket, sys, threading
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((sys.argv[1], 0)); srv.listen(16)
    print(srv.getsockname()[1], flush=True)
    def serve(c):
        buf = bytearray(4 << 20)
        while c.recv_into(buf):
            pass
        c.close()
    while True:
        c, _ = srv.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
    """
)

# Sends N bytes to HOST:PORT once a line arrives on stdin, then waits for the sink to close.
_ONE_SHOT = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
    data = bytes(int(sys.argv[3]))
    sys.stdin.readline()
    s.sendall(data); s.shutdown(socket.SHUT_WR); s.recv(1)
    """
)

# A bulk sender: streams 4 MiB writes to HOST:PORT until killed.
_SENDER = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
    data = bytes(4 << 20)
    while True:
        s.sendall(data)
    """
)


def _server(ns: str, there: str, mode: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _SERVER, there, mode], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())  # type: ignore[union-attr]


def _pings(sock: socket.socket, n: int) -> dict[str, float]:
    one = bytearray(1)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.sendall(b"x")
        if sock.recv_into(one) != 1:
            raise ConnectionError("the ping server went away")
        lat.append(time.perf_counter() - t0)
    lat.sort()
    return {"p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6}


def ping_during(ns: str, there: str, n: int) -> dict[str, Any]:
    """Ping p50/p99 over one connection, idle and during a bulk stream over another."""
    procs: list[subprocess.Popen[str]] = []
    try:
        echo, echo_port = _server(ns, there, "echo")
        sink, sink_port = _server(ns, there, "sink")
        procs += [echo, sink]
        sock = socket.create_connection((there, echo_port), timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _pings(sock, 100)
        idle = _pings(sock, n)
        procs.append(subprocess.Popen([sys.executable, "-c", _SENDER, there, str(sink_port)], text=True))
        time.sleep(0.5)  # let the stream reach its rate: the figure is about a link already busy
        busy = _pings(sock, n)
        sock.close()
        return {"socket_ping_idle_p50_us": idle["p50_us"], "socket_ping_idle_p99_us": idle["p99_us"],
                "socket_ping_busy_p50_us": busy["p50_us"], "socket_ping_busy_p99_us": busy["p99_us"],
                "socket_ping_busy_vs_idle_p99": busy["p99_us"] / idle["p99_us"]}
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def stripes(ns: str, there: str, nbytes: int, counts: tuple[int, ...] = (1, 2, 4)) -> dict[str, float]:
    """GB/s moving ``nbytes`` over each of ``counts`` parallel streams (``nbytes / n`` each)."""
    sink = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _MULTI_SINK, there], stdout=subprocess.PIPE, text=True)
    out: dict[str, float] = {}
    try:
        port = int(sink.stdout.readline())  # type: ignore[union-attr]
        for n in counts:
            senders = [subprocess.Popen([sys.executable, "-c", _ONE_SHOT, there, str(port), str(nbytes // n)],
                                        stdin=subprocess.PIPE, text=True) for _ in range(n)]
            time.sleep(0.5)  # connected and allocated: only the transfer is timed
            t0 = time.perf_counter()
            for p in senders:
                p.stdin.write("go\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            for p in senders:
                p.wait(timeout=300)
            out[f"stripes_{n}_GBs"] = nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        sink.kill()
        sink.wait(timeout=30)
    return out
