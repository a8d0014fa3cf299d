"""``KubernetesJob``: host agents as pods of Indexed Jobs (see ``_manifests``),
applied with the official ``kubernetes`` client (imported only when needed:
``pip install kubernetes``). ``job.manifests()`` gives the same objects for
``kubectl apply`` or review without the client.
"""

from __future__ import annotations

import os
from typing import Any

from ._controller import controller_address
from ._errors import JobError
from ._job import Job, JobState, check_meshes
from ._join import JoinWaiter, Slot, by_host_name
from ._manifests import agent_manifests, job_name, to_yaml

__all__ = ["KubernetesJob"]


class KubernetesJob(Job):
    """Hosts as Kubernetes pods: ``meshes`` maps mesh names to pod counts.

    ``apply()`` creates a Secret, a headless Service and one Indexed Job per
    mesh in ``namespace``; every pod runs a host agent that dials this
    controller, so the controller must be reachable from the pods: run it in
    a pod of the cluster with ``ACTORMESH_DEFAULT_TRANSPORT=tcp`` and
    ``ACTORMESH_BIND_HOST`` set to the pod's IP (see examples/kubernetes/).
    ``image`` must have actormesh installed for ``python``. ``kill()`` deletes
    everything it created.

    Example::

        job = KubernetesJob("ml", {"trainers": 4}, image="registry/me/train:1",
                            resources={"limits": {"nvidia.com/gpu": 8}})
        procs = job.state().trainers.spawn_procs(per_host={"gpus": 8})
    """

    def __init__(
        self,
        namespace: str = "default",
        meshes: dict[str, int] | None = None,
        *,
        image: str = "python:3.11-slim",
        python: str = "python3",
        name: str = "actormesh",
        kubeconfig: str | None = None,
        agent_port: int = 26600,
        resources: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        image_pull_policy: str | None = None,
        ttl_seconds_after_finished: int = 300,
        join_timeout_s: float = 300.0,
    ) -> None:
        super().__init__()
        self.namespace = namespace
        self.meshes = check_meshes(meshes if meshes is not None else {"hosts": 1})
        self.image = image
        self.python = python
        self.name = name
        self.kubeconfig = kubeconfig
        self.agent_port = agent_port
        self.resources = resources
        self.env = dict(env or {})
        self.image_pull_policy = image_pull_policy
        self.ttl_seconds_after_finished = ttl_seconds_after_finished
        self.join_timeout_s = join_timeout_s
        self._waiter: JoinWaiter | None = None

    _transient = ("_waiter",)

    def manifests(self, controller: str = "tcp:CONTROLLER_HOST:CONTROLLER_PORT", secret: bytes | None = None,
                  tls: Any = None) -> list[dict[str, Any]]:
        """The objects :meth:`apply` creates, as dicts (the Secret only when ``secret`` is given;
        it also carries ``tls``, the controller's ``JobTLS``, when the job uses TLS)."""
        return agent_manifests(
            name=self.name,
            namespace=self.namespace,
            meshes=self.meshes,
            image=self.image,
            python=self.python,
            controller=controller,
            secret=secret,
            tls=tls,
            agent_port=self.agent_port,
            resources=self.resources,
            env=self.env,
            ttl_seconds_after_finished=self.ttl_seconds_after_finished,
            image_pull_policy=self.image_pull_policy,
        )

    def manifests_yaml(self, controller: str = "tcp:CONTROLLER_HOST:CONTROLLER_PORT", secret: bytes | None = None, header: str = "") -> str:
        """:meth:`manifests` as one YAML stream (for ``kubectl apply -f -``)."""
        return to_yaml(self.manifests(controller, secret), header)

    def _api(self) -> Any:
        try:
            from kubernetes import client, config
        except ImportError:
            raise JobError(
                "KubernetesJob needs the kubernetes package to apply manifests: pip install kubernetes "
                "(or write them with job.manifests_yaml(...) and kubectl apply -f)"
            ) from None
        try:
            if self.kubeconfig or not os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_kube_config(config_file=self.kubeconfig)
            else:
                config.load_incluster_config()
        except Exception as exc:
            raise JobError(f"{self!r}: no usable Kubernetes configuration (kubeconfig={self.kubeconfig or os.environ.get('KUBECONFIG', '~/.kube/config')}): {exc}") from exc
        return client.ApiClient()

    def _create(self) -> None:
        from ..runtime import current_runtime

        api = self._api()
        from kubernetes import client, utils

        ctrl = controller_address(need_tcp=True, bind_host=os.environ.get("POD_IP"), what=repr(self))
        rt = current_runtime()
        self._waiter = JoinWaiter(rt)
        try:
            for doc in self.manifests(ctrl, rt.secret, rt.tls):
                utils.create_from_dict(api, doc, namespace=self.namespace)
        except Exception as exc:
            self._waiter.close()
            detail = exc.reason if isinstance(exc, client.ApiException) else exc
            self._kill()
            raise JobError(f"{self!r}: could not create its objects in namespace {self.namespace!r}: {detail}") from exc

    def _wait_state(self) -> JobState:
        waiter = self._waiter
        if waiter is None:
            raise JobError(f"{self!r} was applied by another process; its agents serve that controller only")
        pods = [f"{job_name(self.name, m)}-{i}" for m, count in self.meshes.items() for i in range(count)]
        slots = [Slot(pod, by_host_name(pod)) for pod in pods]
        try:
            waiter.wait(slots, self.join_timeout_s, what=repr(self), check=self._failed, poll_s=1.0,
                        details=lambda missing: f"  inspect with: kubectl -n {self.namespace} get pods -l app.kubernetes.io/instance={self.name}")
        except BaseException:
            self.kill()
            raise
        finally:
            waiter.close()
        return JobState.from_agents(self.meshes, [s.address for s in slots if s.address])

    def _jobs(self) -> list[Any]:
        from kubernetes import client

        batch = client.BatchV1Api(self._api())
        out = []
        for mesh in self.meshes:
            try:
                out.append(batch.read_namespaced_job_status(job_name(self.name, mesh), self.namespace))
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        return out

    def _failed(self) -> str | None:
        for job in self._jobs():
            if job.status and job.status.failed:
                return f"Kubernetes Job {job.metadata.name} has {job.status.failed} failed pod(s)"
        return None

    def _kill(self) -> None:
        if self._waiter is not None:
            self._waiter.close()
        from kubernetes import client

        api = self._api()
        batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
        calls = [(batch.delete_namespaced_job, job_name(self.name, m)) for m in self.meshes]
        calls += [(core.delete_namespaced_service, self.name), (core.delete_namespaced_secret, f"{self.name}-secret")]
        for call, obj in calls:
            try:
                call(obj, self.namespace, propagation_policy="Background")
            except client.ApiException as exc:
                if exc.status != 404:
                    raise JobError(f"{self!r}: could not delete {obj}: {exc.reason}") from exc

    def _is_active(self) -> bool:
        jobs = self._jobs()
        return len(jobs) == len(self.meshes) and all(not (j.status and (j.status.failed or j.status.succeeded)) for j in jobs)

    def __repr__(self) -> str:
        return f"KubernetesJob({self.namespace!r}, {self.meshes!r}, name={self.name!r})"
