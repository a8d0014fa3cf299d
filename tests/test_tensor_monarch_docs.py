"""Monarch's public docs examples for distributed tensors, with the imports swapped
(``monarch`` -> ``actormesh``): getting_started.py's "Distributed Tensors" and
"Free Remote Functions", distributed_tensors.py's collectives, pipelining and DDP."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import actormesh as monarch  # noqa: E402
from actormesh.actor import Actor, Channel, endpoint, send, this_host  # noqa: E402

pytestmark = pytest.mark.timeout(180)


class Trainer(Actor):
    @endpoint
    def step(self, t) -> float:
        return float(t.sum())


class LinearActor(Actor):
    def __init__(self) -> None:
        self.w = torch.ones(4, 4)

    @endpoint(propagate=lambda x: x)
    def forward(self, input):
        return input @ self.w


@monarch.remote
def check_memory():
    import psutil

    return psutil.Process().memory_info().rss


def test_getting_started_distributed_tensors_and_remote_functions():
    trainer_procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        trainer_procs.initialized.get(timeout=60)
        with trainer_procs.activate():
            t = torch.rand(4, 4)
        one = monarch.fetch_shard(t, gpus=0).get()
        two = monarch.fetch_shard(t, gpus=1).get()
        assert one.shape == two.shape == (4, 4) and not torch.equal(one, two)
        with trainer_procs.activate():
            dist_compute = t @ t.T
        dtrainers = trainer_procs.spawn("trainers", Trainer)
        got = dtrainers.step.call(dist_compute[0]).get()
        assert got.item(gpus=0) == pytest.approx(float((one @ one.T)[0].sum()), rel=1e-5)
        linear = trainer_procs.spawn("linear", LinearActor)
        o = torch.relu(linear.forward.rref(t))
        assert torch.allclose(monarch.inspect(o, gpus=1), torch.relu(two @ torch.ones(4, 4)))
        with trainer_procs.activate():
            assert all(v > 0 for v in check_memory.call().get().values())
        port, recv = Channel.open()
        with trainer_procs.activate():
            send(check_memory, args=(), kwargs={}, port=port)
        assert all(recv.recv().get(timeout=30) > 0 for _ in range(2))
    finally:
        trainer_procs.stop().get(timeout=60)


def test_distributed_tensors_collectives_pipelining_and_ddp():
    mesh = this_host().spawn_procs({"host": 2, "gpu": 2})
    try:
        mesh.initialized.get(timeout=60)
        with mesh.activate():
            a = torch.rand(3, 4)
            r = a.reduce("gpu", "sum")
        assert torch.allclose(monarch.inspect(r, host=0, gpu=0), monarch.inspect(a, host=0, gpu=0) + monarch.inspect(a, host=0, gpu=1))
        pipeline_mesh = mesh.rename(host="pp")
        meshes = [pipeline_mesh.slice(pp=i) for i in range(pipeline_mesh.size("pp"))]
        stages = []
        for stage_mesh in meshes:
            with stage_mesh.activate():
                stages.append(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))

        def forward_pipeline(x):
            with torch.no_grad():
                for stage_mesh, stage in zip(meshes, stages):
                    x = x.to_mesh(stage_mesh)
                    with stage_mesh.activate():
                        x = stage(x)
                return x

        with meshes[0].activate():
            x = torch.rand(3, 4)
        output = forward_pipeline(x)
        assert monarch.inspect(output).shape == (3, 4) and output.mesh.sizes == {"gpu": 2}

        dp = mesh.flatten("dp")
        with dp.activate():
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
            loss = model(torch.rand(3, 4)).sum()
            rparameters = list(reversed(list(model.parameters())))
            grads = monarch.grad_generator(loss, rparameters)
            with torch.no_grad():
                for param, grad in zip(rparameters, grads):
                    grad.reduce_("dp", "sum")
                    param += 0.01 * grad
        assert monarch.inspect(model[0].weight, dp=3).shape == (4, 4)
    finally:
        mesh.stop().get(timeout=60)


_MAIN_SCRIPT = """
import torch
import actormesh as monarch
from actormesh.actor import Actor, endpoint, this_host

class LinearActor(Actor):  # defined in __main__: a worker cannot import it by name
    def __init__(self):
        self.w = torch.ones(3, 3)

    @endpoint(propagate=lambda x: x)
    def forward(self, input):
        return input @ self.w

@monarch.remote
def rank_plus(x):
    return x + 1

procs = this_host().spawn_procs(per_host={"gpus": 2})
with procs.activate():
    t = torch.ones(3, 3)
linear = procs.spawn("linear", LinearActor)
o = torch.relu(linear.forward.rref(t))
with procs.activate():
    r = rank_plus(o)
print("value", float(monarch.inspect(r, gpus=1).sum()))
procs.stop().get()
"""


@pytest.mark.timeout(240)
def test_classes_and_functions_of_the_users_script_reach_the_workers(tmp_path):
    # The engine's fast batch encoding must not name ``__main__.X`` by reference.
    import subprocess
    import sys

    script = tmp_path / "main_script.py"
    script.write_text(_MAIN_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "value 36.0" in out.stdout  # relu(ones @ ones) = 3 everywhere, + 1, summed over 9
