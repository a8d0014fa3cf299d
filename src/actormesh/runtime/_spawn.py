"""Starting, watching and stopping worker processes on this host.

A worker is ``python -m actormesh.worker``. Its bootstrap (the job
secret, addresses, settings, an optional bootstrap function) arrives on stdin
from a pipe, never in argv or the environment. The worker arms
``PR_SET_PDEATHSIG`` so it dies with its parent; the parent forks from its
long-lived loop thread, since the signal follows the *thread* that forked.

Exits are watched with a pidfd on the loop (no thread per child). An exit is
reported with its cause (exit code or signal) to everything waiting on that proc.
Silent children are judged by the rules of ``_liveness.py`` (driven by
``_heartbeat.py``): a stopped or hung child is killed (so no late reply can
arrive), a busy one never.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import Cause, CauseKind
from ..transport import dumps
from ._future import Future, gather
from ._launch import ProcCommand, default_command
from ._messages import Hello
from ._routes import Route
from ._zygote import ForkedProc, Zygote, zygote_available
from ._heartbeat import Heartbeat
from ._liveness import LivenessJudge, Policy, describe_exit, proc_available, read_proc

if TYPE_CHECKING:
    from ._proc import ProcRuntime

log = logging.getLogger("actormesh.spawn")

__all__ = ["ChildProc", "spawn_children", "stop_children", "exit_cause", "kill_all_children", "STOPPED"]

#: The cause of a proc stopped on purpose (its exit is not a failure).
STOPPED = Cause("the proc was stopped", CauseKind.STOPPED)


def exit_cause(returncode: int, *, rss_bytes: int | None = None, killed_by_spawner: bool = False) -> Cause:
    """Monarch's wording for how a process ended (e.g. ``failed: Killed(sig=9)``),
    with its last seen memory and whether its spawner sent the signal."""
    return describe_exit(returncode, rss_bytes=rss_bytes, killed_by_spawner=killed_by_spawner)


@dataclass
class ChildProc:
    """A worker process this process started."""

    name: str
    address: str
    #: How it was started: a fresh interpreter, or a fork of this host's zygote.
    popen: subprocess.Popen[bytes] | ForkedProc | None = None
    ready: Future[Any] = field(default_factory=Future._create)
    exited: Future[Any] = field(default_factory=Future._create)
    stopping: bool = False
    returncode: int | None = None
    #: Name of the actor (or "client") that spawned it: it dies with its owner.
    owner: str = "client"
    #: The liveness settings in force when it was spawned.
    policy: Policy = field(default_factory=Policy)
    #: Its resident memory when its spawner last looked (for the exit report).
    rss_bytes: int | None = None
    #: Whether its spawner sent it SIGKILL.
    killed: bool = False
    #: Completed when its stdout/stderr are read to the end (set by whoever reads them).
    pumps: list[Future[None]] = field(default_factory=list)


def _free_tcp_address(host: str) -> str:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        host, port = s.getsockname()[:2]  # numeric: what the worker's listener will report
    shown = f"[{host}]" if ":" in host else host
    return f"tcp:{shown}:{port}"


def _listen_host(address: str, default: str) -> str:
    from ..transport import parse_address

    try:
        scheme, target = parse_address(address)
    except ValueError:
        return default
    return target[0] if scheme == "tcp" else default


def _install_hello(runtime: ProcRuntime) -> None:
    if runtime.heartbeat is not None:
        return
    runtime.heartbeat = Heartbeat(runtime, LivenessJudge(time.monotonic, read_proc if proc_available() else None), _kill)
    runtime.heartbeat.start()

    def on_hello(conn: Any, env: Hello) -> bool:
        child = runtime.children.get(env.address)
        if child is None:
            return False
        route = runtime._routes.get(env.address)
        if env.error is not None:
            _kill(child)
            runtime.peer_gone(child.address, Cause(f"the proc's bootstrap function failed: {env.error}", CauseKind.RAISED))
            child.ready._set_exception(RuntimeError(f"bootstrap of proc {child.name} failed:\n{env.error}"))
            return True
        if isinstance(route, Route):  # a child's address is never this process's own
            route.publish(conn)
        child.ready._set_result(True)
        return True

    runtime.handlers.hello = on_hello


def spawn_children(
    runtime: ProcRuntime,
    names: Sequence[str],
    *,
    bootstrap: Callable[[], Any] | None = None,
    bootstrap_blob: bytes | None = None,
    env: dict[str, str] | None = None,
    owner: str = "client",
    stdio: Callable[[ChildProc, Any, Any], None] | None = None,
    commands: Sequence[ProcCommand | None] | None = None,
) -> list[ChildProc]:
    """Start one worker per name (non-blocking). Messages to them queue until ready.

    ``bootstrap_blob`` is an already pickled bootstrap function (a host agent
    passes it through without unpickling user code). ``stdio(child, out, err)``,
    when given, receives the child's stdout/stderr pipes (else they are inherited).
    ``commands[i]``, when given, launches worker ``i`` (see ``_launch``); the
    default is ``python -m actormesh.worker``.
    """
    if commands is not None and len(commands) != len(names):
        raise ValueError(f"spawn_children: {len(commands)} commands for {len(names)} procs")
    if runtime.attached_via is not None:  # children would dial it; it listens on nothing
        from ._attached import LOCAL_SPAWN_REFUSED

        raise RuntimeError(LOCAL_SPAWN_REFUSED.format(gateway=runtime.attached_via))
    _install_hello(runtime)
    from ..config import get_config

    cfg = get_config()
    children = [_new_child(runtime, name, owner, cfg) for name in names]
    if bootstrap is not None:
        bootstrap_blob = bytes(dumps(bootstrap, out_of_band=False)[0])
    blob_fn = base64.b64encode(bootstrap_blob).decode() if bootstrap_blob is not None else None
    launch_env = cfg.to_env()
    launch_env["ACTORMESH_TRANSPORT_IN_USE"] = runtime.transport
    if stdio is not None:
        launch_env["PYTHONUNBUFFERED"] = "1"  # lines reach the pipe as they are printed
    if env:
        launch_env.update(env)

    def start() -> None:
        for child, command in zip(children, commands or [None] * len(children)):
            if command is None and not cfg.proc_zygote:
                command = default_command()
            _start_one(runtime, child, command, blob_fn, launch_env, stdio, cfg.proc_spawn_timeout)

    if runtime.in_loop():
        start()
    else:
        runtime.loop.call_soon_threadsafe(start)
    return children


def _new_child(runtime: ProcRuntime, name: str, owner: str, cfg: Any) -> ChildProc:
    """A child's record, before it is started: its address, the liveness settings in force."""
    if runtime.transport == "unix":
        address = f"unix:{os.path.join(runtime.job_dir, f'{name}-{os.urandom(4).hex()}.sock')}"
    else:
        # Children listen on the interface their spawner was reached on.
        address = _free_tcp_address(_listen_host(runtime.address, cfg.bind_host))
    child = ChildProc(name=name, address=address, owner=owner,
                      policy=Policy(cfg.heartbeat_interval, cfg.heartbeat_timeout, cfg.hung_timeout))
    runtime.children[address] = child
    runtime.expect_child(address)
    return child


def _start_one(
    runtime: ProcRuntime,
    child: ChildProc,
    command: ProcCommand | None,
    blob_fn: str | None,
    launch_env: dict[str, str],
    stdio: Callable[[ChildProc, Any, Any], None] | None,
    spawn_timeout_s: float,
) -> None:
    """Start one worker (loop thread): forked by this host's zygote unless a command
    of its own is asked for; its bootstrap never goes in argv or the environment."""
    spec = {
        "secret": runtime.secret.hex(),
        "name": child.name,
        "address": child.address,
        "parent": runtime.address,
        "root": runtime.root_address,
        "job_dir": runtime.job_dir,
        "transport": runtime.transport,
        "sys_path": [p for p in sys.path if p],
        "cwd": os.getcwd(),
        "parent_pid": os.getpid(),
        "bootstrap": blob_fn,
        "tls": None if runtime.tls is None else [runtime.tls.ca_pem, runtime.tls.cert_pem, runtime.tls.key_pem],
    }
    try:
        zygote = _zygote(runtime) if command is None else None
        if zygote is not None:
            _fork_one(runtime, child, zygote, spec, default_command().environment(os.environ, launch_env), stdio)
        else:
            _popen_one(runtime, child, command or default_command(), spec, launch_env, stdio)
    except OSError as exc:
        _start_failed(runtime, child, f"could not start proc {child.name}: {exc}", exc)
        return
    runtime.loop.call_later(spawn_timeout_s, _check_started, runtime, child, spawn_timeout_s, zygote)


def _start_failed(runtime: ProcRuntime, child: ChildProc, why: str, exc: BaseException | None = None) -> None:
    runtime.peer_gone(child.address, Cause(why, CauseKind.UNREACHABLE, error=exc))
    failed = RuntimeError(why)
    failed.__cause__ = exc  # as ``raise ... from exc`` would: whoever waits on ready sees both
    child.ready._set_exception(failed)
    child.exited._set_result(None)


def _popen_one(runtime: ProcRuntime, child: ChildProc, command: ProcCommand, spec: dict[str, Any],
               launch_env: dict[str, str], stdio: Callable[[ChildProc, Any, Any], None] | None) -> None:
    """A fresh interpreter: the bootstrap goes to its stdin."""
    popen = subprocess.Popen(
        list(command.argv),
        executable=command.executable,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE if stdio else None,
        stderr=subprocess.PIPE if stdio else None,
        env=command.environment(os.environ, launch_env),
        close_fds=True,
    )
    assert popen.stdin is not None
    popen.stdin.write(json.dumps(spec).encode())
    popen.stdin.close()
    child.popen = popen
    if stdio is not None:
        stdio(child, popen.stdout, popen.stderr)
    _watch(runtime, child)


def _zygote(runtime: ProcRuntime) -> Zygote | None:
    if not zygote_available():
        return None
    zygote = runtime.zygote
    if zygote is None:
        zygote = runtime.zygote = Zygote(runtime.loop)
    elif zygote.stuck:
        zygote = runtime.zygote = zygote.successor()
    return zygote


def _fork_one(runtime: ProcRuntime, child: ChildProc, zygote: Zygote, spec: dict[str, Any],
              env: dict[str, str], stdio: Callable[[ChildProc, Any, Any], None] | None) -> None:
    """A fork of the warm zygote: the bootstrap goes over its socket."""
    def forked(proc: ForkedProc | None, error: str | None) -> None:
        if proc is None:
            _start_failed(runtime, child, f"could not start proc {child.name}: {error}")
            return
        child.popen = proc
        if child.killed:  # given up on (proc_spawn_timeout) before its zygote forked it
            proc.kill()

    pipes = [os.pipe(), os.pipe()] if stdio is not None else []
    try:
        zygote.fork(spec, env, [w for _, w in pipes] or [1, 2], forked, lambda _: _exited(runtime, child, None))
    except BaseException:
        for r, _ in pipes:
            os.close(r)
        raise
    finally:
        for _, w in pipes:
            os.close(w)
    if stdio is not None:
        stdio(child, os.fdopen(pipes[0][0], "rb"), os.fdopen(pipes[1][0], "rb"))


def _check_started(runtime: ProcRuntime, child: ChildProc, timeout: float, zygote: Zygote | None = None) -> None:
    if not child.ready.done() and child.returncode is None:
        never_forked = zygote is not None and child.popen is None
        _kill(child)
        child.killed = True  # a fork that comes after all is killed at once (_fork_one)
        reason = Cause(f"proc {child.name} did not report ready within {timeout:.0f}s (proc_spawn_timeout); it was killed", CauseKind.HUNG)
        child.ready._set_exception(TimeoutError(reason))
        runtime.peer_gone(child.address, reason)
        if never_forked:
            assert zygote is not None
            # The zygote never answered (stopped, stuck): later spawns go to a new one.
            log.warning("this host's zygote did not fork proc %s within %.0fs; later procs are forked from a new one", child.name, timeout)
            zygote.stuck = True
            runtime.children.pop(child.address, None)
            child.exited._set_result(None)


def _watch(runtime: ProcRuntime, child: ChildProc) -> None:
    popen = child.popen
    assert popen is not None
    try:
        fd = os.pidfd_open(popen.pid)
    except (AttributeError, OSError):
        # No pidfds (an old kernel): a thread of the runtime's own waits for the exit.
        runtime.threads.start(lambda: (popen.wait(), runtime.loop.call_soon_threadsafe(_exited, runtime, child, None)),
                              name=f"actormesh-watch-{child.name}")
        return

    def readable() -> None:
        runtime.loop.remove_reader(fd)
        os.close(fd)
        _exited(runtime, child, None)

    runtime.loop.add_reader(fd, readable)


def _exited(runtime: ProcRuntime, child: ChildProc, _: Any) -> None:
    assert child.popen is not None
    code = child.popen.wait()
    child.returncode = code
    if not child.ready.done():
        child.ready._set_exception(RuntimeError(f"proc {child.name} exited before it was ready ({exit_cause(code)})"))
    reason = STOPPED if child.stopping else exit_cause(code, rss_bytes=child.rss_bytes, killed_by_spawner=child.killed)
    runtime.peer_gone(child.address, reason, expected=child.stopping)
    runtime.children.pop(child.address, None)
    child.exited._set_result(code)


def _kill(child: ChildProc) -> None:
    if child.popen is not None and child.popen.poll() is None:
        child.killed = True
        try:
            child.popen.kill()
        except OSError:
            pass


def _kill_all(children: Sequence[ChildProc]) -> None:
    for child in children:
        _kill(child)


def stop_children(runtime: ProcRuntime, children: Sequence[ChildProc], timeout_s: float) -> Future[None]:
    """Ask workers to stop (their actors' ``__cleanup__`` run), kill those that
    have not exited after ``timeout_s``. The future completes when all exited."""
    remaining = [c for c in children if not c.exited.done()]
    if not remaining:
        return Future._completed(None)
    done = gather([c.exited for c in remaining], what="stop_children").then(lambda _: None)

    def begin() -> None:
        for child in remaining:
            child.stopping = True
            runtime.stop_proc(child.address)
        runtime.loop.call_later(timeout_s, _kill_all, remaining)

    runtime.loop.call_soon_threadsafe(begin)
    return done


def kill_all_children(runtime: ProcRuntime, grace_s: float = 1.0) -> None:
    """At exit: ask every child to stop, then SIGKILL what is left (blocking)."""
    children = list(runtime.children.values())
    if not children:
        _close_zygote(runtime)
        return
    fut = stop_children(runtime, children, grace_s)
    try:
        fut.get(timeout=grace_s + 1.0)
    except Exception:
        pass
    for child in children:
        _kill(child)
        if child.popen is not None:
            try:
                child.popen.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
    _close_zygote(runtime)


def _close_zygote(runtime: ProcRuntime) -> None:
    zygote, runtime.zygote = runtime.zygote, None
    if zygote is not None:
        zygote.close()
