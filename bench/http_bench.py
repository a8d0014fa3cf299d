"""HTTP front door: requests/s and time to first token through the OpenAI endpoint
vs calling the service directly.

Run: python -m bench.http_bench [--quick] [--replicas N] [--tp T]
Prints a table and writes bench/results/http.json.

One ``serve_openai`` deployment of a tiny random Llama (``actormesh.serve.tiny``)
serves both sides of the comparison, in one run:

* **direct**: asyncio tasks iterate ``deployment.llm.generate(ids, params)``
  (the ``LLMService`` TokenGenerator: routing, replicas, token streaming, no HTTP);
* **http**: the official ``openai.AsyncOpenAI`` client streams
  ``/v1/completions`` with the same prompt (as token ids), so the difference is
  HTTP, JSON, server-sent events and detokenizing. The client runs in a process
  of its own (as a remote client would), so its parsing does not share the
  server's interpreter lock.

Each side runs ``concurrency`` users issuing ``requests`` fixed-length requests
(``max_tokens`` tokens, ``ignore_eos``); the sides alternate round by round so
machine noise hits both alike. Figures: requests/s (median over rounds) and
time to first token (p50/p99 over all requests; first SSE chunk for http, first
token for direct), with the ratios http / direct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from actormesh.serve import SamplingParams, serve_openai
from actormesh.serve.tiny import make_tiny_llama

from bench._util import latency_stats

PROMPT = [5, 17, 42, 99, 7, 256, 31, 64]


async def _direct_one(llm: Any, params: SamplingParams) -> float:
    start = time.perf_counter()
    first = None
    async for _ in llm.generate(PROMPT, params):
        if first is None:
            first = time.perf_counter() - start
    assert first is not None
    return first


async def _http_one(client: openai.AsyncOpenAI, max_tokens: int) -> float:
    start = time.perf_counter()
    first = None
    stream = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    async for _ in stream:
        if first is None:
            first = time.perf_counter() - start
    assert first is not None
    return first


async def _round(one: Any, concurrency: int, requests: int) -> tuple[float, list[float]]:
    """``requests`` calls of ``one()`` by ``concurrency`` users: (requests/s, first-token times)."""
    todo = iter(range(requests))
    ttfts: list[float] = []

    async def user() -> None:
        for _ in todo:
            ttfts.append(await one())

    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(user() for _ in range(concurrency))), 600)
    return requests / (time.perf_counter() - start), ttfts


async def _httpx_one(client: httpx.AsyncClient, max_tokens: int) -> float:
    """One streamed completion read as raw server-sent events (each chunk parsed with json)."""
    start = time.perf_counter()
    first = None
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[6:])
                if first is None:
                    first = time.perf_counter() - start
    assert first is not None
    return first


async def _client_main(url: str, kind: str, concurrency: int, requests: int, max_tokens: int) -> None:
    """The http side's load, run in its own process: prints ``{"rps", "ttfts"}``."""
    if kind == "openai":
        client: Any = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        one = lambda: _http_one(client, max_tokens)  # noqa: E731
    else:
        client = httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=concurrency))
        one = lambda: _httpx_one(client, max_tokens)  # noqa: E731
    await _round(one, concurrency, concurrency)  # warm-up: connections, imports
    rate, firsts = await _round(one, concurrency, requests)
    await (client.close() if kind == "openai" else client.aclose())
    print(json.dumps({"rps": rate, "ttfts": firsts}))


async def _http_round(url: str, args: argparse.Namespace) -> tuple[float, list[float]]:
    cmd = [sys.executable, "-m", "bench.http_bench", "--client", url, "--client-kind", args.client_kind,
           "--concurrency", str(args.concurrency),
           "--requests", str(args.requests), "--max-tokens", str(args.max_tokens)]
    done = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the http client process failed: {done.stderr[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return got["rps"], got["ttfts"]


async def _compare(deployment: Any, args: argparse.Namespace) -> dict[str, Any]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)  # no stop ids: like ignore_eos
    await _round(lambda: _direct_one(deployment.llm, params), args.concurrency, args.concurrency)  # warm-up
    rps: dict[str, list[float]] = {"direct": [], "http": []}
    ttft: dict[str, list[float]] = {"direct": [], "http": []}
    for r in range(args.rounds):
        for name in ("direct", "http") if r % 2 == 0 else ("http", "direct"):
            if name == "http":
                rate, firsts = await _http_round(deployment.url, args)
            else:
                rate, firsts = await _round(lambda: _direct_one(deployment.llm, params), args.concurrency, args.requests)
            rps[name].append(rate)
            ttft[name] += firsts
    out: dict[str, Any] = {}
    for name in ("direct", "http"):
        out[name] = {"requests_per_s": statistics.median(rps[name]), "rounds": rps[name],
                     "ttft_ms": latency_stats(ttft[name], scale=1e3)}
    out["ratio_requests_per_s_http_over_direct"] = out["http"]["requests_per_s"] / out["direct"]["requests_per_s"]
    out["ratio_ttft_p50_http_over_direct"] = out["http"]["ttft_ms"]["p50"] / out["direct"]["ttft_ms"]["p50"]
    out["ratio_ttft_p99_http_over_direct"] = out["http"]["ttft_ms"]["p99"] / out["direct"]["ttft_ms"]["p99"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=None, help="requests per round (default 64; 16 with --quick)")
    ap.add_argument("--client-kind", choices=["openai", "httpx"], default="openai",
                    help="the http side's client: the official openai package, or raw httpx reading the events")
    ap.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)  # internal: the http side's process
    args = ap.parse_args()
    if args.client:
        asyncio.run(_client_main(args.client, args.client_kind, args.concurrency, args.requests, args.max_tokens))
        return
    args.requests = args.requests or (16 if args.quick else 64)
    args.rounds = 2 if args.quick else 4
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny")
        deployment = serve_openai(model, replicas=args.replicas, tp=args.tp, port=0, max_slots=args.concurrency,
                                  block=False)
        assert deployment is not None
        try:
            result = asyncio.run(_compare(deployment, args))
        finally:
            deployment.stop()
    result["config"] = {k: v for k, v in vars(args).items()}
    print(f"{'':8} {'req/s':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}")
    for name in ("direct", "http"):
        r = result[name]
        print(f"{name:8} {r['requests_per_s']:8.1f} {r['ttft_ms']['p50']:12.1f} {r['ttft_ms']['p99']:12.1f}")
    print(f"http / direct: requests/s x{result['ratio_requests_per_s_http_over_direct']:.2f}, "
          f"TTFT p50 x{result['ratio_ttft_p50_http_over_direct']:.2f}, p99 x{result['ratio_ttft_p99_http_over_direct']:.2f}")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "http.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
