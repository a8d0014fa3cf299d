"""Serve a tiny Llama over OpenAI's API with 2 replicas of TP=2 (4 local procs),
query it with the official ``openai`` client, kill one replica mid-load and watch
it recover.

    python examples/serve.py

The model is made on the spot (random weights, a tokenizer trained on a few
sentences): its text is noise, but every part of the path is real: HTTP,
routing, batching, tensor parallelism across procs, supervision and rebuild.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import openai

from actormesh.serve import serve_openai
from actormesh.serve.tiny import make_tiny_llama

CLIENTS = 6  # concurrent users
REQUESTS_PER_CLIENT = 12


def load(client: openai.OpenAI, results: Counter[str], lock: threading.Lock, started: threading.Event) -> None:
    """One user: streaming chat requests, one after another; count how each ended."""
    for i in range(REQUESTS_PER_CLIENT):
        try:
            stream = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"hello actors {i}"}], max_tokens=12, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            outcome = "ok" if text is not None else "empty"
        except openai.APIError as exc:  # a replica died with it in flight: may or may not have run
            outcome = f"failed ({getattr(exc, 'status_code', None) or 'mid-stream'}: {str(exc.message)[:60]}...)"
        with lock:
            results[outcome] += 1
            if sum(results.values()) >= 8:
                started.set()


def rank0_pid(deployment: object, slot: int) -> int:
    replica = next(r for r in deployment.llm.service.replicas() if r.slot == slot)  # type: ignore[attr-defined]
    infos = replica.mesh.info.call().get(timeout=60).values()
    return next(i["pid"] for i in infos if i["rank"] == 0)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny")
        t0 = time.monotonic()
        deployment = serve_openai(model, replicas=2, tp=2, port=0, max_slots=8, block=False)
        assert deployment is not None
        print(f"serving at {deployment.url}/v1: 2 replicas x TP=2 up in {time.monotonic() - t0:.1f}s")
        try:
            # max_retries=0: show the failures the kill causes instead of retrying them
            client = openai.OpenAI(base_url=deployment.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            print("models:", [m.id for m in client.models.list().data])
            reply = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0)
            print(f"completion: {reply.choices[0].text!r} ({reply.usage.completion_tokens} tokens)")

            results: Counter[str] = Counter()
            lock, started = threading.Lock(), threading.Event()
            users = [threading.Thread(target=load, args=(client, results, lock, started)) for _ in range(CLIENTS)]
            for u in users:
                u.start()
            started.wait(120)
            pid = rank0_pid(deployment, 0)
            print(f"load running ({sum(results.values())} requests done); SIGKILL replica 0's rank 0 (pid {pid})")
            os.kill(pid, signal.SIGKILL)
            for u in users:
                u.join(300)

            print("requests under load:")
            for outcome, n in sorted(results.items()):
                print(f"  {n:3d}  {outcome}")
            deadline = time.monotonic() + 180
            while not (deployment.llm.healthy() and all(r.state == "healthy" for r in deployment.llm.service.replicas())):
                if time.monotonic() > deadline:
                    raise TimeoutError("replica 0 was not rebuilt within 180s")
                time.sleep(0.2)
            for _ in range(8):  # both replicas serve again
                client.completions.create(model="tiny", prompt="after the rebuild", max_tokens=4)
            for r in deployment.llm.service.metrics().replicas:
                print(f"replica {r.replica}: {r.state}, restarts={r.restarts}, requests={r.requests}, "
                      f"failed in flight={r.failed_in_flight}")
        finally:
            deployment.stop()
        print("stopped: every proc is gone")


if __name__ == "__main__":
    main()
