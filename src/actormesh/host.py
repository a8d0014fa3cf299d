"""``python -m actormesh.host``: run a host agent (see actormesh.mesh._host_agent).

The job secret is read from a file (``--secret-file`` or ``ACTORMESH_SECRET_FILE``)
that must be readable by its owner only; it never travels in argv. The file is
one line: the secret in hex, then, for jobs that use TLS, a space and the job's
TLS material (``JobTLS.to_token()``). ``--new-credentials PATH [--tls]`` writes
such a file.
"""

from __future__ import annotations

import argparse
import os
import signal
import stat
import sys
import threading
from typing import Any


def read_secret(path: str) -> bytes:
    """Read a job secret file, refusing one that others can read."""
    return read_credentials(path)[0]


def read_credentials(path: str) -> tuple[bytes, Any]:
    """(secret, JobTLS or None) from a credentials file, refusing one that others can read."""
    from .transport import JobTLS

    st = os.stat(path)
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SystemExit(f"secret file {path} must not be accessible by group or others (chmod 600 {path})")
    with open(path, "rb") as f:
        data = f.read().strip()
    head, _, tls = data.partition(b" ")
    try:
        secret = bytes.fromhex(head.decode())
    except ValueError:
        return data, None  # a user's own secret, not hex: used as it is
    if not tls.strip():
        return secret, None
    try:
        return secret, JobTLS.from_token(tls.strip().decode())
    except ValueError as exc:
        raise SystemExit(f"secret file {path}: {exc}") from None


def format_credentials(secret: bytes, tls: Any = None) -> str:
    """The one-line credentials text :func:`read_credentials` reads."""
    return secret.hex() if tls is None else f"{secret.hex()} {tls.to_token()}"


def _new_credentials(path: str, tls: bool) -> None:
    import secrets

    from .transport import JobTLS

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(format_credentials(secrets.token_bytes(32), JobTLS.generate() if tls else None) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Serve as this host's agent until killed or the controller asks it to exit."""
    ap = argparse.ArgumentParser(prog="python -m actormesh.host", description="actormesh host agent")
    ap.add_argument("--address", default="tcp:127.0.0.1:0", help="where to listen (tcp:HOST:PORT or unix:/path)")
    ap.add_argument("--secret-file", default=os.environ.get("ACTORMESH_SECRET_FILE"), help="file holding the job secret (hex)")
    ap.add_argument("--controller", default=None, help="controller address to dial and announce this agent to")
    ap.add_argument("--print-address", action="store_true", help="print the listening address on stdout once ready")
    ap.add_argument("--workspace-dir", help="where HostMesh.sync_workspace puts directories on this host (sets ACTORMESH_WORKSPACE_DIR)")
    ap.add_argument("--new-credentials", metavar="PATH", help="write a new credentials file (mode 0600) and exit")
    ap.add_argument("--tls", action="store_true", help="with --new-credentials: include TLS material (needs 'cryptography')")
    args = ap.parse_args(argv)
    if args.new_credentials:
        _new_credentials(args.new_credentials, args.tls)
        return
    if not args.secret_file:
        raise SystemExit("a job secret is required: --secret-file PATH or ACTORMESH_SECRET_FILE")
    secret, tls = read_credentials(args.secret_file)
    if args.workspace_dir:
        os.environ["ACTORMESH_WORKSPACE_DIR"] = os.path.abspath(args.workspace_dir)  # procs inherit it
    from .mesh import serve_agent, shutdown_requested

    rt = serve_agent(args.address, secret, args.controller, tls=tls)
    shut = shutdown_requested(rt)
    if args.print_address:
        print(rt.address, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if args.controller:
        rt.handlers.peer_lost.append(lambda address, reason: stop.set() if address == args.controller else None)
    while not stop.wait(0.5) and not shut.done():  # a timed wait lets the main thread run signal handlers
        pass
    from .runtime import kill_all_children

    kill_all_children(rt)
    rt.release_files()  # os._exit skips every cleanup: our socket and job directory go now
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
