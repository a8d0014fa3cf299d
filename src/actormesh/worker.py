"""Entry point of a worker process: ``python -m actormesh.worker``.

Reads its bootstrap from stdin (a pipe from the parent: the job secret never
touches argv or the environment), arms the parent-death signal, runs the
optional bootstrap function, then serves until told to stop or orphaned.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from .runtime import ProcRuntime


def die_with_parent(parent_pid: int) -> None:
    """Arm SIGKILL for when the thread that forked us ends; exit now if it has already."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass
    if os.getppid() != parent_pid:  # parent died before the signal was armed
        os._exit(1)


def _pin_cpus() -> str | None:
    """Apply ``proc_bind={'cpus': ...}`` (sched_setaffinity); return an error text if it fails."""
    from .runtime import launch

    spec = os.environ.pop(launch.CPUS_ENV, None)  # not inherited by this proc's own children
    if not spec:
        return None
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError) as exc:
        return f"proc_bind cpus={spec!r} could not be applied: {exc} (this host has CPUs {sorted(os.sched_getaffinity(0))})"
    return None


def _run_bootstrap(encoded: str) -> str | None:
    """Run the spawner's bootstrap function; its traceback (to report in HELLO) if it raised."""
    from .transport import loads

    try:
        result = loads([base64.b64decode(encoded)])()
        if hasattr(result, "__await__"):
            import asyncio

            asyncio.run(result)
    except BaseException:
        return traceback.format_exc()
    return None


def _stop_when_asked(rt: ProcRuntime, stop: threading.Event) -> None:
    """Set ``stop`` once a STOP_PROC has let every actor stop, or the parent is lost."""
    from .runtime import STOP_MARGIN_S

    def on_stop_proc(env: tuple) -> None:
        # Every actor has cleanup_timeout to stop (see _cell); one deadline for all of
        # them, so the proc exits within cleanup_timeout + STOP_MARGIN_S whatever they do.
        deadline = time.monotonic() + rt.config.cleanup_timeout + STOP_MARGIN_S
        for cell in list(rt.actors.values()):
            cell.stop(None)

        def run() -> None:
            for cell in list(rt.actors.values()):
                cell.thread.join(max(0.0, deadline - time.monotonic()))
            # What the actors sent before they stopped still leaves (a reply, a port.send),
            # within the same deadline: a peer still being dialed must not lose it.
            rt.flush(max(0.0, deadline - time.monotonic()))
            stop.set()

        rt.threads.start(run, name="actormesh-stop")

    rt.handlers.stop_proc = on_stop_proc

    def parent_lost(address: str, reason: str) -> None:
        if address == rt.parent_address:
            stop.set()

    rt.handlers.peer_lost.append(parent_lost)


def main() -> None:
    """``python -m actormesh.worker``: the bootstrap spec comes on stdin."""
    serve(json.loads(sys.stdin.buffer.read()))


def serve(spec: dict) -> NoReturn:
    """Be the worker ``spec`` describes until told to stop; never returns.

    ``main`` calls it in a fresh interpreter, the host's zygote in a forked one
    (``actormesh.zygote``), where ``parent_pid`` is the zygote's."""
    die_with_parent(spec["parent_pid"])
    os.chdir(spec["cwd"])
    for p in reversed(spec["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)

    from . import telemetry
    from .transport import JobTLS
    from .runtime import ProcRuntime, kill_all_children, set_runtime
    import actormesh.mesh  # noqa: F401  (what messages to actors refer to: meshes, ports)
    from .debug import install_breakpoint_hook

    install_breakpoint_hook()  # breakpoint() in an actor pauses it for the debug console

    hello_error = _pin_cpus()
    if spec["bootstrap"] and hello_error is None:
        hello_error = _run_bootstrap(spec["bootstrap"])

    rt = ProcRuntime(
        secret=bytes.fromhex(spec["secret"]),
        name=spec["name"],
        root_address=spec["root"],
        parent_address=spec["parent"],
        job_dir=spec["job_dir"],
        transport=spec["transport"],
        listen_address=spec["address"],
        tls=JobTLS(*spec["tls"]) if spec.get("tls") else None,
    )
    rt.hello_error = hello_error
    set_runtime(rt)
    stop = threading.Event()
    _stop_when_asked(rt, stop)
    # Dial the parent: the connection's HELLO tells it we are ready.
    parent_route = rt.route(spec["parent"])  # a worker always has a parent, never itself
    parent_route.connecting = True  # type: ignore[union-attr]
    rt.start_dial(parent_route)  # type: ignore[arg-type]
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    kill_all_children(rt)
    telemetry.flush()  # os._exit skips the exporters' atexit flush (no-op when telemetry is off)
    rt.release_files()  # os._exit skips every cleanup: remove our socket file now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
