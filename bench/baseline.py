"""Baseline: plain uvloop request/reply between two processes over a Unix socket.

The floor every actormesh figure is compared with: an asyncio ``Protocol`` on
uvloop, messages framed as an 8-byte little-endian length followed by a pickle
(protocol 5) of a small tuple, one server process that answers each request.

* ``rtt_p50_us`` / ``rtt_p99_us``: request/reply round trips, one at a time,
  measured inside the client's event loop (2,000 after 200 warm-up).
* ``pipelined_msgs_s``: 5,000 requests written back to back, then wait for all
  5,000 replies (median of 3 reps): round trips per second.

Server: ``python -m bench.baseline --serve PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench._util import latency_stats

_LEN = 8


class _Framed(asyncio.Protocol):
    """Length-prefixed pickled messages in both directions."""

    def __init__(self, on_message: Callable[[_Framed, Any], None]) -> None:
        self.on_message = on_message
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= _LEN:
            n = int.from_bytes(buf[pos : pos + _LEN], "little")
            if end - pos - _LEN < n:
                break
            msg = pickle.loads(buf[pos + _LEN : pos + _LEN + n])
            pos += _LEN + n
            self.on_message(self, msg)
        if pos:
            del buf[:pos]

    def send(self, obj: Any) -> None:
        body = pickle.dumps(obj, protocol=5)
        self.transport.write(len(body).to_bytes(_LEN, "little") + body)  # type: ignore[union-attr]


def _new_loop() -> asyncio.AbstractEventLoop:
    import uvloop

    return uvloop.new_event_loop()


# -- server -------------------------------------------------------------------------------
def serve(path: str) -> None:
    loop = _new_loop()
    asyncio.set_event_loop(loop)

    def answer(proto: _Framed, msg: Any) -> None:
        kind, seq, _ = msg
        proto.send(("ok", seq, None))

    async def main() -> None:
        server = await loop.create_unix_server(lambda: _Framed(answer), path)
        stop = loop.create_future()
        loop.add_signal_handler(signal.SIGTERM, lambda: stop.done() or stop.set_result(None))
        async with server:
            await stop

    loop.run_until_complete(main())


# -- client -------------------------------------------------------------------------------
class _Client:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waiter: asyncio.Future[None] | None = None
        self.expect = 0
        self.got = 0

    def on_message(self, proto: _Framed, msg: Any) -> None:
        self.got += 1
        if self.got >= self.expect and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def roundtrips(self, proto: _Framed, n: int) -> list[float]:
        out = []
        clock = time.perf_counter
        for i in range(n):
            self.got, self.expect = 0, 1
            self.waiter = self.loop.create_future()
            t0 = clock()
            proto.send(("call", i, None))
            await self.waiter
            out.append(clock() - t0)
        return out

    async def pipelined(self, proto: _Framed, n: int) -> float:
        self.got, self.expect = 0, n
        self.waiter = self.loop.create_future()
        t0 = time.perf_counter()
        for i in range(n):
            proto.send(("call", i, None))
        await asyncio.wait_for(self.waiter, 60)
        return time.perf_counter() - t0


def run(quick: bool = False) -> dict[str, Any]:
    warmup, n, inflight, reps = (100, 500, 5000, 1) if quick else (200, 2000, 5000, 3)
    tmp = tempfile.mkdtemp(prefix="bench-baseline-")
    path = os.path.join(tmp, "s.sock")
    server = subprocess.Popen([sys.executable, "-m", "bench.baseline", "--serve", path], env=os.environ.copy())
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(path):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("baseline server did not start")
            time.sleep(0.01)
        loop = _new_loop()
        try:
            client = _Client(loop)

            async def main() -> dict[str, Any]:
                _, proto = await loop.create_unix_connection(lambda: _Framed(client.on_message), path)
                await asyncio.wait_for(client.roundtrips(proto, warmup), 30)
                lat = latency_stats(await asyncio.wait_for(client.roundtrips(proto, n), 60))
                await client.pipelined(proto, 500)  # warm-up
                rates = [inflight / await client.pipelined(proto, inflight) for _ in range(reps)]
                proto.transport.close()
                return {
                    "rtt_p50_us": lat["p50"],
                    "rtt_p99_us": lat["p99"],
                    "pipelined_msgs_s": statistics.median(rates),
                    "info": {"rtt": lat, "pipelined_reps": rates, "inflight": inflight},
                }

            return loop.run_until_complete(main())
        finally:
            loop.close()
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        try:
            os.unlink(path)
        except OSError:
            pass
        os.rmdir(tmp)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", metavar="PATH", required=True)
    serve(ap.parse_args().serve)
