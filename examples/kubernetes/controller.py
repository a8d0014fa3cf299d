"""The controller of the Kubernetes example: run it in the pod of controller.yaml.

It creates the agents' Secret, Service and Indexed Job (see agents.yaml), waits for
the two pods to join, runs an actor on each and cleans up.
"""

from __future__ import annotations

import socket

from actormesh.actor import Actor, endpoint
from actormesh.job import KubernetesJob


class Hello(Actor):
    @endpoint
    def where(self) -> str:
        return socket.gethostname()


def main() -> None:
    job = KubernetesJob("default", {"trainers": 2}, image="ghcr.io/example/actormesh-app:latest", name="actormesh")
    try:
        procs = job.state().trainers.spawn_procs(per_host={"procs": 1})
        print(procs.spawn("hello", Hello).where.call().get(timeout=60))
        procs.stop().get(timeout=60)
    finally:
        job.kill()


if __name__ == "__main__":
    main()
