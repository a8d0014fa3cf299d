"""``run_script``: an unmodified torchrun-style script on every proc of a mesh.

Theory of operation. The controller spawns one :class:`SPMDActor` per proc,
agrees on ``MASTER_ADDR``/``MASTER_PORT`` (rank 0 binds a free port) and sets
torchrun's variables in every proc. Each SPMDActor then starts the script as a
*child process* of its proc (as torchrun's agent does), so the script gets a
real exit status, its own interpreter state and its fd-level output. Every
output line and the exit report travel to a port on the controller, which
prints them with ``[rankN]:`` prefixes while they arrive. When one rank fails,
the controller terminates the others at once (a peer blocked in a collective
would otherwise wait for the collective timeout) and raises
:class:`ScriptError` naming the first failure, with that rank's traceback.

The script's child process dies with its proc (``PR_SET_PDEATHSIG``) and is
terminated when its SPMDActor stops. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..mesh import ProcMesh, Shape, ValueMesh
from ..runtime import Actor, Channel, endpoint

__all__ = ["ScriptError", "run_script", "run_child", "terminate"]

_TAIL_LINES = 200
_GRACE_S = 5.0
_running: dict[str, subprocess.Popen[bytes]] = {}
_cancelled: set[str] = set()  # terminated before (or while) their child started
# torch prefixes an uncaught exception's lines with "[rankN]: " itself.
_TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ?")
_lock = threading.Lock()


class ScriptError(RuntimeError):
    """One or more ranks of :func:`run_script` failed.

    The message names the root cause: the rank that failed first (earliest
    exit), with its traceback. ``exit_codes`` has every rank's status
    (negative: killed by that signal), ``tracebacks`` the failed ranks' errors.
    """

    def __init__(self, message: str, rank: int, exit_codes: dict[int, int], tracebacks: dict[int, str | None]) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_codes = exit_codes
        self.tracebacks = tracebacks

    def __reduce__(self) -> tuple[Any, ...]:
        return (ScriptError, (str(self), self.rank, self.exit_codes, self.tracebacks))


# ---------------------------------------------------------------- worker side


def _parent_death_signal() -> Callable[[], None] | None:
    """A preexec_fn arming PR_SET_PDEATHSIG (Linux), resolved *before* fork: the
    forked child of a threaded process must not import or take locks."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arm() -> None:  # pragma: no cover - runs in the forked child
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG

    return arm


_die_with_parent = _parent_death_signal()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _traceback_from(error_file: str, tail: Sequence[str], code: int) -> str:
    """The failure's traceback: torch's error file (``@record``), else stderr's last traceback."""
    try:
        with open(error_file) as f:
            data = json.load(f)
        info = data["message"]
        stack = info.get("extraInfo", {}).get("py_callstack") if isinstance(info, dict) else None
        if stack:
            return str(stack)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    lines = [_TORCH_PREFIX.sub("", line) for line in tail]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        return "\n".join(lines[starts[-1]:])
    last = "\n".join(lines[-20:])
    return f"the script {_describe_exit(code)}" + (f"; its last stderr lines:\n{last}" if last else " and wrote nothing to stderr")


def run_child(run_id: str, rank: int, argv: list[str], env: dict[str, str], cwd: str | None, port: Any) -> tuple[int, str | None, float]:
    """Run ``argv`` as a child of this proc; send ("line", rank, stream, text) and
    finally ("exit", rank, code, traceback, end_time) to ``port``. Returns the same."""
    fd, error_file = tempfile.mkstemp(prefix="actormesh-error-", suffix=".json")
    os.close(fd)
    os.unlink(error_file)  # torch writes it only on failure
    child_env = {**os.environ, **env, "TORCHELASTIC_ERROR_FILE": error_file, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                env=child_env, cwd=cwd, start_new_session=True, preexec_fn=_die_with_parent)
    except OSError as exc:
        report = (127, f"could not start {argv[0]!r}: {exc}", time.time())
        port.send(("exit", rank, *report))
        return report
    with _lock:
        _running[run_id] = proc
        cancelled = run_id in _cancelled
    if cancelled:
        terminate(run_id)
    tail: deque[str] = deque(maxlen=_TAIL_LINES)

    def pump(pipe: Any, stream: str) -> None:
        for raw in iter(pipe.readline, b""):
            text = raw.decode(errors="replace").rstrip("\n")
            if stream == "stderr":
                tail.append(text)
            port.send(("line", rank, stream, text))
        pipe.close()

    out = threading.Thread(target=pump, args=(proc.stdout, "stdout"), name=f"script-{rank}-stdout", daemon=True)
    out.start()
    try:
        pump(proc.stderr, "stderr")
        code = proc.wait()
        out.join()
    finally:
        with _lock:
            _running.pop(run_id, None)
            _cancelled.discard(run_id)
    end = time.time()
    traceback = _traceback_from(error_file, tail, code) if code != 0 else None
    try:
        os.unlink(error_file)
    except OSError:
        pass
    port.send(("exit", rank, code, traceback, end))
    return code, traceback, end


def terminate(run_id: str, grace_s: float = _GRACE_S) -> bool:
    """SIGTERM the script's process group, SIGKILL it after ``grace_s``. False if not running."""
    with _lock:
        _cancelled.add(run_id)
        proc = _running.get(run_id)
    if proc is None or proc.poll() is not None:
        return False
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return False

    def reap() -> None:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    threading.Thread(target=reap, name=f"reap-{run_id}", daemon=True).start()
    return True


class _Terminator(Actor):
    """Stops a running script on its proc while the SPMDActor waits for it."""

    @endpoint
    def terminate(self, run_id: str) -> bool:
        return terminate(run_id)


# ------------------------------------------------------------ controller side


def _print_line(rank: int, stream: str, text: str) -> None:
    out = sys.stdout if stream == "stdout" else sys.stderr
    prefix = f"[rank{rank}]:"
    try:
        out.write(f"{text}\n" if text.startswith(prefix) else f"{prefix} {text}\n")
        out.flush()
    except (OSError, ValueError):
        pass


def run_script(
    procs: ProcMesh,
    script: str,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    timeout: float | None = None,
    check: bool = True,
    output: Callable[[int, str, str], None] | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    python: str | None = None,
) -> ValueMesh[int]:
    """Run a torchrun-style ``script`` on every proc; returns each rank's exit code.

    Every rank gets torchrun's environment (:func:`setup_torch_elastic_env`)
    and runs ``python script *args`` (``python -m script *args`` with
    ``module=True``) as a child process of its proc. Output lines reach this
    controller while they are written, as ``[rank3]: ...`` (or go to
    ``output(rank, stream, line)``). If a rank fails, the others are terminated
    and, with ``check`` (default), :class:`ScriptError` is raised with the
    first failure's rank and traceback. ``timeout`` (seconds the script may
    run) terminates every rank and raises ``TimeoutError``. If a proc dies, the
    others are terminated and its ``SupervisionError`` is raised.

    Example::

        procs = this_host().spawn_procs(per_host={"gpus": 2})
        codes = run_script(procs, "train_ddp.py", ["--epochs", "1"], timeout=600)
        assert codes.values() == [0, 0]
    """
    from ._env import _setup

    if not isinstance(script, str) or not script:
        raise TypeError(f"run_script needs a script path (or module name with module=True), got {script!r}")
    if isinstance(args, str):
        raise TypeError("args must be a sequence of strings, e.g. ['--epochs', '1'], not one string")
    args = [str(a) for a in args]
    if not module:
        path = os.path.abspath(script) if cwd is None else script
        if cwd is None and not os.path.exists(path):
            raise FileNotFoundError(f"run_script: no such script {script!r} (relative to {os.getcwd()}); pass module=True for a module name")
        argv = [python or sys.executable, "-u", path, *args]
    else:
        argv = [python or sys.executable, "-u", "-m", script, *args]
    spmd, _, _ = _setup(procs, master_addr, master_port, None, 120.0)
    terminators: Any = procs.spawn("spmd_terminator", _Terminator)
    try:
        return _drive(spmd, terminators, argv, dict(env or {}), cwd, timeout, check, output or _print_line)
    finally:
        for mesh in (spmd, terminators):
            try:
                mesh.stop().get(timeout=30)
            except Exception:
                pass  # a member whose proc died cannot confirm; never mask the run's outcome


def _drive(spmd: Any, terminators: Any, argv: list[str], env: dict[str, str], cwd: str | None, timeout: float | None,
           check: bool, output: Callable[[int, str, str], None]) -> ValueMesh[int]:
    run_id = uuid.uuid4().hex
    port, receiver = Channel.open()
    # stream(): one future per rank, failed at once if that rank's proc dies.
    replies = list(spmd.run_script.stream(run_id, argv, env, cwd, port))
    deadline = None if timeout is None else time.monotonic() + timeout
    lost: list[BaseException] = []
    timed_out = threading.Event()

    def wait() -> None:  # after the last reply, "done" is the last message on the port
        for reply in replies:
            try:
                reply.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                timed_out.set()
                break
            except BaseException as exc:  # the proc died: the script died with it
                lost.append(exc)
                port.send(("lost",))
        port.send(("done",))

    threading.Thread(target=wait, name=f"run_script-{run_id[:8]}", daemon=True).start()
    exits: dict[int, tuple[int, str | None, float]] = {}
    terminated = False
    while True:
        msg = receiver.recv().get(timeout=None if timeout is None else timeout + 60)
        if msg[0] == "line":
            output(msg[1], msg[2], msg[3])
            continue
        if msg[0] == "done":
            break
        if msg[0] == "exit":
            _, rank, code, tb, end = msg
            exits[rank] = (code, tb, end)
            failed = code != 0
        else:  # "lost": a proc died
            failed = True
        if failed and not terminated:
            terminated = True  # one rank is gone: the others would wait in collectives
            _terminate(terminators, run_id)
    receiver.close()
    if timed_out.is_set():
        _terminate(terminators, run_id)
        raise TimeoutError(f"run_script: {' '.join(argv[2:])!r} did not finish within {timeout}s; every rank was terminated")
    if lost:
        raise lost[0]
    codes = [exits[r][0] for r in range(len(replies))]
    labels, sizes = spmd.extent.labels, spmd.extent.sizes
    mesh: ValueMesh[int] = ValueMesh(Shape.row_major(labels, sizes), codes)
    failed = {rank: e for rank, e in exits.items() if e[0] != 0}
    if check and failed:
        first = min(failed, key=lambda r: (failed[r][2], r))
        code, tb, _ = failed[first]
        others = sorted(r for r in failed if r != first)
        also = f" (ranks {others} failed or were terminated after it)" if others else ""
        raise ScriptError(f"rank {first} failed first with {_describe_exit(code)}{also}:\n{tb}", first,
                          dict(enumerate(codes)), {r: e[1] for r, e in failed.items()})
    return mesh


def _terminate(terminators: Any, run_id: str) -> None:
    """Terminate the script on every proc still alive (a dead proc's script died with it)."""
    flat = terminators.flatten("rank")
    calls = []
    for i in range(len(flat)):  # one by one: a mesh with a dead member refuses whole-mesh calls
        try:
            calls.append(flat.slice(rank=i).terminate.call_one(run_id))
        except Exception:
            pass
    for call in calls:
        try:
            call.get(timeout=30)
        except Exception:
            pass
