"""breakpoint() in actors, driven from a real console (pexpect) on 2 procs.

Each test runs a controller script in its own process (a job of 2 procs with a
sync actor calling ``breakpoint()`` and an async actor calling
``pdb.set_trace()`` on both ranks, plus a third actor on the same procs) and
drives the console a person would use: ``actormesh debug`` in a terminal, or
``debug_controller().enter`` on the controller's own terminal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

ACTORS = '''
import pdb
from actormesh.actor import Actor, current_rank, endpoint


def scale(v):
    return v * 10


class Debugee(Actor):
    @endpoint
    def to_debug(self, x):
        y = x + current_rank().rank
        breakpoint()
        y = scale(y)
        return y


class AsyncDebugee(Actor):
    @endpoint
    async def to_debug(self, x):
        y = x + 100 + current_rank().rank
        pdb.set_trace()
        y = y * 10
        return y


class Other(Actor):
    @endpoint
    def ping(self):
        return "pong"
'''

JOB = '''
import sys, time
import actormesh.actor as am
from actormesh.actor import this_host, debug_controller
from dbg_actors import AsyncDebugee, Debugee, Other

am.unhandled_fault_hook = lambda failure: print(f"FAULT {failure.mesh_name}", flush=True)

mode = sys.argv[1]
if mode == "cli":
    debug_controller()  # the debug socket listens before any breakpoint
print("READY", flush=True)
if mode == "cli":
    # A non-interactive controller skips breakpoints nobody can attach to: wait until the
    # test's console is connected (its prompt is up) before any actor reaches one.
    sys.stdin.readline()
procs = this_host().spawn_procs(per_host={"gpus": 2})
sync_mesh = procs.spawn("debugee", Debugee)
async_mesh = procs.spawn("adebugee", AsyncDebugee)
other = procs.spawn("other", Other)
futs = [sync_mesh.to_debug.call(1), async_mesh.to_debug.call(1)]
if mode in ("cli", "enter"):
    dc = debug_controller()
    deadline = time.monotonic() + 90
    while len(dc.list.call_one(False).get(timeout=30)) < 4:
        assert time.monotonic() < deadline, "the four sessions never registered"
        time.sleep(0.1)
    # All four actors are paused; their procs still serve the other actor.
    pongs = other.ping.call().get(timeout=30)
    paused = len(dc.list.call_one(False).get(timeout=30))
    print(f"OTHER_WHILE_PAUSED {sorted(pongs.values())} sessions={paused}", flush=True)
if mode == "enter":
    dc.enter.call_one().get()
for fut in futs:
    try:
        print(f"RESULT {sorted(fut.get(timeout=300).values())}", flush=True)  # one write: log lines interleave
    except Exception as exc:
        print(f"FAILED {type(exc).__name__}", flush=True)
print("DONE", flush=True)
if mode == "cli":
    sys.stdin.readline()  # the test says when the console is done (a job that ends closes the console)
'''

PROMPT = "actormesh_dbg> "
PDB = r"\(Pdb\) "


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    (tmp_path / "dbg_actors.py").write_text(ACTORS)
    (tmp_path / "job.py").write_text(JOB)
    return tmp_path


def _env(attach_timeout_s: float, ci: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "GITHUB_ACTIONS", "PYTHONBREAKPOINT")}
    env["ACTORMESH_DEBUG_ATTACH_TIMEOUT"] = str(attach_timeout_s)
    env["PYTHONUNBUFFERED"] = "1"
    if ci:
        env["CI"] = "true"
    return env


def _wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        out = path.read_text()
        if text in out:
            return out
        assert proc.poll() is None, f"the job exited ({proc.returncode}) before printing {text!r}:\n{out}"
        assert time.monotonic() < deadline, f"the job did not print {text!r} within {timeout_s}s:\n{out}"
        time.sleep(0.05)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _list_until(console: pexpect.spawn, sessions: int, timeout_s: float = 90) -> str:
    """Type ``list`` until it shows ``sessions`` paused sessions; return the table."""
    deadline = time.monotonic() + timeout_s
    while True:
        console.sendline("list")
        console.expect(PROMPT)
        table = console.before
        if sum(" paused" in line for line in table.splitlines()) >= sessions:
            return table
        assert time.monotonic() < deadline, f"list never showed {sessions} sessions:\n{table}"
        time.sleep(0.2)


def _assert_key_checked(pid: int, tmp: Path) -> None:
    """The debug socket and key are private, and a console without the key gets nothing."""
    from actormesh.debug import DebugClientError, find_debug_servers, run_client

    (server,) = [s for s in find_debug_servers() if s.pid == pid]
    for name in ("debug.sock", "debug.key"):
        assert os.stat(os.path.join(server.job_dir, name)).st_mode & 0o777 == 0o600
    fake = tmp / "fake-job-dir"
    fake.mkdir()
    (fake / "debug.sock").symlink_to(server.socket_path)
    (fake / "debug.key").write_text("00" * 32)
    with pytest.raises(DebugClientError, match="handshake|connect"):
        run_client(str(fake), connect_timeout_s=10, idle_timeout_s=10)


@pytest.mark.timeout(240)
def test_actormesh_debug_console_on_two_procs(job_dir: Path) -> None:
    env = _env(attach_timeout_s=60)
    out_path = job_dir / "job.out"
    with open(out_path, "w") as out:
        job = subprocess.Popen([sys.executable, "job.py", "cli"], cwd=job_dir, env=env, stdin=subprocess.PIPE,
                               stdout=out, stderr=subprocess.STDOUT)
    console = None
    try:
        _wait_for_text(out_path, "READY", job, 60)
        console = pexpect.spawn(sys.executable, ["-m", "actormesh.cli", "debug", "--pid", str(job.pid)], cwd=str(job_dir),
                                env=env, encoding="utf-8", timeout=60, dimensions=(50, 200))
        console.expect(PROMPT)
        assert job.stdin is not None
        job.stdin.write(b"console connected\n")
        job.stdin.flush()
        table = _list_until(console, 4)
        for actor, line in (("debugee", 15), ("adebugee", 24)):  # the line after the breakpoint
            for rank in (0, 1):
                row = next(r for r in table.splitlines() if r.split()[:2] == [actor, str(rank)])
                assert f"to_debug  {job_dir}/dbg_actors.py:{line}  paused" in row, row

        # one console at a time; a wrong console key is refused in the handshake
        second = pexpect.spawn(sys.executable, ["-m", "actormesh.cli", "debug", "--pid", str(job.pid)], cwd=str(job_dir),
                               env=env, encoding="utf-8", timeout=60)
        second.expect("another debug console is connected")
        second.expect(pexpect.EOF)
        second.close()
        assert second.exitstatus == 1
        _assert_key_checked(job.pid, job_dir)

        # the other actor on those procs answered while all four were paused
        assert "OTHER_WHILE_PAUSED ['pong', 'pong'] sessions=4" in _wait_for_text(out_path, "OTHER_WHILE_PAUSED", job, 60)

        console.sendline("attach debugee 0")
        console.expect(PDB)
        assert "-> y = scale(y)" in console.before
        for command, expected in [
            ("where", "to_debug()"),
            ("list", "breakpoint()"),
            ("p y", "1"),
            ("s", "scale()"),  # into the helper
            ("up", "-> y = scale(y)"),
            ("p y", "1"),
            ("down", "-> def scale(v):"),  # --Call-- stops on the def line
            ("p v", "1"),
            ("r", "--Return--"),
            ("n", "-> return y"),
            ("p y", "10"),
        ]:
            console.sendline(command)
            console.expect(PDB)
            assert expected in console.before, (command, console.before)
            if command == "where":
                assert "_cell.py" not in console.before and "threading.py" not in console.before
        console.sendline("detach")
        console.expect(PROMPT)

        console.sendline("cast debugee ranks(0,1) p y")
        console.expect(PROMPT)
        assert "[debugee rank 0]\r\n10" in console.before and "[debugee rank 1]\r\n2" in console.before
        console.sendline("cast adebugee ranks(0,1) p y")
        console.expect(PROMPT)
        assert "[adebugee rank 0]\r\n101" in console.before and "[adebugee rank 1]\r\n102" in console.before

        console.sendline("attach adebugee 1")  # the async actor: a full prompt too
        console.expect(PDB)
        console.sendline("c")
        console.expect(PROMPT)
        assert "adebugee rank 1 continued: its session is over" in console.before

        console.sendline("continue")
        console.expect(PROMPT)
        assert "continued 3 session(s)" in console.before
        out = _wait_for_text(out_path, "DONE", job, 120)
        assert "RESULT [10, 20]" in out and "RESULT [1010, 1020]" in out
        assert "FAULT" not in out  # paused procs kept heartbeating: nobody declared them hung
        console.sendline("quit")
        console.expect(pexpect.EOF)
        console.close()
        assert console.exitstatus == 0
        job.communicate(b"\n", timeout=60)
        assert job.returncode == 0
    finally:
        if console is not None:
            console.close(force=True)
        _stop(job)


@pytest.mark.timeout(240)
def test_console_on_the_controllers_own_terminal(job_dir: Path) -> None:
    env = _env(attach_timeout_s=60)
    job = pexpect.spawn(sys.executable, ["job.py", "enter"], cwd=str(job_dir), env=env, encoding="utf-8", timeout=120,
                        dimensions=(50, 200))
    try:
        job.expect("OTHER_WHILE_PAUSED ")
        job.expect(PROMPT)
        table = _list_until(job, 4)
        assert "debugee" in table and "adebugee" in table
        job.sendline("attach debugee 1")
        job.expect(PDB)
        job.sendline("p y")
        job.expect(PDB)
        assert job.before.split()[-1] == "2"
        job.sendline("c")
        job.expect(PROMPT)
        assert "debugee rank 1 continued: its session is over" in job.before
        job.sendline("attach nobody 0")
        job.expect(PROMPT)
        assert "no session for actor 'nobody' rank 0" in job.before

        # the proc of rank 1 dies while its async actor is paused: the session leaves the list
        row = next(r for r in _list_until(job, 3).splitlines() if r.split()[:2] == ["adebugee", "1"])
        os.kill(int(row.split()[4]), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while "adebugee  1" in _list_until(job, 2):
            assert time.monotonic() < deadline, "the dead proc's session stayed listed"
            time.sleep(0.2)

        job.sendline("continue")
        job.expect(PROMPT)
        assert "continued 2 session(s)" in job.before
        job.sendline("quit")
        job.expect("DONE")
        out = job.before
        assert "RESULT [10, 20]" in out and "FAILED ActorDiedError" in out, out  # the killed rank failed its call (a SupervisionError: died)
        job.expect(pexpect.EOF)
    finally:
        job.close(force=True)


@pytest.mark.timeout(120)
def test_breakpoint_is_skipped_without_a_console(job_dir: Path) -> None:
    """No TTY and CI set: every breakpoint is skipped at once, with a warning naming actor and file:line."""
    out_path = job_dir / "job.out"
    with open(out_path, "w") as out:
        job = subprocess.Popen([sys.executable, "job.py", "skip"], cwd=job_dir, env=_env(attach_timeout_s=600, ci=True),
                               stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        out_text = _wait_for_text(out_path, "DONE", job, 100)
        assert job.wait(30) == 0
    finally:
        _stop(job)
    assert "RESULT [10, 20]" in out_text and "RESULT [1010, 1020]" in out_text
    for actor, line in (("debugee", 14), ("adebugee", 23)):
        for rank in (0, 1):
            assert f"breakpoint() in {actor} rank {rank} at {job_dir}/dbg_actors.py:{line} skipped" in out_text, out_text
    assert "not interactive" in out_text


@pytest.mark.timeout(120)
def test_paused_actor_continues_when_nobody_attaches(job_dir: Path) -> None:
    """A controller on a terminal waits debug_attach_timeout for a console, then the actors go on."""
    job = pexpect.spawn(sys.executable, ["job.py", "skip"], cwd=str(job_dir), env=_env(attach_timeout_s=2), encoding="utf-8",
                        timeout=100, dimensions=(50, 200))
    try:
        job.expect("DONE")
        out = job.before
        job.expect(pexpect.EOF)
    finally:
        job.close(force=True)
    assert "run `actormesh debug` within 2s" in out
    assert "no debugger for 2s (debug_attach_timeout); continuing" in out
    assert "RESULT [10, 20]" in out and "RESULT [1010, 1020]" in out
