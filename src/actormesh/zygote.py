"""A host's zygote: ``python -m actormesh.zygote``, the interpreter workers are forked from.

Importing actormesh costs a fresh interpreter ~150 ms of CPU, most of the time
from ``spawn_procs`` to a first reply, and four procs starting at once on a
small host pay it four times over. The zygote pays it once: its spawner
(``runtime._zygote``) starts it on first use, and every worker after that is a
``fork()`` of it, already warm.

Its stdin is a Unix socket to the spawner. Requests come on it, each an 8-byte
header (body length, fd count) that carries the new worker's stdout and stderr
(SCM_RIGHTS), then a JSON body: the worker's bootstrap spec (it holds the job
secret, so it never touches argv or the environment) and its full environment.
Answers go back as JSON lines: ``{"id", "pid"}`` once forked (or ``"error"``),
``{"exit", "code"}`` when a worker ends (a negative code is the signal that
killed it, as ``Popen.returncode`` says).

The zygote runs no threads and no event loop: ``fork()`` copies only the thread
that calls it, so anything else running would be lost half-way in every child.
It dies with its spawner (the parent-death signal), and its workers with it.
"""

from __future__ import annotations

import gc
import io
import json
import os
import selectors
import signal
import socket
import struct
import sys
import traceback
from typing import Any, NoReturn

_ZYGOTE_ARG = b"actormesh.zygote\0"
_WORKER_ARG = b"actormesh.worker\0"
#: The index in ``sys.path`` of the directory ``-m`` added (the zygote's start directory).
_CWD_ENTRY: int | None = None
#: Request header: body length, number of file descriptors sent with it.
HEADER = struct.Struct("!II")


def _preload() -> None:
    """Import what every worker imports (see ``worker.serve``), so forks skip it."""
    import actormesh.mesh  # noqa: F401
    import actormesh.runtime  # noqa: F401
    import actormesh.telemetry  # noqa: F401
    import actormesh.transport  # noqa: F401
    from actormesh import debug, worker  # noqa: F401

    try:
        import uvloop  # noqa: F401
    except ImportError:
        pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the spawner closed the zygote's socket")
        buf += chunk
    return bytes(buf)


def _read_request(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, HEADER.size, 8)
    if not data:
        raise EOFError("the spawner closed the zygote's socket")
    if len(data) < HEADER.size:
        data += _recv_exact(sock, HEADER.size - len(data))
    length, nfds = HEADER.unpack(data)
    if len(fds) != nfds:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a zygote request announced {nfds} file descriptors and carried {len(fds)}")
    return json.loads(_recv_exact(sock, length)), fds


def _rename_as_worker() -> None:
    """Make ``ps`` and ``/proc/<pid>/cmdline`` say ``-m actormesh.worker``, as a worker
    started fresh does (tools find workers by it): rewrite the argument bytes in place.
    The two module names have the same length, so nothing else moves."""
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (stat fields 48 and 49)
        where = ctypes.string_at(start, end - start).find(_ZYGOTE_ARG)
        if where >= 0:
            ctypes.memmove(start + where, _WORKER_ARG, len(_WORKER_ARG))
    except (OSError, ValueError, IndexError):
        pass  # cosmetic: a worker that keeps the zygote's name works the same
    import actormesh.worker

    sys.argv[0] = actormesh.worker.__file__


def _become_worker(request: dict[str, Any], fds: list[int], keep_out: list[int], zygote_pid: int) -> NoReturn:
    """In the forked child: take the request's stdio and environment, then serve."""
    try:
        for fd in keep_out:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has it
        _rename_as_worker()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in {devnull, *fds}:
            os.close(fd)
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        eager = bool(env.get("PYTHONUNBUFFERED"))
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, io.TextIOWrapper):  # buffered as a fresh interpreter's would be on this fd
                line = eager or stream is sys.stderr or os.isatty(stream.fileno())
                stream.reconfigure(line_buffering=line, write_through=eager)
        from actormesh import config, worker

        config.reload_environment()
        spec = request["spec"]
        spec["parent_pid"] = zygote_pid  # the parent-death signal follows the zygote
        if _CWD_ENTRY is not None and _CWD_ENTRY < len(sys.path):
            sys.path[_CWD_ENTRY] = spec["cwd"]  # ``python -m`` started now would have put it there
        worker.serve(spec)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(1)  # never back into the zygote's loop


def _fork(sock: socket.socket, sel: selectors.EpollSelector, request: dict[str, Any], fds: list[int],
          children: dict[int, int]) -> None:
    zygote_pid = os.getpid()
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        sock.sendall(json.dumps({"id": request["id"], "error": f"fork failed: {exc}"}).encode() + b"\n")
        return
    if pid == 0:
        _become_worker(request, fds, [sock.fileno(), sel.fileno(), *children.values()], zygote_pid)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    children[pid] = pidfd
    sel.register(pidfd, selectors.EVENT_READ, pid)
    sock.sendall(json.dumps({"id": request["id"], "pid": pid}).encode() + b"\n")


def _reap(sock: socket.socket, sel: selectors.EpollSelector, pid: int, children: dict[int, int]) -> None:
    pidfd = children.pop(pid)
    sel.unregister(pidfd)
    os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    sock.sendall(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def serve(sock: socket.socket) -> None:
    """Fork a worker per request and report each one's end, until the spawner hangs up."""
    children: dict[int, int] = {}
    with selectors.EpollSelector() as sel:
        sel.register(sock, selectors.EVENT_READ, None)
        while True:
            for key, _ in sel.select():
                if key.data is not None:
                    _reap(sock, sel, key.data, children)
                    continue
                try:
                    request, fds = _read_request(sock)
                except EOFError:
                    return
                _fork(sock, sel, request, fds, children)


def main() -> None:
    """Entry point; the spawner sends ``{"parent_pid", "sys_path", "cwd"}`` first."""
    from actormesh.worker import die_with_parent

    sock = socket.socket(fileno=0)
    boot, _ = _read_request(sock)
    die_with_parent(boot["parent_pid"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the controller's to handle, not ours
    os.chdir(boot["cwd"])
    added = [p for p in boot["sys_path"] if p not in sys.path]
    sys.path[:0] = added
    global _CWD_ENTRY
    _CWD_ENTRY = len(added)  # where ``-m`` put our start directory
    _preload()
    # What is imported now lives as long as every worker: out of the collector's sight,
    # a collection in a worker neither scans it nor writes to (and so copies) its pages.
    gc.freeze()
    serve(sock)


if __name__ == "__main__":
    main()
