"""A mesh handle used by the wrong controller fails at once with the cause named:
another job's handle (a different secret), or a handle whose job has ended."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import time

import pytest

from actormesh.actor import Actor, endpoint
from actormesh.errors import SupervisionError


class Echo(Actor):
    @endpoint
    def echo(self, x: object) -> object:
        return x


OWNER = textwrap.dedent(
    """
    import pickle, sys
    sys.path.insert(0, sys.argv[2])
    from actormesh.actor import this_host
    from test_foreign_handles import Echo

    procs = this_host().spawn_procs(per_host={"gpus": 1})
    mesh = procs.spawn("echo", Echo)
    assert mesh.echo.call_one(1).get(timeout=30) == 1
    with open(sys.argv[1], "wb") as f:
        pickle.dump(mesh, f)
    print("ready", flush=True)
    sys.stdin.readline()  # hold the job open until the test says so
    procs.stop().get(timeout=30)
    """
)


@pytest.fixture
def owner(tmp_path):
    """Another controller (another job, another secret) that owns a mesh."""
    handle = tmp_path / "handle.pkl"
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(handle), os.path.dirname(__file__)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "ready", f"owner controller did not start (exit {proc.poll()})"
        yield proc, handle
    finally:
        if proc.poll() is None:
            proc.stdin.close()  # type: ignore[union-attr]
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_handle_from_another_live_job_fails_at_once_naming_the_cause(owner):
    _, handle = owner
    mesh = pickle.loads(handle.read_bytes())
    start = time.monotonic()
    with pytest.raises(SupervisionError, match="authentication failed: this handle belongs to another job"):
        mesh.echo.call_one(2).get(timeout=20)
    assert time.monotonic() - start < 5  # not the 10 s connect budget


def test_handle_from_a_job_that_ended_fails_fast(owner):
    proc, handle = owner
    proc.stdin.close()  # type: ignore[union-attr]
    assert proc.wait(timeout=30) == 0
    mesh = pickle.loads(handle.read_bytes())
    start = time.monotonic()
    with pytest.raises(SupervisionError, match="unreachable"):
        mesh.echo.call_one(3).get(timeout=20)
    assert time.monotonic() - start < 5


def test_unix_address_whose_directory_is_gone_fails_without_retrying():
    import asyncio

    from actormesh.errors import TransportError
    from actormesh.transport import connect

    async def dial() -> None:
        await connect(
            "unix:/tmp/actormesh-no-such-dir-1b2c/worker.sock", b"s" * 32,
            on_frame=lambda *a: None, on_close=lambda *a: None,
            max_frame_bytes=1 << 20, handshake_timeout_s=5, timeout_s=10,
        )

    start = time.monotonic()
    with pytest.raises(TransportError, match="no longer exists"):
        asyncio.run(dial())
    assert time.monotonic() - start < 1
