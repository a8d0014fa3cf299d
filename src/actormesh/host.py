"""``python -m actormesh.host``: run a host agent (see actormesh.mesh._host_agent).

The job secret is read from a file (``--secret-file`` or ``ACTORMESH_SECRET_FILE``)
that must be readable by its owner only; it never travels in argv.
"""

from __future__ import annotations

import argparse
import os
import signal
import stat
import sys
import threading


def read_secret(path: str) -> bytes:
    """Read a job secret file, refusing one that others can read."""
    st = os.stat(path)
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SystemExit(f"secret file {path} must not be accessible by group or others (chmod 600 {path})")
    with open(path, "rb") as f:
        data = f.read().strip()
    try:
        return bytes.fromhex(data.decode())
    except ValueError:
        return data


def main(argv: list[str] | None = None) -> None:
    """Serve as this host's agent until killed or the controller asks it to exit."""
    ap = argparse.ArgumentParser(prog="python -m actormesh.host", description="actormesh host agent")
    ap.add_argument("--address", default="tcp:127.0.0.1:0", help="where to listen (tcp:HOST:PORT or unix:/path)")
    ap.add_argument("--secret-file", default=os.environ.get("ACTORMESH_SECRET_FILE"), help="file holding the job secret (hex)")
    ap.add_argument("--controller", default=None, help="controller address to dial and announce this agent to")
    ap.add_argument("--print-address", action="store_true", help="print the listening address on stdout once ready")
    args = ap.parse_args(argv)
    if not args.secret_file:
        raise SystemExit("a job secret is required: --secret-file PATH or ACTORMESH_SECRET_FILE")
    secret = read_secret(args.secret_file)
    from .mesh._host_agent import serve_agent

    rt = serve_agent(args.address, secret, args.controller)
    if args.print_address:
        print(rt.address, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if args.controller:
        rt.on_peer_lost.append(lambda address, reason: stop.set() if address == args.controller else None)
    while not stop.wait(0.5):  # a timed wait lets the main thread run signal handlers
        pass
    from .runtime._spawn import kill_all_children

    kill_all_children(rt)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
