"""The controller side of a job: its runtime, its address as agents see it, and
the job secret written for agents (0600 file in a 0700 directory).

Two helpers here reach into the runtime's private start-up (marked below):
starting the controller's runtime with a given secret and telling whether it
has started. They stand in for small public hooks the runtime layer may add.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import tempfile
from typing import Any

from ..config import configure, get_config
from ._errors import JobError

log = logging.getLogger("actormesh.job")

__all__ = ["runtime_started", "controller_address", "write_secret_file", "secret_from_env", "credentials_from_env", "runtime_with_secret", "is_loopback"]

SECRET_ENV = "ACTORMESH_SECRET_FILE"


def runtime_started() -> bool:
    """Whether this process's actormesh runtime is already running."""
    from ..runtime import runtime_started as started

    return started()


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (so a unix controller is reachable)."""
    if host in ("localhost", "::1"):
        return True
    try:
        return socket.inet_aton(host)[0] == 127 and host.count(".") == 3
    except OSError:
        return False


def controller_address(*, need_tcp: bool, bind_host: str | None = None, what: str = "this job") -> str:
    """The controller's address for agents to dial, starting its runtime if needed.

    With ``need_tcp`` (agents on other machines) a runtime that has not started
    yet is configured for TCP on ``bind_host`` (default ``0.0.0.0``, advertised
    under this machine's host name); a runtime already listening on a unix
    socket is an error that says how to fix it.
    """
    from ..runtime import current_runtime

    if need_tcp and not runtime_started() and get_config().default_transport != "tcp":
        host = bind_host or (get_config().bind_host if get_config().bind_host != "127.0.0.1" else "0.0.0.0")
        log.info("%s needs a controller reachable over TCP: listening on %s", what, host)
        configure(default_transport="tcp", bind_host=host)
    address = current_runtime().address
    if need_tcp and not address.startswith("tcp:"):
        raise JobError(
            f"{what} needs the controller to listen on TCP so that remote host agents can dial it, "
            f"but this process's runtime already listens at {address}. Call "
            "actormesh.config.configure(default_transport='tcp', bind_host='0.0.0.0') before the first actormesh call."
        )
    if need_tcp and bind_host is None:
        host = address[4:].rsplit(":", 1)[0]
        if is_loopback(host):
            log.warning("%s: the controller listens on %s, reachable from this machine only", what, address)
    return address


def write_secret_file(directory: str, secret: bytes, name: str = "secret", tls: Any = None) -> str:
    """Write the job credentials (``secret`` as hex, then ``tls`` if given: see
    ``actormesh.host``) to a new 0600 file in ``directory`` (made 0700); return its path."""
    from ..host import format_credentials

    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    fd, path = tempfile.mkstemp(prefix=f"{name}-", dir=directory)  # mkstemp creates it 0600
    try:
        os.write(fd, format_credentials(secret, tls).encode())
    finally:
        os.close(fd)
    return path


def secret_from_env(purpose: str) -> bytes:
    """The job secret from the file named by ``ACTORMESH_SECRET_FILE`` (mode 0600)."""
    return credentials_from_env(purpose)[0]


def credentials_from_env(purpose: str) -> tuple[bytes, Any]:
    """(secret, JobTLS or None) from the file named by ``ACTORMESH_SECRET_FILE`` (mode 0600)."""
    from ..host import read_credentials

    path = os.environ.get(SECRET_ENV)
    if not path:
        raise JobError(
            f"{purpose} needs the job secret: set {SECRET_ENV} to a file that holds it as hex, readable by its owner only "
            f"(e.g. python -c 'import secrets; print(secrets.token_hex(32))' > job.secret && chmod 600 job.secret)"
        )
    try:
        return read_credentials(path)
    except SystemExit as exc:  # read_secret's message for a group/world-readable file
        raise JobError(str(exc)) from None
    except OSError as exc:
        raise JobError(f"cannot read the job secret from {SECRET_ENV}={path}: {exc}") from exc


def runtime_with_secret(secret: bytes, purpose: str, tls: Any = None) -> Any:
    """The controller's runtime, started with ``secret`` (and ``tls``) unless it already runs.

    A runtime that already runs with another secret cannot talk to agents
    that hold ``secret``: that is an error naming the fix.
    """
    from ..runtime import current_runtime

    rt = current_runtime(secret=secret, tls=tls)
    if not hmac.compare_digest(rt.secret, secret):
        raise JobError(
            f"{purpose}: this process's runtime started before the job secret was known and uses another secret. "
            f"Set {SECRET_ENV} before the first actormesh call in this process."
        )
    if tls is not None and (rt.tls is None or rt.tls.ca_pem != tls.ca_pem):
        raise JobError(f"{purpose}: the job's credentials include TLS material, but this process's runtime started "
                       f"{'without TLS' if rt.tls is None else 'with another CA'}. Set {SECRET_ENV} before the first actormesh call in this process.")
    return rt
