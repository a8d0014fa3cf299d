"""``actormesh dashboard script.py`` serves the script's dashboard; ``actormesh top`` reads it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="needs the dashboard extra: pip install 'actormesh[dashboard]'")

from actormesh.cli import main  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from actormesh.actor import Actor, endpoint, this_host

    class Echo(Actor):
        @endpoint
        def echo(self, x):
            return x

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    mesh = procs.spawn("cli_echoes", Echo)
    mesh.echo.call(1).get(timeout=60)
    open(sys.argv[1], "w").write("ready")
    deadline = time.monotonic() + 90
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.05)
    procs.stop().get(timeout=30)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(150)
def test_dashboard_runs_a_script_and_top_shows_its_job(tmp_path: Path) -> None:
    script, ready, done = tmp_path / "job.py", tmp_path / "ready", tmp_path / "done"
    script.write_text(SCRIPT)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORMESH_DASHBOARD")}
    cmd = [sys.executable, "-m", "actormesh.cli", "dashboard", "--port", str(port), str(script), str(ready), str(done)]
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert job.poll() is None, job.stdout.read() if job.stdout else ""
            assert time.monotonic() < deadline, "the job did not get ready"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/"
        top = ""
        while "cli_echoes" not in top and time.monotonic() < deadline:
            out = subprocess.run([sys.executable, "-m", "actormesh.cli", "top", "--once", "--url", url],
                                 capture_output=True, text=True, timeout=60, env={**env, "COLUMNS": "200"})
            assert out.returncode == 0, out.stderr
            top = out.stdout
        assert "cli_echoes" in top and "running" in top and "actormesh top" in top
        listed = subprocess.run([sys.executable, "-m", "actormesh.cli", "dashboard"], capture_output=True, text=True, timeout=60, env=env)
        assert url in listed.stdout
        done.write_text("done")
        assert job.wait(timeout=60) == 0
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)


def test_top_without_a_dashboard_says_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", "--once", "--url", f"http://127.0.0.1:{_free_port()}/"]) == 1
    assert "does not answer" in capsys.readouterr().err


def test_dashboard_with_a_missing_script_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dashboard", "/nonexistent/job.py"]) == 2
    assert "no script" in capsys.readouterr().err
