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
