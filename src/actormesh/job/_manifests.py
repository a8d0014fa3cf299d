"""Kubernetes manifests for a job's host agents, and a small YAML writer for them.

One headless Service (stable pod DNS names), one Secret (the job secret,
mounted into the pods as a 0600 file) and, per mesh, one Indexed Job whose
pods run ``python -m actormesh.host --address tcp:$(POD_IP):PORT --controller
ADDR --secret-file /etc/actormesh/secret``. Agents exit when the controller
goes away, so the Jobs complete (and are garbage-collected after
``ttlSecondsAfterFinished``) instead of restarting.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from ..host import format_credentials

__all__ = ["agent_manifests", "to_yaml", "SECRET_DIR"]

SECRET_DIR = "/etc/actormesh"


def _agent_container(image: str, python: str, controller: str, agent_port: int, env: dict[str, str] | None,
                     resources: dict[str, Any] | None, image_pull_policy: str | None) -> dict[str, Any]:
    """The pod's one container: a host agent on the pod's IP, dialling the controller."""
    container: dict[str, Any] = {
        "name": "agent",
        "image": image,
        "command": [python, "-m", "actormesh.host"],
        "args": ["--address", f"tcp:$(POD_IP):{agent_port}", "--controller", controller, "--secret-file", f"{SECRET_DIR}/secret"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        + [{"name": k, "value": v} for k, v in (env or {}).items()],
        "ports": [{"name": "agent", "containerPort": agent_port}],
        "volumeMounts": [{"name": "job-secret", "mountPath": SECRET_DIR, "readOnly": True}],
    }
    if image_pull_policy:
        container["imagePullPolicy"] = image_pull_policy
    if resources:
        container["resources"] = resources
    return container


def agent_manifests(
    *,
    name: str,
    namespace: str,
    meshes: dict[str, int],
    image: str,
    python: str,
    controller: str,
    secret: bytes | None,
    agent_port: int,
    tls: Any = None,
    resources: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    ttl_seconds_after_finished: int = 300,
    image_pull_policy: str | None = None,
) -> list[dict[str, Any]]:
    """The Secret (omitted when ``secret`` is None), headless Service and one
    Indexed Job per mesh, as plain dicts in apply order."""
    labels = {"app.kubernetes.io/name": "actormesh", "app.kubernetes.io/instance": name}

    def meta(obj_name: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
        return {"name": obj_name, "namespace": namespace, "labels": {**labels, **(extra or {})}}

    out: list[dict[str, Any]] = []
    secret_name = f"{name}-secret"
    if secret is not None:
        data = {"secret": base64.b64encode(format_credentials(secret, tls).encode()).decode()}
        out.append({"apiVersion": "v1", "kind": "Secret", "metadata": meta(secret_name), "type": "Opaque", "data": data})
    out.append({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(name),
        "spec": {"clusterIP": "None", "selector": labels, "ports": [{"name": "agent", "port": agent_port, "targetPort": agent_port}]},
    })
    for mesh, hosts in meshes.items():
        container = _agent_container(image, python, controller, agent_port, env, resources, image_pull_policy)
        out.append({
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": meta(job_name(name, mesh), {"actormesh/mesh": mesh}),
            "spec": {
                "completionMode": "Indexed",
                "completions": hosts,
                "parallelism": hosts,
                "backoffLimit": 0,
                "ttlSecondsAfterFinished": ttl_seconds_after_finished,
                "template": {
                    "metadata": {"labels": {**labels, "actormesh/mesh": mesh}},
                    "spec": {
                        "subdomain": name,
                        "restartPolicy": "Never",
                        "containers": [container],
                        # 0600: the agent refuses a secret file that group or others can read
                        "volumes": [{"name": "job-secret", "secret": {"secretName": secret_name, "defaultMode": 0o600, "items": [{"key": "secret", "path": "secret"}]}}],
                    },
                },
            },
        })
    return out


def job_name(name: str, mesh: str) -> str:
    """The Kubernetes Job of one mesh (its pods are ``<job name>-<index>``)."""
    return f"{name}-{mesh.replace('_', '-').lower()}"


def to_yaml(docs: list[dict[str, Any]], header: str = "") -> str:
    """Documents as YAML (``---`` separated). Strings are JSON-quoted, which YAML reads as-is."""
    parts = []
    for doc in docs:
        parts.append("\n".join(_emit(doc, 0)))
    comment = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines()) if header else ""
    return comment + "---\n" + "\n---\n".join(parts) + "\n"


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    if v is None:
        return "null"
    return json.dumps(str(v))


def _emit(value: Any, indent: int) -> list[str]:
    pad = "  " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            key = k if _plain_key(k) else json.dumps(k)
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{key}:")
                lines.extend(_emit(v, indent + 1))
            else:
                lines.append(f"{pad}{key}: {_scalar(v) if not isinstance(v, (dict, list)) else ('{}' if isinstance(v, dict) else '[]')}")
    elif isinstance(value, list):
        for item in value:
            sub = _emit(item, indent + 1) if isinstance(item, (dict, list)) and item else [f"{'  ' * (indent + 1)}{_scalar(item)}"]
            first = sub[0].lstrip()
            lines.append(f"{pad}- {first}")
            lines.extend(f"{pad}  {line[len(pad) + 2:]}" for line in sub[1:])
    else:
        lines.append(pad + _scalar(value))
    return lines


def _plain_key(k: str) -> bool:
    return bool(k) and all(c.isalnum() or c in "-_./" for c in k) and not k[0].isdigit()
