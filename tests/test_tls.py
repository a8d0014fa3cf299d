"""Mutual TLS on a per-job CA for TCP channels (loopback)."""

from __future__ import annotations

import socket
import ssl

import pytest

pytest.importorskip("cryptography")

from actormesh import config
from actormesh.actor import Actor, endpoint
from actormesh.transport import JobTLS, parse_address


class Echo(Actor):
    @endpoint
    def echo(self, x: int) -> int:
        return x

    @endpoint
    def via(self, other) -> int:
        return other.echo.call_one(7).get(timeout=10)




def test_tls_job_runs_and_rejects_plaintext_and_foreign_certs(tmp_path):
    from actormesh.runtime import ProcRuntime

    with config.configured(default_transport="tcp", tls=True):
        rt = ProcRuntime(name="tlsprobe", job_dir=str(tmp_path))
    try:
        assert rt.tls is not None and "PRIVATE" not in repr(rt.tls)
        _, (host, port) = parse_address(rt.address)

        # Plaintext: the TLS server never completes our handshake.
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(b"AMESH\x01" + b"\0" * 32)
            s.settimeout(5)
            try:
                data = s.recv(100)
            except (ConnectionResetError, socket.timeout):
                data = b""
            assert not data.startswith(b"AMESH")

        # A client whose certificate comes from another CA is refused by the server
        # (it trusts the job's CA, so only the server's check can stop it).
        intruder = JobTLS.generate("intruder")
        foreign = JobTLS(rt.tls.ca_pem, intruder.cert_pem, intruder.key_pem).client_context(str(tmp_path))
        with socket.create_connection((host, port), timeout=5) as raw:
            try:
                with foreign.wrap_socket(raw, server_hostname=None) as s:
                    s.settimeout(5)
                    got = s.recv(38)
            except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
                got = b""
            assert not got.startswith(b"AMESH"), "a foreign certificate reached the HMAC stage"

        # The job's own certificate gets through TLS and then meets the HMAC challenge.
        own = rt.tls.client_context(str(tmp_path))
        with socket.create_connection((host, port), timeout=5) as raw:
            with own.wrap_socket(raw, server_hostname=None) as s:
                s.settimeout(5)
                hello = s.recv(38)
                assert hello.startswith(b"AMESH")
    finally:
        rt.close()


def test_actors_talk_over_tls(tmp_path):
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "tls_job.py"
    script.write_text(
        textwrap.dedent(
            """
            from actormesh import config
            config.configure(default_transport="tcp", tls=True)
            from actormesh.actor import this_host
            from test_tls import Echo
            from actormesh.runtime import current_runtime
            procs = this_host().spawn_procs(per_host={"gpus": 2})
            e = procs.spawn("e", Echo)
            assert e.echo.call(3).get(timeout=20).values() == [3, 3]
            assert e.slice(gpus=0).via.call_one(e.slice(gpus=1)).get(timeout=20) == 7
            assert current_runtime()._server_ssl is not None
            procs.stop().get(timeout=20)
            print("ok")
            """
        )
    )
    import os

    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


# -- jobs: the TLS material travels with the job secret ---------------------------------------

_PROCESS_JOB = """
from actormesh import config
config.configure(default_transport="tcp", tls=True)
from actormesh.actor import Actor, endpoint
from actormesh.job import ProcessJob

class Where(Actor):
    @endpoint
    def where(self):
        from actormesh.runtime import current_runtime
        rt = current_runtime()
        return rt.address, rt.tls is not None and rt._server_ssl is not None

job = ProcessJob({"hosts": 2})
try:
    procs = job.state().hosts.spawn_procs(per_host={"gpus": 1})
    got = procs.spawn("w", Where).where.call().get(timeout=30).values()
    assert [a.split(":")[1] for a, _ in got] == ["127.0.0.2", "127.0.0.3"], got
    assert all(t for _, t in got), got
    procs.stop().get(timeout=30)
finally:
    job.kill()
print("ok")
"""


def test_process_job_with_tls(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "tls_process_job.py"
    script.write_text(_PROCESS_JOB)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


_ATTACH_TLS = """
import json, sys
from actormesh.actor import Actor, endpoint
from actormesh.job import attach_to_workers
from actormesh.runtime import current_runtime

class Where(Actor):
    @endpoint
    def where(self):
        rt = current_runtime()
        return rt.address, rt.tls is not None

hosts = attach_to_workers(workers=sys.argv[1:])
assert hosts.initialized.get(timeout=20)
assert current_runtime().tls is not None
procs = hosts.spawn_procs(per_host={"procs": 1})
print(json.dumps(procs.spawn("w", Where).where.call().get(timeout=20).values()))
procs.stop().get(timeout=20)
"""


@pytest.mark.timeout(120)
def test_attach_to_workers_with_tls_credentials(tmp_path):
    import json
    import os
    import subprocess
    import sys

    creds = tmp_path / "job.creds"
    subprocess.run([sys.executable, "-m", "actormesh.host", "--new-credentials", str(creds), "--tls"], check=True, timeout=30)
    assert creds.stat().st_mode & 0o777 == 0o600
    env = {**os.environ, "ACTORMESH_SECRET_FILE": str(creds)}
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    addresses = [f"tcp://127.0.0.1:{p}" for p in ports]
    serve = "import sys; from actormesh.job import run_worker_loop_forever; run_worker_loop_forever(address=sys.argv[1])"
    workers = [subprocess.Popen([sys.executable, "-c", serve, a], env=env) for a in addresses]
    try:
        script = tmp_path / "attach.py"
        script.write_text(_ATTACH_TLS)
        out = subprocess.run([sys.executable, str(script), *addresses], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert len(got) == 2 and all(tls for _, tls in got), got
        # A worker's listener speaks TLS: a plaintext client never reaches the HMAC stage.
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=5) as s:
            s.sendall(b"AMESH\x01" + b"\0" * 32)
            s.settimeout(5)
            try:
                data = s.recv(100)
            except (ConnectionResetError, socket.timeout):
                data = b""
            assert not data.startswith(b"AMESH")
        # Credentials without the TLS part cannot attach (a clear error, no hang).
        plain = tmp_path / "plain.creds"
        plain.write_text(creds.read_text().split()[0])
        plain.chmod(0o600)
        out = subprocess.run([sys.executable, str(script), *addresses],
                             env={**env, "ACTORMESH_SECRET_FILE": str(plain), "ACTORMESH_CONNECT_TIMEOUT": "2"},
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "unreachable" in out.stderr, out.stderr[-2000:]
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(timeout=20)


def test_tls_material_round_trips_as_one_line():
    tls = JobTLS.generate()
    token = tls.to_token()
    assert "\n" not in token and " " not in token
    assert JobTLS.from_token(token) == tls
    with pytest.raises(ValueError, match="base64"):
        JobTLS.from_token("not base64!")
    with pytest.raises(ValueError, match="must hold"):
        JobTLS.from_token(__import__("base64").b64encode(tls.ca_pem.encode()).decode())


def test_an_unexpected_dial_error_fails_the_route_instead_of_stranding_it(monkeypatch):
    """Regression: a ValueError from a half-closed TLS socket once left the
    dial task dead and every message to that peer waiting forever."""
    import threading

    from actormesh.runtime import _peers, current_runtime

    rt = current_runtime()

    async def broken_connect(*args, **kwargs):
        raise ValueError("negative file descriptor")

    monkeypatch.setattr(_peers, "connect", broken_connect)  # dialing lives in _peers.py
    address = "tcp:127.0.0.1:9"
    lost = threading.Event()
    reasons: list[str] = []

    class Waiter:
        def peer_lost(self, addr: str, reason: str) -> None:
            reasons.append(reason)
            lost.set()

    rt.await_peer(address, Waiter())
    rt.start_dial(rt.route(address))
    assert lost.wait(10), "the route was never failed"
    assert "unreachable" in reasons[0] and "negative file descriptor" in reasons[0]
