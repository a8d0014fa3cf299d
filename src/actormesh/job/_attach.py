"""Monarch's ``run_worker_loop_forever`` / ``attach_to_workers``: hosts you start
yourself (any launcher) and a controller that attaches to them by address.

Both sides take the job secret from the file named by ``ACTORMESH_SECRET_FILE``
(hex, mode 0600): the workers to authenticate their controller, the controller
to authenticate to them. Set it in the controller's environment before its
first actormesh call.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

from ..mesh import HostMesh, serve_agent, shutdown_requested
from ..runtime import Future
from ._controller import SECRET_ENV, credentials_from_env, runtime_with_secret, secret_from_env

__all__ = ["run_worker_loop_forever", "start_worker_loop_forever", "run_worker_loop_until_shutdown", "attach_to_workers", "attach", "normalize_address"]

_TRUST_ALL = "trust_all_connections"


def _check_ca(ca: str, private_key: Any) -> None:
    if ca != _TRUST_ALL:
        raise NotImplementedError(f"ca={ca!r} is not supported: only ca={_TRUST_ALL!r} (connections are authenticated with the job secret)")
    if private_key is not None:
        raise NotImplementedError("private_key is not supported (connections are authenticated with the job secret)")


def normalize_address(address: str) -> str:
    """``tcp://host:port`` (Monarch's form) or ``tcp:host:port`` -> ``tcp:host:port``; ``unix:/path`` as is."""
    if not isinstance(address, str):
        raise TypeError(f"a worker address must be a string like 'tcp://host:port', got {address!r}")
    m = re.fullmatch(r"tcp:(?://)?(\[[^\]]+\]|[^:\[\]/]+):(\d+)", address)
    if m:
        host = m.group(1)
        if host == "*":
            raise ValueError(f"wildcard address {address!r}: give the host name or IP the controller should dial")
        return f"tcp:{host}:{m.group(2)}"
    if address.startswith("unix:") and len(address) > 5:
        return "unix:" + address[5:].removeprefix("//")
    raise ValueError(f"bad worker address {address!r}: expected 'tcp://HOST:PORT' or 'unix:/path'")


def run_worker_loop_forever(*, address: str, ca: str = _TRUST_ALL, private_key: Any = None) -> None:
    """Serve this machine as a host at ``address`` until SIGTERM/SIGINT (never returns).

    Controllers attach with :func:`attach_to_workers`. The job secret is read
    from ``ACTORMESH_SECRET_FILE``. Example (on each worker machine)::

        ACTORMESH_SECRET_FILE=~/job.secret python -c \\
            "from actormesh.job import run_worker_loop_forever; run_worker_loop_forever(address='tcp://10.0.0.5:26600')"
    """
    _check_ca(ca, private_key)
    addr = normalize_address(address)
    secret_from_env("run_worker_loop_forever")  # fail here, with our message, before anything starts
    import os

    from ..host import main

    main(["--address", addr, "--secret-file", os.environ[SECRET_ENV]])


def start_worker_loop_forever(*, address: str, ca: str = _TRUST_ALL, private_key: Any = None) -> Future[None]:
    """Serve this machine as a host at ``address`` without blocking; return a Future of its lifetime.

    The server is listening when this returns and keeps serving if the Future
    is dropped; it completes with None once a controller calls
    ``HostMesh.shutdown()`` (this process's procs are stopped and its runtime
    closed; the process lives on). A controller that disconnects only has its
    procs stopped: the host waits for the next one. The job secret is read from
    ``ACTORMESH_SECRET_FILE``; this process must not run an actormesh runtime yet.
    """
    from ..runtime import runtime_started, shutdown_context

    _check_ca(ca, private_key)
    addr = normalize_address(address)
    secret, tls = credentials_from_env("start_worker_loop_forever")
    if runtime_started():
        raise RuntimeError("start_worker_loop_forever(): this process already runs an actormesh runtime "
                           "(a controller or another worker loop); start the worker loop in a fresh process")
    rt = serve_agent(addr, secret, tls=tls)
    done: Future[None] = Future._create()

    def finish() -> None:
        try:
            shutdown_context()
        finally:
            done._set_result(None)

    shutdown_requested(rt)._add_done_callback(lambda _: threading.Thread(target=finish, name="actormesh-worker-shutdown", daemon=True).start())
    return done


def run_worker_loop_until_shutdown(*, address: str, ca: str = _TRUST_ALL, private_key: Any = None) -> None:
    """Serve this machine as a host at ``address`` until a controller calls ``HostMesh.shutdown()``, then return.

    Like :func:`run_worker_loop_forever`, but the process is not ended: the
    host's procs are stopped and its runtime closed before this returns.
    """
    lifetime = start_worker_loop_forever(address=address, ca=ca, private_key=private_key)
    while True:  # a timed wait keeps Ctrl-C responsive while the host serves
        try:
            return lifetime.get(timeout=1.0)
        except TimeoutError:
            continue


def attach_to_workers(*, workers: Sequence[Any], ca: str = _TRUST_ALL, name: str | None = None, private_key: Any = None) -> HostMesh:
    """A host mesh ``{hosts: len(workers)}`` of workers started with
    :func:`run_worker_loop_forever` (addresses, or Futures of addresses).

    Returns at once; ``mesh.initialized.get()`` checks that every worker answers.
    The job secret comes from ``ACTORMESH_SECRET_FILE`` (with TLS material when
    the file has it: ``python -m actormesh.host --new-credentials F --tls``); this
    process's runtime must not have started with other credentials. ``name`` is accepted for
    Monarch compatibility and unused. Example::

        hosts = attach_to_workers(workers=["tcp://10.0.0.5:26600", "tcp://10.0.0.6:26600"])
        procs = hosts.spawn_procs(per_host={"gpus": 8})
    """
    _check_ca(ca, private_key)
    if isinstance(workers, str) or not workers:
        raise ValueError(f"workers must be a non-empty list of addresses like 'tcp://host:port', got {workers!r}")
    resolved = [w.get(timeout=60) if hasattr(w, "get") else w for w in workers]
    addresses = [normalize_address(w) for w in resolved]
    secret, tls = credentials_from_env("attach_to_workers")
    runtime_with_secret(secret, "attach_to_workers", tls=tls)
    return HostMesh(agents=addresses)


def attach(addr: str) -> None:
    """Route all of this client's traffic through the gateway at ``addr`` (Monarch's ``attach``).

    For a client the job's procs cannot dial, e.g. one outside a Kubernetes
    cluster: ``addr`` (``tcp://host:port``, ``unix:/path`` or ``ipc:///path``)
    is a worker's address as this machine reaches it (typically the local end
    of a port-forward to a worker started with :func:`run_worker_loop_forever`).
    The client connects out to it once, authenticated with the job secret from
    ``ACTORMESH_SECRET_FILE``; every message to the job's procs and every
    message back travels over that one connection, relayed by that worker.
    Call it first, before ``context()``, ``attach_to_workers()`` or any
    spawn: afterwards it raises RuntimeError. Procs cannot be spawned on the
    attached client's own machine (``this_host().spawn_procs()``); actors in
    this process (``this_proc().spawn``) work. Example::

        attach("tcp://127.0.0.1:26600")          # kubectl port-forward pod/worker-0 26600
        hosts = attach_to_workers(workers=["tcp://worker-0.job:26600", "tcp://worker-1.job:26600"])
    """
    from ..runtime import attach_gateway, runtime_started

    try:
        address = normalize_address("unix:" + addr[len("ipc://"):] if isinstance(addr, str) and addr.startswith("ipc://") else addr)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"attach(): bad gateway address {addr!r}: expected 'tcp://HOST:PORT' (e.g. the local end of a "
                        "port-forward to a worker), 'unix:/path' or 'ipc:///path'") from None
    if runtime_started():
        raise RuntimeError("attach() must be called before the first actor call or context() in this process: "
                           "its actormesh runtime has started already. Call attach(addr) first thing.")
    secret, tls = credentials_from_env("attach()")
    attach_gateway(address, secret=secret, tls=tls)
