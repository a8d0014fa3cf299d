"""KubernetesJob: its manifests (checked against the Kubernetes API's JSON schema,
offline, with the kubernetes-validate package), the example manifests in
examples/kubernetes/, apply/state/kill against a fake ``kubernetes`` client whose
"kubelet" runs each pod's command as a local process, and a live cluster when
KUBECONFIG points to one.

Semantics: MONARCH_API.md §1.10 (KubernetesJob).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from actormesh.job import KubernetesJob
from actormesh.job._manifests import to_yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "kubernetes"
K8S_VERSION = "1.30.0"  # oldest API the manifests must fit (Indexed Jobs with pod hostnames: 1.22+)


def _job() -> KubernetesJob:
    return KubernetesJob(
        "ml", {"trainers": 2, "generators": 1}, image="registry.example/app:1", name="exp1",
        resources={"limits": {"nvidia.com/gpu": 8}}, env={"NCCL_DEBUG": "INFO"},
    )


def test_manifests_shape_and_secret_handling() -> None:
    docs = _job().manifests("tcp:10.1.2.3:4567", secret=b"\x01" * 32)
    assert [d["kind"] for d in docs] == ["Secret", "Service", "Job", "Job"]
    secret, service, trainers, generators = docs
    assert base64.b64decode(secret["data"]["secret"]).decode() == "01" * 32
    assert service["spec"]["clusterIP"] == "None"
    spec = trainers["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    assert generators["spec"]["completions"] == 1 and generators["metadata"]["name"] == "exp1-generators"
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "exp1" and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["command"] == ["python3", "-m", "actormesh.host"]
    assert container["args"] == ["--address", "tcp:$(POD_IP):26600", "--controller", "tcp:10.1.2.3:4567", "--secret-file", "/etc/actormesh/secret"]
    assert pod["volumes"][0]["secret"]["defaultMode"] == 0o600
    # the secret travels only in the Secret object, never in the pods' spec
    assert "01" * 32 not in json.dumps(docs[1:]) and secret["data"]["secret"] not in json.dumps(docs[1:])
    assert _job().manifests()[0]["kind"] == "Service"  # no secret given: no Secret object


def test_yaml_is_what_the_dicts_say() -> None:
    yaml = pytest.importorskip("yaml")
    docs = _job().manifests("tcp:10.1.2.3:4567", secret=b"\x01" * 32)
    assert list(yaml.safe_load_all(to_yaml(docs, header="a\n\nb"))) == docs
    assert to_yaml([{"a": [], "b": {}, "c": [{"d": True, "e": None}], "f": "x: y"}]) == '---\na: []\nb: {}\nc:\n  - d: true\n    e: null\nf: "x: y"\n'


def _validate(docs: list[dict[str, Any]]) -> list[str]:
    """The kinds of ``docs``, each validated against the schema (ValidationError names a bad field)."""
    kv = pytest.importorskip("kubernetes_validate", reason="offline schema check needs kubernetes-validate (a dev dependency)")
    kinds = []
    for doc in docs:
        kv.validate(doc, K8S_VERSION, strict=True)
        kinds.append(doc["kind"])
    return kinds


def test_manifests_validate_against_the_kubernetes_schema() -> None:
    # the agents' Secret, their headless Service, the agents' Job and the controller's Job
    assert _validate(_job().manifests("tcp:10.1.2.3:4567", secret=b"\x01" * 32)) == ["Secret", "Service", "Job", "Job"]


def test_schema_check_catches_a_wrong_field() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    doc = _job().manifests()[1]
    doc["spec"]["template"]["spec"]["restartPolicy"] = "Always"
    doc["spec"]["completions"] = "2"
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, K8S_VERSION, strict=True)


def test_examples_are_current_and_valid() -> None:
    yaml = pytest.importorskip("yaml")
    spec = importlib.util.spec_from_file_location("k8s_example_generate", EXAMPLES / "generate.py")
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    assert (EXAMPLES / "agents.yaml").read_text() == generate.render(), "run python examples/kubernetes/generate.py"
    for name in ("agents.yaml", "controller.yaml"):
        assert _validate(list(yaml.safe_load_all((EXAMPLES / name).read_text())))


# -- apply / state / kill against a fake client ---------------------------------------------------

_FAKE_KUBERNETES = '''
"""A fake of the kubernetes client: objects are remembered, and each pod of a Job
runs its container's command here, with $(POD_IP) = 127.0.0.<n>, its hostname
<job>-<index> and the Secret mounted as a file with the volume's defaultMode."""
import atexit, base64, json, os, subprocess, sys, tempfile
from types import SimpleNamespace

_objects, _secrets, _pods = {}, {}, {}


def _log(*event):
    with open(os.environ["FAKE_KUBE_LOG"], "a") as f:
        f.write(json.dumps(event) + "\\n")


class ApiException(Exception):
    def __init__(self, status=500, reason=""):
        super().__init__(reason)
        self.status, self.reason = status, reason


def _run_pod(pod_name, ip, container, secret_path):
    env = dict(os.environ)
    for e in container.get("env", []):
        env[e["name"]] = ip if "valueFrom" in e else e["value"]
    args = [a.replace("$(POD_IP)", ip).replace("/etc/actormesh/secret", secret_path) for a in container["args"]]
    module = container["command"][2]
    boot = (f"import runpy, socket, sys; socket.gethostname = lambda: {pod_name!r}; "
            f"sys.argv = ['x'] + sys.argv[1:]; runpy.run_module({module!r}, run_name='__main__')")
    return subprocess.Popen([container["command"][0], "-c", boot, *args], env=env)


def _create(api, doc, namespace=None):
    kind, name = doc["kind"], doc["metadata"]["name"]
    _log("create", kind, name, namespace)
    _objects[(kind, name)] = doc
    if kind == "Secret":
        _secrets[name] = base64.b64decode(doc["data"]["secret"])
    if kind == "Job":
        pod = doc["spec"]["template"]["spec"]
        volume = pod["volumes"][0]["secret"]
        path = os.path.join(tempfile.mkdtemp(), "secret")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, volume["defaultMode"])
        os.write(fd, _secrets[volume["secretName"]])
        os.close(fd)
        for i in range(doc["spec"]["completions"]):
            ip = f"127.0.0.{30 + sum(len(p) for p in _pods.values())}"
            _pods.setdefault(name, []).append(_run_pod(f"{name}-{i}", ip, pod["containers"][0], path))


def _stop(name):
    for p in _pods.pop(name, []):
        p.terminate()
        p.wait(10)


atexit.register(lambda: [_stop(n) for n in list(_pods)])


class BatchV1Api:
    def __init__(self, api=None):
        pass

    def read_namespaced_job_status(self, name, namespace):
        if ("Job", name) not in _objects:
            raise ApiException(404, "Not Found")
        failed = sum(1 for p in _pods.get(name, []) if p.poll() not in (None, 0))
        return SimpleNamespace(metadata=SimpleNamespace(name=name), status=SimpleNamespace(failed=failed, succeeded=0))

    def delete_namespaced_job(self, name, namespace, propagation_policy=None):
        if _objects.pop(("Job", name), None) is None:
            raise ApiException(404, "Not Found")
        _log("delete", "Job", name, propagation_policy)
        _stop(name)


class CoreV1Api:
    def __init__(self, api=None):
        pass

    def _delete(self, kind, name):
        if _objects.pop((kind, name), None) is None:
            raise ApiException(404, "Not Found")
        _log("delete", kind, name)

    def delete_namespaced_service(self, name, namespace, propagation_policy=None):
        self._delete("Service", name)

    def delete_namespaced_secret(self, name, namespace, propagation_policy=None):
        self._delete("Secret", name)


client = SimpleNamespace(ApiClient=lambda: "api", BatchV1Api=BatchV1Api, CoreV1Api=CoreV1Api, ApiException=ApiException)
config = SimpleNamespace(load_kube_config=lambda config_file=None: _log("load_kube_config", config_file),
                         load_incluster_config=lambda: _log("load_incluster_config"))
utils = SimpleNamespace(create_from_dict=_create)
'''

_CONTROLLER = """
import json, os, socket, sys
from actormesh import config
config.configure(default_transport="tcp", bind_host="127.0.0.1")
from actormesh.actor import Actor, endpoint
from actormesh.job import KubernetesJob
from actormesh.runtime import current_runtime

class Where(Actor):
    @endpoint
    def where(self):
        return current_runtime().address

job = KubernetesJob("ml", {"trainers": 2, "generators": 1}, python=sys.executable, name="exp1", join_timeout_s=30)
out = {}
try:
    state = job.state()
    out["active"] = job.active
    for name in state:
        procs = state[name].spawn_procs(per_host={"procs": 1})
        out[name] = procs.spawn("w", Where).where.call().get(timeout=30).values()
        procs.stop().get(timeout=30)
    out["controller"] = current_runtime().address
    out["secret"] = current_runtime().secret.hex()
finally:
    job.kill()
out["active_after_kill"] = job.active
print(json.dumps(out))
"""


def test_kubernetes_job_with_a_fake_cluster(tmp_path: Path) -> None:
    fake = tmp_path / "fake" / "kubernetes"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(_FAKE_KUBERNETES)
    script = tmp_path / "controller.py"
    script.write_text(_CONTROLLER)
    log = tmp_path / "kube.log"
    env = {**os.environ, "FAKE_KUBE_LOG": str(log), "PYTHONPATH": os.pathsep.join([str(fake.parent), *sys.path])}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["active"] and not out["active_after_kill"]
    # pods joined in index order per mesh: trainers on .30 and .31, generators on .32
    assert [a.split(":")[1] for a in out["trainers"]] == ["127.0.0.30", "127.0.0.31"]
    assert [a.split(":")[1] for a in out["generators"]] == ["127.0.0.32"]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    created = [e[1:3] for e in events if e[0] == "create"]
    assert created == [["Secret", "exp1-secret"], ["Service", "exp1"], ["Job", "exp1-trainers"], ["Job", "exp1-generators"]]
    deleted = sorted(tuple(e[1:3]) for e in events if e[0] == "delete")
    assert deleted == [("Job", "exp1-generators"), ("Job", "exp1-trainers"), ("Secret", "exp1-secret"), ("Service", "exp1")]


def test_apply_without_the_client_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import fails
    from actormesh.job import JobError

    with pytest.raises(JobError, match="pip install kubernetes"):
        KubernetesJob("default", {"hosts": 1}).apply()


# -- a live cluster -----------------------------------------------------------------------------


def _live_cluster() -> str | None:
    """Why there is no usable live cluster (None when there is one)."""
    if not os.environ.get("KUBECONFIG"):
        return "KUBECONFIG is not set"
    if not os.environ.get("ACTORMESH_TEST_K8S_IMAGE"):
        return "ACTORMESH_TEST_K8S_IMAGE (an image with actormesh installed) is not set"
    try:
        from kubernetes import client, config
    except ImportError:
        return "the kubernetes package is not installed"
    try:
        config.load_kube_config()
        client.VersionApi().get_code(_request_timeout=5)
    except Exception as exc:
        return f"the cluster in KUBECONFIG is unreachable: {exc}"
    return None


@pytest.mark.timeout(330)
def test_live_cluster() -> None:
    """Pods must reach this machine: run it where the cluster can dial ACTORMESH_BIND_HOST."""
    reason = _live_cluster()
    if reason:
        pytest.skip(reason)
    code = (
        "import os, sys\n"
        "from actormesh import config\n"
        "config.configure(default_transport='tcp', bind_host=os.environ.get('ACTORMESH_BIND_HOST', '0.0.0.0'))\n"
        "from actormesh.job import KubernetesJob\n"
        "job = KubernetesJob(os.environ.get('ACTORMESH_TEST_K8S_NAMESPACE', 'default'), {'hosts': 2},"
        " image=os.environ['ACTORMESH_TEST_K8S_IMAGE'], name='actormesh-test', join_timeout_s=240)\n"
        "try:\n"
        "    hosts = job.state().hosts\n"
        "    assert hosts.initialized.get(timeout=60)\n"
        "finally:\n"
        "    job.kill()\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr
