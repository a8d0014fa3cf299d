"""actormesh.spmd: torchrun's environment on proc meshes, DeviceMeshes named after
mesh dims, and unmodified torchrun-style scripts run with run_script."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import wait_for

from actormesh.actor import Actor, endpoint
from actormesh.spmd import ElasticEnv, ScriptError, run_script, setup_torch_elastic_env


def test_elastic_env_follows_the_mesh_point() -> None:
    env = ElasticEnv.for_point(("hosts", "gpus"), (2, 4), (1, 2), 6)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.group_rank, env.group_world_size) == (6, 2, 8, 4, 1, 2)
    v = env.variables("10.0.0.1", 29500)
    assert v["MASTER_ADDR"] == "10.0.0.1" and v["MASTER_PORT"] == "29500" and v["ROLE_NAME"] == "rank"
    assert v["ROLE_RANK"] == "6" and v["ROLE_WORLD_SIZE"] == "8" and v["ACTORMESH_MESH_DIMS"] == "hosts=2,gpus=4"
    # no "gpus" dim: the last dim is the local one
    env = ElasticEnv.for_point(("dp", "tp"), (3, 2), (2, 1), 5)
    assert (env.local_rank, env.local_world_size, env.group_rank, env.group_world_size) == (1, 2, 2, 3)
    assert ElasticEnv.for_point((), (), (), 0).world_size == 1


class EnvProbe(Actor):
    """Reads this proc's env, then builds a DeviceMesh from it."""

    @endpoint
    def env(self) -> dict[str, str]:
        keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
        return {k: os.environ[k] for k in keys}

    @endpoint
    def torch_imported(self) -> bool:
        return "torch" in sys.modules

    @endpoint
    def mesh(self) -> tuple[tuple[str, ...], int, int, float]:
        import torch
        import torch.distributed as dist

        from actormesh.spmd import init_process_group_and_mesh

        mesh = init_process_group_and_mesh({"hosts": "dp", "gpus": "tp"})
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh["tp"].get_group())  # tp peers: ranks 2h and 2h+1
        return tuple(mesh.mesh_dim_names), mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank(), float(t)

    def __cleanup__(self, exc: Exception | None) -> None:
        from actormesh.spmd import destroy_process_group

        destroy_process_group()


@pytest.mark.timeout(180)
def test_env_and_device_mesh_named_after_the_proc_mesh(spawn_procs: Any) -> None:
    procs = spawn_procs(per_host={"hosts": 2, "gpus": 2})
    setup_torch_elastic_env(procs, timeout=60)
    probes = procs.spawn("probe", EnvProbe)
    envs = probes.env.call().get(timeout=30).values()
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert not any(probes.torch_imported.call().get(timeout=30).values())  # the runtime never imports torch
    meshes = probes.mesh.call().get(timeout=120).values()
    assert [m[0] for m in meshes] == [("dp", "tp")] * 4
    assert [(m[1], m[2]) for m in meshes] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [m[3] for m in meshes] == [1.0, 1.0, 5.0, 5.0]


DDP_SCRIPT = """
import gc, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
model(torch.full((2, 4), float(rank))).sum().backward()
grad = model.module.weight.grad[0, 0].item()      # averaged over ranks
print(f"rank {rank}/{dist.get_world_size()} local {os.environ['LOCAL_RANK']} grad {grad:.1f} args {sys.argv[1:]}")
if "fail" in sys.argv and rank == 1:
    raise ValueError("boom on rank 1")
dist.barrier()                                    # rank 0 waits here for a rank that died
del model                                         # DDP's reducer goes before its process group (else gloo may abort at exit);
gc.collect()                                      # its hooks hold it in reference cycles that del alone leaves
dist.destroy_process_group()
"""


@pytest.fixture
def ddp_script(tmp_path: Path) -> str:
    pytest.importorskip("torch")
    path = tmp_path / "train_ddp.py"
    path.write_text(DDP_SCRIPT)
    return str(path)


@pytest.mark.timeout(180)
def test_run_script_runs_a_torchrun_script_unchanged(spawn_procs: Any, ddp_script: str, capsys: Any) -> None:
    procs = spawn_procs(per_host={"gpus": 2})
    codes = run_script(procs, ddp_script, ["--lr", "0.1"], timeout=120)
    assert codes.values() == [0, 0]
    out = capsys.readouterr().out
    # each rank's line, prefixed at the controller; DDP averaged the ranks' gradients
    assert "[rank0]: rank 0/2 local 0 grad 1.0 args ['--lr', '0.1']" in out
    assert "[rank1]: rank 1/2 local 1 grad 1.0 args ['--lr', '0.1']" in out


@pytest.mark.timeout(180)
def test_a_failing_rank_fails_the_call_with_its_traceback(spawn_procs: Any, ddp_script: str) -> None:
    procs = spawn_procs(per_host={"gpus": 2})
    lines: list[tuple[int, str, str]] = []
    started = time.monotonic()
    with pytest.raises(ScriptError) as info:
        run_script(procs, ddp_script, ["fail"], timeout=120, output=lambda *line: lines.append(line))
    err = info.value
    assert err.rank == 1 and err.exit_codes[1] != 0  # 1, or SIGABRT when gloo's threads die at exit
    assert "rank 1 failed first" in str(err)
    assert 'raise ValueError("boom on rank 1")' in str(err) and "ValueError: boom on rank 1" in str(err)
    assert err.exit_codes[0] != 0  # rank 0 did not wait for the collective timeout
    assert time.monotonic() - started < 60
    assert any(rank == 0 and "grad" in text for rank, _, text in lines)
    assert any(rank == 1 and stream == "stderr" and "boom" in text for rank, stream, text in lines)


def test_run_script_exit_codes_timeout_and_bad_arguments(spawn_procs: Any, tmp_path: Path) -> None:
    procs = spawn_procs(per_host={"gpus": 2})
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        if sys.argv[1] == "sleep":
            time.sleep(60)
        sys.exit(3 if os.environ["RANK"] == "1" else 0)
    """))
    codes = run_script(procs, str(script), ["exit"], check=False, output=lambda *a: None, timeout=60)
    assert codes.values()[1] == 3 and codes.values()[0] in (0, -15)  # rank 0 may be terminated first (fail fast)
    with pytest.raises(ScriptError, match="rank 1 failed first with exit code 3"):
        run_script(procs, str(script), ["exit"], output=lambda *a: None, timeout=60)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 2"):
        run_script(procs, str(script), ["sleep"], timeout=2)
    assert time.monotonic() - started < 30
    with pytest.raises(FileNotFoundError, match="no such script"):
        run_script(procs, str(tmp_path / "missing.py"))
    with pytest.raises(TypeError, match="sequence of strings"):
        run_script(procs, str(script), "exit")
    codes = run_script(procs, "json.tool", ["--help"], module=True, output=lambda *a: None, timeout=60)
    assert codes.values() == [0, 0]


def test_a_dead_proc_fails_the_call_and_stops_the_other_ranks(spawn_procs: Any, tmp_path: Path, faults: Any) -> None:
    from actormesh.actor import SupervisionError

    procs = spawn_procs(per_host={"gpus": 2})
    script = tmp_path / "kill_proc.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getppid(), signal.SIGKILL)   # the proc running rank 1 dies
        time.sleep(60)
    """))
    started = time.monotonic()
    with pytest.raises(SupervisionError, match="(?s)spmd.*gpus': 1/2.*Killed"):
        run_script(procs, str(script), output=lambda *a: None, timeout=60)
    assert time.monotonic() - started < 20  # rank 0 was terminated, not waited for
    faults.wait(1)

    def scripts_left() -> list[Any]:
        left = []
        for p in psutil.process_iter(["cmdline"]):
            if str(script) in " ".join(p.info["cmdline"] or ()):
                left.append(p)
        return left

    wait_for(lambda: not scripts_left(), timeout=10)  # rank 1's script died with its proc (orphans escape the leak check)
