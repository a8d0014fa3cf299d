"""Procs forked from a warm zygote behave as procs started fresh: same settings,
environment, name in ``ps``, exit reports; and the zygote ends with its spawner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from actormesh import config
from actormesh.actor import Actor, SupervisionError, endpoint, this_host
from actormesh.runtime import current_runtime
from conftest import freeze, wait_for

T = 30


class Probe(Actor):
    @endpoint
    def facts(self) -> dict:
        from actormesh.config import get_config

        return {"pid": os.getpid(), "ppid": os.getppid(), "argv0": sys.argv[0],
                "env": os.environ.get("ACTORMESH_TEST_ZYGOTE"), "cleanup": get_config().cleanup_timeout}

    @endpoint
    def echo(self, line: str) -> None:
        print(line, flush=True)


def _cmdline(pid: int) -> list[str]:
    return psutil.Process(pid).cmdline()


def test_procs_are_forks_of_one_zygote_that_take_the_settings_of_their_spawn(spawn_procs, monkeypatch):
    first = spawn_procs(per_host={"gpus": 2}).spawn("p", Probe).facts.call().get(timeout=T).values()
    # Set after the zygote started: a fork must see them as a fresh interpreter would.
    monkeypatch.setenv("ACTORMESH_TEST_ZYGOTE", "later")
    with config.configured(cleanup_timeout=7.5):
        procs = spawn_procs(per_host={"gpus": 2})
    later = procs.spawn("p", Probe).facts.call().get(timeout=T).values()
    zygotes = {f["ppid"] for f in [*first, *later]}
    assert len(zygotes) == 1, zygotes
    (zygote,) = zygotes
    assert psutil.Process(zygote).ppid() == os.getpid()
    assert _cmdline(zygote)[-2:] == ["-m", "actormesh.zygote"]
    for f in later:
        assert f["env"] == "later" and f["cleanup"] == 7.5
        assert _cmdline(f["pid"])[-2:] == ["-m", "actormesh.worker"]  # what tools look for
        assert f["argv0"].endswith(os.path.join("actormesh", "worker.py"))
    assert [f["env"] for f in first] == [None, None]


def test_with_the_zygote_off_each_proc_is_a_fresh_interpreter(spawn_procs):
    with config.configured(proc_zygote=False):
        procs = spawn_procs(per_host={"gpus": 2})
    facts = procs.spawn("p", Probe).facts.call().get(timeout=T).values()
    assert [f["ppid"] for f in facts] == [os.getpid(), os.getpid()]


def test_a_dead_zygote_takes_its_procs_and_the_next_spawn_starts_another(spawn_procs, faults):
    procs = spawn_procs(per_host={"gpus": 2})
    p = procs.spawn("p", Probe)
    facts = p.facts.call().get(timeout=T).values()
    zygote = facts[0]["ppid"]
    os.kill(zygote, signal.SIGKILL)
    faults.wait(1, timeout=T)
    with pytest.raises(SupervisionError, match=r"Killed\(sig=9\)"):
        p.facts.call().get(timeout=T)
    for f in facts:
        wait_for(lambda pid=f["pid"]: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, timeout=T)
    again = spawn_procs(per_host={"gpus": 1}).spawn("p", Probe).facts.call().get(timeout=T).values()
    assert again[0]["ppid"] != zygote and _cmdline(again[0]["ppid"])[-2:] == ["-m", "actormesh.zygote"]


def test_a_forked_procs_output_reaches_its_controller(spawn_procs, capfd):
    procs = spawn_procs(per_host={"gpus": 1})
    procs.spawn("p", Probe).echo.call_one("said-by-a-forked-proc").get(timeout=T)
    procs.stop().get(timeout=T)  # its output pipe is read to the end
    assert "said-by-a-forked-proc" in capfd.readouterr().out


_CONTROLLER = textwrap.dedent("""
    import os, sys
    from actormesh.actor import Actor, endpoint, this_host

    class Probe(Actor):
        @endpoint
        def ppid(self):
            return os.getpid(), os.getppid()

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    pairs = procs.spawn("p", Probe).ppid.call().get(timeout=30).values()
    print(" ".join(str(p) for pair in pairs for p in pair), flush=True)
    if sys.argv[1] == "wait":
        sys.stdin.read()
""")


@pytest.mark.parametrize("how", ["exits", "sigkilled"])
def test_the_zygote_and_its_procs_end_with_their_controller(tmp_path, how):
    script = tmp_path / "controller.py"
    script.write_text(_CONTROLLER)
    proc = subprocess.Popen([sys.executable, str(script), "wait" if how == "sigkilled" else "exit"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids: set[int] = set()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        pids = {int(p) for p in line.split()}
        assert len(pids) == 3, line  # two procs and their zygote
        if how == "sigkilled":
            proc.kill()
        assert proc.wait(timeout=T) in (0, -signal.SIGKILL)
        for pid in pids:
            wait_for(lambda pid=pid: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, timeout=T)
    finally:
        proc.kill()
        proc.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def test_a_stopped_zygote_fails_its_spawn_in_time_and_the_next_one_uses_a_new_zygote(spawn_procs):
    p = spawn_procs(per_host={"gpus": 1}).spawn("p", Probe)
    (before,) = p.facts.call().get(timeout=T).values()
    stuck = before["ppid"]
    freeze(stuck)
    try:
        with config.configured(proc_spawn_timeout=2.0):
            late = spawn_procs(per_host={"gpus": 1})
            with pytest.raises(Exception, match="did not report ready within 2s"):
                late.initialized.get(timeout=T)
        fresh = spawn_procs(per_host={"gpus": 1}).spawn("p", Probe).facts.call().get(timeout=T).values()
        assert fresh[0]["ppid"] not in (stuck, os.getpid())
        assert p.facts.call().get(timeout=T).values()[0]["pid"] == before["pid"]  # its procs live on
    finally:
        os.kill(stuck, signal.SIGCONT)
    # The spawn it owed, forked now after all, is killed at once: nothing is left behind.
    (old,) = current_runtime().zygote.retired
    wait_for(lambda: not old._waiting, timeout=T)  # it answered: the fork happened
    wait_for(lambda: {c.pid for c in psutil.Process(stuck).children()} <= {before["pid"]}, timeout=T)


def test_a_proc_spawned_after_a_chdir_imports_from_the_new_directory(spawn_procs, tmp_path, monkeypatch):
    spawn_procs(per_host={"gpus": 1}).initialized.get(timeout=T)  # the zygote starts here, in the old directory
    (tmp_path / "zygote_cwd_probe.py").write_text("WHERE = 'new cwd'\n")
    monkeypatch.chdir(tmp_path)
    procs = spawn_procs(per_host={"gpus": 1})
    assert procs.spawn("p", Importer).where.call_one().get(timeout=T) == "new cwd"


class Importer(Actor):
    @endpoint
    def where(self) -> str:
        import zygote_cwd_probe

        return zygote_cwd_probe.WHERE
