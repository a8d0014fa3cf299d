"""``python -m actormesh.job._keeper DIR``: apply the job ``DIR/request.json`` names
and hold it until SIGTERM/SIGINT or until it breaks (see ``_applied.py``).

Exit status: 0 after a requested stop, 1 when applying failed (``DIR/error.txt``
says why), 2 when the job broke while held.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from ._applied import load_job, read_json, write_json


def _apply(directory: str, request: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    from ..config import get_config
    from ..host import format_credentials
    from ..runtime import current_runtime

    job = load_job(request["target"], request.get("attr"))
    state = job.state(cached_path=os.path.join(directory, "job_state.pkl"))
    meshes = {name: state[name].host_info().get(timeout=60) for name in state.names()}
    rt = current_runtime()
    fd = os.open(os.path.join(directory, "credentials"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(format_credentials(rt.secret, rt.tls) + "\n")
    record = {
        "keeper_pid": os.getpid(),
        "job": repr(job),
        "target": request["target"],
        "attr": request.get("attr"),
        "meshes": meshes,
        "controller": rt.address,
        "transport": "tcp" if rt.address.startswith("tcp:") else "unix",
        "bind_host": get_config().bind_host,
        "applied_at": time.time(),
    }
    return job, record


def main(argv: list[str]) -> int:
    """Apply, publish the record, hold; see the module docstring."""
    directory = os.path.abspath(argv[0])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    request = read_json(os.path.join(directory, "request.json"))
    if request is None:
        print(f"no request.json in {directory}", file=sys.stderr)
        return 1
    sys.path.insert(0, os.getcwd())
    try:
        job, record = _apply(directory, request)
    except BaseException as exc:
        traceback.print_exc()
        with open(os.path.join(directory, "error.txt"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}\n")
        return 1
    write_json(os.path.join(directory, "record.json"), record)
    print(f"holding {record['job']} (pid {os.getpid()})", flush=True)
    broken = False
    while not stop.wait(1.0):  # a timed wait lets the main thread run the signal handlers
        if not job.active:
            broken = True
            with open(os.path.join(directory, "error.txt"), "w") as f:
                f.write(f"the job {record['job']} broke while held (a host agent exited); see keeper.log\n")
            break
    try:
        job.kill()
    finally:
        for name in ("record.json", "credentials", "job_state.pkl", "request.json"):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass
    print("released the job", flush=True)
    return 2 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
