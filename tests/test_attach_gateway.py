"""Monarch's ``attach(addr)``: a client the procs cannot dial reaches the job over
one connection it opens to a gateway (a worker's host agent), which relays both
ways (runtime/_gateway.py, runtime/_attached.py).

Real processes throughout: workers started with ``run_worker_loop_forever`` on
two loopback addresses (two "hosts"), clients in subprocesses (``attach`` must
come before a process's runtime starts). Semantics: MONARCH_API.md §1.4.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import freeze, wait_for

pytestmark = pytest.mark.timeout(180)

_COMMON = """
import json, os, sys, time
import psutil
import actormesh.actor as am
from actormesh.actor import Actor, Channel, attach, context, endpoint, this_host
from actormesh.errors import SupervisionError
from actormesh.job import attach_to_workers
from actormesh.runtime import current_runtime

T = 60


class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x, os.getpid()

    @endpoint
    def send_to(self, port, x):
        port.send(x)

    @endpoint
    def crash(self):
        os._exit(3)

    @endpoint
    def relay(self, port):
        # A proc the client never sent anything to: it must find the client through the gateway itself.
        procs = this_host().spawn_procs(per_host={"inner": 1})
        inner = procs.spawn("inner", Echo)
        inner.send_to.call_one(port, "from-inner").get(timeout=T)
        procs.stop().get(timeout=T)
        return "relayed"


def sockets():
    \"\"\"This process's sockets: inet ones as (status, remote port); unix ones bound to a path.\"\"\"
    me = psutil.Process()
    inet = [(c.status, c.raddr.port if c.raddr else None) for c in me.net_connections("inet")]
    listening_unix = [c.laddr for c in me.net_connections("unix") if c.laddr]
    job_sockets = [f for f in os.listdir(current_runtime().job_dir) if f.endswith(".sock")]
    return {"inet": inet, "unix_bound": listening_unix, "job_sockets": job_sockets}


def emit(obj):
    print("RESULT " + json.dumps(obj), flush=True)
"""

_FULL = _COMMON + """
failures = []
am.unhandled_fault_hook = failures.append
gateway, *workers = sys.argv[1:]
attach(gateway)
hosts = attach_to_workers(workers=workers)
assert hosts.initialized.get(timeout=T)
procs = hosts.spawn_procs(per_host={"procs": 2})
echo = procs.spawn("echo", Echo)
out = {"address": current_runtime().address}
replies = echo.echo.call("hi").get(timeout=T)
out["echo"] = [v[0] for v in replies.values()]
out["proc_pids"] = [v[1] for v in replies.values()]
port, recv = Channel.open()
echo.send_to.broadcast(port, "pushed")  # procs send to the client with no reply port to answer
out["pushed"] = [recv.recv().get(timeout=T) for _ in range(4)]
out["relayed"] = [echo.slice(hosts=1, procs=0).relay.call_one(port).get(timeout=T), recv.recv().get(timeout=T)]
burst = [echo.slice(hosts=1, procs=1).echo.call_one(i) for i in range(1000)]  # batches, relayed both ways
out["burst"] = [f.get(timeout=T)[0] for f in burst] == list(range(1000))
out["batched"] = current_runtime().messages_batched() > 0
out["sockets_busy"] = sockets()
try:
    echo.slice(hosts=0, procs=1).crash.call_one().get(timeout=T)
    out["crash"] = "no error"
except SupervisionError as exc:
    out["crash"] = str(exc)
deadline = time.monotonic() + T  # the hook runs on a runtime thread: poll it, with a deadline
while not failures and time.monotonic() < deadline:
    time.sleep(0.05)
out["failures"] = [str(f) for f in failures]
out["sockets_end"] = sockets()
emit(out)
"""

_KILL_GATEWAY = _COMMON + """
failures = []
am.unhandled_fault_hook = failures.append
gateway, worker = sys.argv[1:]
attach(gateway)
hosts = attach_to_workers(workers=[worker])
procs = hosts.spawn_procs(per_host={"procs": 1})
echo = procs.spawn("echo", Echo)
first = echo.echo.call_one("before").get(timeout=T)[0]
emit({"ready": first})
sys.stdin.readline()  # the test kills the gateway now
try:
    echo.echo.call_one("after").get(timeout=T)
    after = "no error"
except SupervisionError as exc:
    after = str(exc)
deadline = time.monotonic() + T  # the hook runs on a runtime thread: poll it, with a deadline
while not failures and time.monotonic() < deadline:
    time.sleep(0.05)
emit({"after": after, "failures": [str(f) for f in failures]})
"""

_FROZEN_GATEWAY = _COMMON + """
failures = []
am.unhandled_fault_hook = failures.append
gateway, worker = sys.argv[1:]
attach(gateway)
hosts = attach_to_workers(workers=[worker])
procs = hosts.spawn_procs(per_host={"procs": 1})
echo = procs.spawn("echo", Echo)
first = echo.echo.call_one("before").get(timeout=T)[0]
emit({"ready": first})
sys.stdin.readline()  # the test freezes the gateway now: packets go nowhere, nothing closes
t0 = time.monotonic()
try:
    echo.echo.call_one("after").get(timeout=T)
    after = "no error"
except SupervisionError as exc:
    after = str(exc)
emit({"after": after, "took": time.monotonic() - t0, "failures": [str(f) for f in failures]})
"""

_ORPHANS = _COMMON + """
gateway = sys.argv[1]
attach(gateway)
hosts = attach_to_workers(workers=[gateway])
procs = hosts.spawn_procs(per_host={"procs": 2})
echo = procs.spawn("echo", Echo)
emit({"proc_pids": [v[1] for v in echo.echo.call("x").get(timeout=T).values()]})
sys.stdin.readline()  # killed before this returns
"""

_TLS = _COMMON + """
failures = []
am.unhandled_fault_hook = failures.append
gateway, *workers = sys.argv[1:]
attach(gateway)
hosts = attach_to_workers(workers=workers)
procs = hosts.spawn_procs(per_host={"procs": 1})
echo = procs.spawn("echo", Echo)
port, recv = Channel.open()
echo.send_to.broadcast(port, "pushed")
out = {"echo": [v[0] for v in echo.echo.call("tls").get(timeout=T).values()], "pushed": [recv.recv().get(timeout=T) for _ in range(2)],
       "tls": current_runtime()._listener.conn._transport.get_extra_info("ssl_object") is not None}
procs.stop().get(timeout=T)  # a deliberate stop: its relayed connection losses are no failure
out["failures"] = [str(f) for f in failures]
emit(out)
"""

_ERRORS = _COMMON + """
from actormesh.errors import AuthenticationError, TransportError
from actormesh.runtime import runtime_started

gateway, closed_port, wrong_secret, right_secret, not_a_gateway, plain_secret = sys.argv[1:]
out = {}


def attempt(key, addr, exc_type):
    try:
        attach(addr)
        out[key] = "no error"
    except exc_type as exc:
        out[key] = f"{type(exc).__name__}: {exc}"


attempt("bad", "http://nowhere:1", ValueError)
attempt("unreachable", f"tcp://127.0.0.1:{closed_port}", TransportError)
os.environ["ACTORMESH_SECRET_FILE"] = wrong_secret
attempt("wrong_secret", gateway, TransportError)
os.environ["ACTORMESH_SECRET_FILE"] = plain_secret
attempt("not_gateway", not_a_gateway, TransportError)
out["started_after_failures"] = runtime_started()
os.environ["ACTORMESH_SECRET_FILE"] = right_secret
attach(gateway)
out["address"] = current_runtime().address
attempt("again", gateway, RuntimeError)
from actormesh.actor import this_proc
out["in_client"] = this_proc().spawn("local", Echo).echo.call_one("here").get(timeout=T) == ("here", os.getpid())
try:
    this_host().spawn_procs(per_host={"local": 1}).initialized.get(timeout=T)
    out["local_spawn"] = "no error"
except RuntimeError as exc:
    out["local_spawn"] = str(exc)
emit(out)
"""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _secret_file(path: Path, secret: bytes | None = None) -> str:
    path.write_text((secret or os.urandom(32)).hex())
    path.chmod(0o600)
    return str(path)


def _stop(procs: list[subprocess.Popen[Any]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def _listening(host: str, port: int) -> bool:
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.laddr.ip == host
               for c in psutil.net_connections("inet"))


class Workers:
    """Two workers (``run_worker_loop_forever``) on 127.0.0.5 and 127.0.0.6; with ``tls``
    their credentials include the job's CA, and every TCP channel is mutual TLS."""

    def __init__(self, tmp_path: Path, tls: bool = False) -> None:
        if tls:
            self.secret = str(tmp_path / "job.creds")
            subprocess.run([sys.executable, "-m", "actormesh.host", "--new-credentials", self.secret, "--tls"], check=True, timeout=60)
        else:
            self.secret = _secret_file(tmp_path / "job.secret")
        self.env = {**os.environ, "ACTORMESH_SECRET_FILE": self.secret}
        self.hosts = [(f"127.0.0.{i}", _free_port(f"127.0.0.{i}")) for i in (5, 6)]
        self.addresses = [f"tcp://{h}:{p}" for h, p in self.hosts]
        serve = "import sys; from actormesh.job import run_worker_loop_forever; run_worker_loop_forever(address=sys.argv[1])"
        self.procs = [subprocess.Popen([sys.executable, "-c", serve, a], env=self.env) for a in self.addresses]
        for host, port in self.hosts:
            wait_for(lambda: _listening(host, port), timeout=60, interval=0.05)

    def client(self, script: str, *args: str, tmp_path: Path, name: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        path = tmp_path / f"{name}.py"
        path.write_text(script)
        return subprocess.Popen([sys.executable, str(path), *args], env=env or self.env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def workers(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Workers]:
    w = Workers(tmp_path, tls=getattr(request, "param", False))
    try:
        yield w
    finally:
        _stop(w.procs)


def _result(client: subprocess.Popen[str], timeout: float = 150) -> dict[str, Any]:
    """The next RESULT line of ``client`` (its stderr in the failure message)."""
    deadline = time.monotonic() + timeout
    assert client.stdout is not None
    for line in client.stdout:  # bounded: the test's timeout, and the client's own T on every wait
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
        if time.monotonic() > deadline:
            break
    client.wait(timeout=10)
    raise AssertionError(f"client gave no result (rc={client.returncode}):\n{client.stderr.read() if client.stderr else ''}")


def test_attached_client_reaches_procs_on_two_hosts_only_through_its_gateway(workers: Workers, tmp_path: Path) -> None:
    gateway_host, gateway_port = workers.hosts[0]
    client = workers.client(_FULL, workers.addresses[0], *workers.addresses, tmp_path=tmp_path, name="full")
    try:
        out = _result(client)
        assert client.wait(timeout=60) == 0, client.stderr.read() if client.stderr else ""
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(timeout=10)
    # Its address names the gateway: procs reach it there, never at an address of its own.
    assert out["address"].startswith("via:") and out["address"].endswith(f"@tcp:{gateway_host}:{gateway_port}")
    assert out["echo"] == ["hi"] * 4 and len(set(out["proc_pids"])) == 4
    assert out["pushed"] == ["pushed"] * 4
    assert out["relayed"] == ["relayed", "from-inner"]
    assert out["burst"] and out["batched"]
    for when in ("sockets_busy", "sockets_end"):
        # One TCP connection (to the gateway), nothing listening, no socket file: nothing a proc could dial.
        assert out[when]["inet"] == [["ESTABLISHED", gateway_port]], (when, out[when])
        assert out[when]["unix_bound"] == [] and out[when]["job_sockets"] == [], (when, out[when])
    # The proc's death reaches the caller and, as a supervision event, the owner (as with direct connections).
    assert "echo.crash() failed" in out["crash"] and ("lost connection to the process at" in out["crash"] or "code 3" in out["crash"]), out["crash"]
    assert len(out["failures"]) == 1 and "echo{'hosts': 0/2, 'procs': 1/2}> and all its descendants have failed" in out["failures"][0], out["failures"]


def test_losing_the_gateway_fails_calls_at_once_naming_it(workers: Workers, tmp_path: Path) -> None:
    gateway, other = workers.addresses
    client = workers.client(_KILL_GATEWAY, gateway, other, tmp_path=tmp_path, name="kill_gateway")
    try:
        assert _result(client)["ready"] == "before"
        workers.procs[0].kill()  # the gateway (and all it relays) is gone
        workers.procs[0].wait(timeout=10)
        assert client.stdin is not None
        client.stdin.write("go\n")
        client.stdin.flush()
        out = _result(client)
        assert client.wait(timeout=60) == 0
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(timeout=10)
    named = f"lost the connection to the gateway at {gateway.replace('tcp://', 'tcp:')}"
    assert "echo.echo() failed" in out["after"] and named in out["after"], out["after"]
    # The owner hears it too, as a supervision event.
    assert len(out["failures"]) == 1 and named in out["failures"][0], out["failures"]


def test_a_frozen_gateway_is_noticed_by_its_client_within_the_link_timeout(workers: Workers, tmp_path: Path) -> None:
    """A gateway that stops answering closes nothing: the client's heartbeats, sent through
    it to the procs, go unanswered, and its calls fail as unreachable (link_timeout 2 s)."""
    gateway, other = workers.addresses
    env = {**workers.env, "ACTORMESH_LINK_TIMEOUT": "2", "ACTORMESH_HEARTBEAT_INTERVAL": "0.5"}
    client = workers.client(_FROZEN_GATEWAY, gateway, other, tmp_path=tmp_path, name="frozen_gateway", env=env)
    frozen = psutil.Process(workers.procs[0].pid)
    try:
        assert _result(client)["ready"] == "before"
        freeze(frozen.pid)
        assert client.stdin is not None
        client.stdin.write("go\n")
        client.stdin.flush()
        out = _result(client)
        assert client.wait(timeout=60) == 0
    finally:
        frozen.resume()
        if client.poll() is None:
            client.kill()
            client.wait(timeout=10)
    assert "unreachable" in out["after"] and "silent for" in out["after"], out
    assert out["took"] <= 2 + 5, out
    assert out["failures"] and all("unreachable" in f for f in out["failures"]), out  # the owner hears it too


def test_gateway_stops_the_procs_of_a_client_that_vanished(workers: Workers, tmp_path: Path) -> None:
    client = workers.client(_ORPHANS, workers.addresses[0], tmp_path=tmp_path, name="orphans")
    try:
        pids = _result(client)["proc_pids"]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        client.kill()  # no goodbye: only the duplex closing tells the gateway
        client.wait(timeout=10)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(timeout=10)

    def reaped_or_zombie(pid: int) -> bool:
        # One psutil call per check: a process can exit between two of them.
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def gone() -> bool:
        return all(reaped_or_zombie(p) for p in pids)

    wait_for(gone, timeout=60, interval=0.05)


@pytest.mark.parametrize("workers", [True], indirect=True, ids=["tls"])
def test_attach_over_tls(workers: Workers, tmp_path: Path) -> None:
    client = workers.client(_TLS, workers.addresses[0], *workers.addresses, tmp_path=tmp_path, name="tls")
    try:
        out = _result(client)
        assert client.wait(timeout=60) == 0
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(timeout=10)
    assert out == {"echo": ["tls", "tls"], "pushed": ["pushed", "pushed"], "tls": True, "failures": []}


def test_attach_errors_name_the_cause_and_leave_no_runtime_behind(workers: Workers, tmp_path: Path) -> None:
    from actormesh.runtime import current_runtime

    plain = current_runtime()  # this test process's runtime: no gateway
    plain_secret = _secret_file(tmp_path / "plain.secret", plain.secret)
    wrong = _secret_file(tmp_path / "wrong.secret")
    env = {**workers.env, "ACTORMESH_CONNECT_TIMEOUT": "1", "ACTORMESH_HANDSHAKE_TIMEOUT": "5"}
    client = workers.client(_ERRORS, workers.addresses[0], str(_free_port("127.0.0.1")), wrong, workers.secret,
                            plain.address, plain_secret, tmp_path=tmp_path, name="errors", env=env)
    try:
        out = _result(client)
        assert client.wait(timeout=60) == 0
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(timeout=10)
    assert out["bad"].startswith("ValueError: attach(): bad gateway address 'http://nowhere:1'"), out["bad"]
    assert "cannot reach the gateway" in out["unreachable"], out["unreachable"]
    assert out["wrong_secret"].startswith("AuthenticationError") and "secret" in out["wrong_secret"], out["wrong_secret"]
    assert "not a gateway" in out["not_gateway"], out["not_gateway"]
    assert out["started_after_failures"] is False
    assert out["address"].startswith("via:")
    assert out["again"].startswith("RuntimeError") and "before the first actor call or context()" in out["again"], out["again"]
    assert out["in_client"] is True  # actors in the attached client itself still work
    assert "cannot spawn procs on its own machine" in out["local_spawn"], out["local_spawn"]


def test_attach_after_the_runtime_started_is_a_runtime_error() -> None:
    from actormesh.actor import attach, context

    context()  # starts this process's runtime (if no other test did)
    with pytest.raises(RuntimeError, match=r"attach\(\) must be called before the first actor call or context\(\)"):
        attach("tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="bad gateway address"):
        attach("127.0.0.1:1")


def test_rebind_takes_effect_for_the_rest_of_a_batch(tmp_path: Path) -> None:
    """A gateway learns from a leg's HELLO who owns it and rebinds: frames that
    arrived in the same read as that HELLO must reach the new handler too."""
    import asyncio

    from actormesh.transport import connect, listen

    secret = os.urandom(32)
    first: list[bytes] = []
    rest: list[bytes] = []

    async def scenario() -> None:
        got_all = asyncio.Event()

        def take_rest(conn: Any, segments: list[Any]) -> None:
            rest.append(bytes(segments[0]))
            if len(rest) == 3:
                got_all.set()

        def take_first(conn: Any, segments: list[Any]) -> None:
            first.append(bytes(segments[0]))
            conn.rebind(on_frame=take_rest, on_close=lambda c, e: None)

        server = await listen(f"unix:{tmp_path / 'rebind.sock'}", secret, on_connection=lambda c: None, on_frame=take_first,
                              on_close=lambda c, e: None, max_frame_bytes=1 << 20, handshake_timeout_s=5)
        try:
            conn = await connect(f"unix:{tmp_path / 'rebind.sock'}", secret, on_frame=lambda c, f: None, on_close=lambda c, e: None,
                                 max_frame_bytes=1 << 20, handshake_timeout_s=5, timeout_s=10)
            for i in range(4):  # from the loop thread: one flush, one write, very likely one read
                conn.send([b"frame-%d" % i])
            await asyncio.wait_for(got_all.wait(), 20)
            conn.close()
        finally:
            server.close()

    asyncio.run(scenario())
    assert first == [b"frame-0"] and rest == [b"frame-1", b"frame-2", b"frame-3"]


def test_a_peer_first_routed_after_the_gateway_is_lost_is_unreachable() -> None:
    """A route made after the gateway was lost is dead with the same UNREACHABLE Cause
    as the routes that existed then, so a call to it raises ActorUnreachableError (with
    bare text as the cause it was a plain SupervisionError)."""
    import threading

    from actormesh.errors import ActorUnreachableError, Cause, CauseKind, supervision_error
    from actormesh.runtime._attached import AttachedRuntime

    rt = AttachedRuntime.__new__(AttachedRuntime)  # no gateway: only the routing table is exercised
    rt.attached_via, rt.closed = "tcp:127.0.0.1:1", False
    rt._routes, rt._dead, rt._routes_lock = {}, {}, threading.Lock()
    rt._on_gateway_close(None, None)  # the connection argument is not read
    dead = rt.route("via:late@tcp:127.0.0.1:1").dead
    assert isinstance(dead, Cause) and dead.kind is CauseKind.UNREACHABLE, repr(dead)
    assert "lost the connection to the gateway at tcp:127.0.0.1:1" in dead
    assert isinstance(supervision_error("call failed", dead), ActorUnreachableError)
