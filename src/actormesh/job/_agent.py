"""``python -m actormesh.job._agent``: a host agent for a job, on a concrete address.

Schedulers and ssh start this on every host. It listens on ``--bind`` or, by
default, on the local address this host uses to reach the controller (found
with a connected UDP socket: no packet is sent, no DNS name is needed), so the
address it announces is one the controller can dial. Then it runs
``python -m actormesh.host`` in this process.
"""

from __future__ import annotations

import argparse
import socket

__all__ = ["route_address", "main"]


def route_address(controller: str) -> str:
    """This host's address on the route to ``controller`` (``tcp:HOST:PORT``)."""
    if not controller.startswith("tcp:"):
        return "127.0.0.1"  # a unix-socket controller is on this machine
    host, port = controller[4:].rsplit(":", 1)
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    info = socket.getaddrinfo(host, int(port), family if ":" in host else 0, socket.SOCK_DGRAM)
    family, _, _, _, target = info[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(target)
        return str(s.getsockname()[0])


def main(argv: list[str] | None = None) -> None:
    """Parse the job's agent options and serve as this host's agent."""
    ap = argparse.ArgumentParser(prog="python -m actormesh.job._agent", description="actormesh host agent for a job")
    ap.add_argument("--controller", required=True, help="controller address to dial (tcp:HOST:PORT)")
    ap.add_argument("--secret-file", required=True, help="file holding the job secret (hex, mode 0600)")
    ap.add_argument("--bind", default=None, help="address to listen on (default: the one on the route to the controller)")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (default: any free one)")
    args = ap.parse_args(argv)
    host = args.bind or route_address(args.controller)
    shown = f"[{host}]" if ":" in host else host
    from ..host import main as host_main

    host_main(["--address", f"tcp:{shown}:{args.port}", "--controller", args.controller, "--secret-file", args.secret_file])


if __name__ == "__main__":
    main()
