"""The Monarch compatibility harness (bench/compat) without the Monarch wheel.

The alias must map module names and nothing else (a missing name has to fail, in
the controller and in worker processes alike), and the runner must keep the
outcomes of a file it kills at its deadline and name the test that was running.
Everything runs in subprocesses so that the alias never leaks into this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALIAS = ROOT / "bench" / "compat" / "alias"


def _run(code: str, tmp_path: Path, extra_path: list[Path] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    paths = [str(ALIAS), str(ROOT / "src")] + [str(p) for p in extra_path or []]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_monarch_modules_are_the_actormesh_module_objects(tmp_path: Path) -> None:
    proc = _run(
        """
        import monarch, monarch.actor, monarch.config, monarch.rdma, monarch.job, monarch.spmd
        import actormesh, actormesh.actor, actormesh.config, actormesh.rdma, actormesh.job, actormesh.spmd
        from monarch.actor import Actor, endpoint
        assert monarch is actormesh and monarch.actor is actormesh.actor
        assert monarch.config is actormesh.config and monarch.rdma is actormesh.rdma
        assert monarch.job is actormesh.job and monarch.spmd is actormesh.spmd
        assert Actor is actormesh.actor.Actor and endpoint is actormesh.actor.endpoint
        assert actormesh.actor.__spec__.name == "actormesh.actor", actormesh.actor.__spec__
        print("ok")
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_a_name_or_module_actormesh_lacks_fails_and_says_which(tmp_path: Path) -> None:
    proc = _run(
        """
        try:
            from monarch.actor import no_such_name_in_actormesh
        except ImportError as e:
            print("name:", e)
        try:
            import monarch._src.actor.host_mesh
        except ModuleNotFoundError as e:
            print("module:", e, e.name)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("name: cannot import name 'no_such_name_in_actormesh' from 'actormesh.actor'"), lines
    assert lines[1] == "module: No module named 'monarch._src' (monarch alias: actormesh has no module 'actormesh._src') monarch._src", lines


def test_worker_processes_resolve_monarch_imports_too(tmp_path: Path) -> None:
    # The actor class lives in a module that imports monarch.actor: the worker that
    # unpickles it must import that module, so it needs the alias (sitecustomize).
    (tmp_path / "compat_probe.py").write_text(
        textwrap.dedent(
            """
            import os
            from monarch.actor import Actor, endpoint

            class Probe(Actor):
                @endpoint
                def where(self) -> int:
                    import sys
                    assert "monarch_alias" in sys.modules
                    return os.getpid()
            """
        )
    )
    proc = _run(
        """
        import os
        from monarch.actor import this_host
        from compat_probe import Probe
        procs = this_host().spawn_procs(per_host={"procs": 1})
        try:
            pid = procs.spawn("probe", Probe).where.call_one().get(timeout=60)
            assert pid != os.getpid()
            print("ok")
        finally:
            procs.stop().get(timeout=60)
        """,
        tmp_path,
        extra_path=[tmp_path],
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_runner_keeps_outcomes_of_a_killed_file_and_names_the_hung_test(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text("")
    (tests / "test_sample.py").write_text(
        textwrap.dedent(
            """
            import subprocess
            import sys
            import time
            import pytest

            def test_a_passes():
                pass

            def test_b_fails():
                assert 1 == 2, "one is not two"

            @pytest.mark.skip(reason="not here")
            def test_c_skips():
                pass

            def test_d_hangs():
                # like Monarch's isolate_in_subprocess: a child in its own session
                child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
                with open("child.pid", "w") as f:
                    f.write(str(child.pid))
                time.sleep(600)
            """
        )
    )
    code = f"""
        import json, sys
        from pathlib import Path
        from bench.compat import runner
        impl = runner.Impl("monarch", sys.executable)  # no alias: the sample imports no monarch
        work = Path({str(tmp_path)!r}) / "work"
        work.mkdir()
        res = runner.run_test_file(impl, Path({str(tests)!r}), "test_sample.py", None, 300, 20, work)
        print(json.dumps(res))
        """
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["rc"] is None  # killed at the 20 s file limit
    got = {r["test"]: (r["outcome"], r["message"]) for r in res["rows"]}
    assert got["test_a_passes"] == ("passed", "")
    assert got["test_b_fails"][0] == "failed" and "one is not two" in got["test_b_fails"][1]
    assert got["test_c_skips"] == ("skipped", "Skipped: not here")
    assert got["test_d_hangs"][0] == "hang"
    child = int((tmp_path / "work" / "child.pid").read_text())
    assert not _alive(child), f"the hung test's child {child} outlived the run"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
