"""The tensor engine in one walk: torch on the controller runs on a whole mesh.

    .venv/bin/python examples/tensor_engine.py

Follows Monarch's "Distributed Tensors" docs (swap ``monarch`` for
``actormesh``): ops and inspect, collectives, a free remote function, an actor
taking its proc's shard, a failing op recovered from, moving a tensor between
mesh slices, and a small data-parallel training loop written only with
distributed tensors.
"""

from __future__ import annotations

import torch

import actormesh
from actormesh.actor import Actor, endpoint, this_host


@actormesh.remote(propagate=lambda t: t.new_empty(()))
def local_norm(t: torch.Tensor) -> torch.Tensor:
    """Runs on every proc, on that proc's shard."""
    return t.norm()


class ShardReader(Actor):
    """An ordinary actor: a distributed tensor argument arrives as its own proc's shard."""

    @endpoint
    def total(self, t: torch.Tensor) -> float:
        return float(t.sum())


def walk(mesh) -> None:
    print(mesh.to_table())
    with mesh.activate():
        t = torch.rand(3, 4)  # one shard per proc, returned at once
        obj = t @ t.T
    print("shape known on the controller:", tuple(obj.shape), "| shard gpu=1:\n", actormesh.inspect(obj, gpu=1))

    with mesh.activate():
        a = mesh.rank_tensor("gpu").float() + 1
        total = a.reduce("gpu", "sum")  # all-reduce over the gpu dim (gloo on CPU)
        norms = local_norm(torch.ones(2, 2) * a)
    print("reduce sum of ranks+1:", actormesh.inspect(total).item(), "| remote norm on gpu=3:", actormesh.inspect(norms, gpu=3).item())

    readers = mesh.spawn("readers", ShardReader)
    print("actors see their shards:", readers.total.call(a).get().values())

    try:
        with mesh.activate():
            bad = torch.rand(4, 5) @ torch.rand(6, 7)  # shapes are checked here, at once
    except RuntimeError as exc:
        print("refused on the controller:", str(exc).splitlines()[0])
    with mesh.activate():
        oops = torch.ones(2, 3).index_select(1, torch.tensor([9]))  # fails only on the workers
        fine = torch.ones(2) * 2
    try:
        actormesh.inspect(oops)
    except actormesh.RemoteException as exc:
        print("failed op, raised where fetched:", str(exc).splitlines()[0])
    print("workers live on, independent tensors fetch fine:", actormesh.inspect(fine).tolist())

    halves = [mesh.slice(gpu=slice(0, 2)).rename(gpu="stage_gpu"), mesh.slice(gpu=slice(2, 4)).rename(gpu="stage_gpu")]
    with halves[0].activate():
        x = torch.full((2,), 5.0)
    moved = x.to_mesh(halves[1])
    print("moved between slices:", actormesh.inspect(moved, stage_gpu=1).tolist())


def train(mesh, steps: int = 8) -> None:
    """Data parallel with distributed tensors only: each proc its own batch, averaged grads."""
    dp = mesh.rename(gpu="dp")
    with dp.activate():
        torch.manual_seed(0)  # the same initial weights on every proc
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        w_true = torch.linspace(-1, 1, 16)
        torch.manual_seed(1)
        shift = dp.rank_tensor("dp").float()
        for step in range(steps):
            x = torch.rand(32, 16) + 0.1 * shift  # a different batch per proc
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x @ w_true)
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.grad.reduce_("dp", "avg")
            opt.step()
            with torch.no_grad():
                mean_loss = loss.reduce("dp", "avg")
            print(f"step {step}: loss {actormesh.inspect(mean_loss).item():.4f}")


def main() -> None:
    mesh = this_host().spawn_procs(per_host={"gpu": 4})
    try:
        walk(mesh)
        train(mesh)
    finally:
        mesh.stop().get(timeout=60)
    print("tensor engine demo OK")


if __name__ == "__main__":
    main()
