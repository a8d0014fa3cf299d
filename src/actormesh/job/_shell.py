"""``shell(host_mesh)``: an interactive shell on one host of a job (Monarch's ``monarch.job.shell``).

A proc started on the host runs the user's shell on a pseudo-terminal; the
terminal's bytes travel as actor messages over the job's authenticated
channels (no ssh needed). On the controller, a terminal stdin is put in raw
mode (restored on exit) and window-size changes are passed on; a piped stdin
works too (scripts, tests). ``shell`` returns the remote shell's exit status.

Messages: to the host ``("data", bytes)``, ``("winsize", (rows, cols))``,
``("eof",)`` (stdin ended: the shell gets ^D, a foreground job SIGHUP),
``("close",)``; to the controller ``("data", bytes)`` and a final
``("exit", status)``. Every wait polls with a bounded timeout and re-checks
whether the session ended.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from typing import Any

from ..mesh import HostMesh
from ..runtime import Actor, Channel, Port, endpoint
from ._inbox import Inbox

__all__ = ["shell"]

_POLL_S = 0.2
_CHUNK = 64 * 1024
_EOF_GRACE_S = 1.0  # after stdin ends, the shell's own commands get this long before a hangup


def _has_children(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return bool(f.read().strip())
    except OSError:
        return True  # cannot tell (no /proc): treat as busy, so the hangup still comes


def _set_winsize(fd: int, rows: int, cols: int) -> None:
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


# Run in the shell's new session: make the pty on stdin its controlling terminal (job control), then exec the shell.
_TAKE_TERMINAL = (
    "import fcntl, os, sys, termios\n"
    "try:\n    fcntl.ioctl(0, termios.TIOCSCTTY, 0)\nexcept OSError:\n    pass\n"
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


class _Shell(Actor):
    """Runs one shell on a pty in its proc."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.master: int | None = None
        self.done = threading.Event()

    @endpoint
    def start(self, to_client: Port[Any], env: dict[str, str], workdir: str | None, size: tuple[int, int] | None) -> Port[Any]:
        import pty

        master, slave = pty.openpty()
        if size:
            _set_winsize(slave, *size)
        cwd = workdir if workdir and os.path.isdir(workdir) else os.path.expanduser("~")
        program = os.environ.get("SHELL") or "/bin/sh"
        # No preexec_fn (unsafe in a threaded process): a tiny Python step takes the terminal, then execs the shell.
        self.child = subprocess.Popen([sys.executable, "-c", _TAKE_TERMINAL, program, "-i"], stdin=slave, stdout=slave, stderr=slave,
                                      cwd=cwd, env={**os.environ, **env, "TERM": os.environ.get("TERM", "xterm")}, start_new_session=True)
        os.close(slave)
        self.master = master
        port, receiver = Channel.open()
        threading.Thread(target=self._output, args=(to_client,), daemon=True).start()
        threading.Thread(target=self._input, args=(receiver,), daemon=True).start()
        return port

    @endpoint
    def alive(self) -> bool:
        return not self.done.is_set()

    def _output(self, to_client: Port[Any]) -> None:
        assert self.master is not None and self.child is not None
        while True:
            readable, _, _ = select.select([self.master], [], [], _POLL_S)
            if readable:
                try:
                    data = os.read(self.master, _CHUNK)
                except OSError:  # EIO: the shell and everything it started closed the terminal
                    data = b""
                if data:
                    to_client.send(("data", data))
                    continue
                break
            if self.done.is_set():
                break
        try:
            status = self.child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.child.kill()
            status = self.child.wait(timeout=10)
        self.done.set()
        to_client.send(("exit", status if status >= 0 else 128 - status))

    def _input(self, receiver: Any) -> None:
        assert self.master is not None and self.child is not None
        inbox = Inbox(receiver)
        try:
            while not self.done.is_set():
                message = inbox.next(_POLL_S)
                if message is None:
                    continue
                if message[0] == "data":
                    os.write(self.master, message[1])
                elif message[0] == "winsize":
                    _set_winsize(self.master, *message[1])
                    self.child.send_signal(signal.SIGWINCH)
                elif message[0] == "eof":
                    self._end_of_input()
                else:
                    self.child.send_signal(signal.SIGHUP)  # the client went away
                    break
        except OSError:
            pass
        finally:
            receiver.close()

    def _end_of_input(self) -> None:
        """The client's input ended: the shell reads end-of-file (^D) after what it
        runs now, and a foreground job gets a hangup, as when a terminal closes."""
        assert self.master is not None and self.child is not None
        os.write(self.master, b"\x04")
        threading.Thread(target=self._hang_up_foreground, daemon=True).start()

    def _hang_up_foreground(self) -> None:
        """Once input has ended: hang up a job in the foreground (with job control),
        or the shell's group when a command of the shell still runs after a short
        grace; and whenever the shell is idle, give it ^D again (an end-of-file
        typed while a command ran is lost when the shell takes the terminal back)."""
        assert self.master is not None and self.child is not None
        waited = 0.0
        while not self.done.wait(_POLL_S) and self.child.poll() is None:
            waited += _POLL_S
            try:
                group = os.tcgetpgrp(self.master)
            except OSError:
                return
            if group == os.getpgrp():
                continue
            busy = _has_children(self.child.pid)
            if group != self.child.pid or (busy and waited >= _EOF_GRACE_S):
                try:
                    os.killpg(group, signal.SIGHUP)
                except OSError:
                    pass
            elif not busy:
                try:
                    os.write(self.master, b"\x04")
                except OSError:
                    return

    def __cleanup__(self, exc: Exception | None) -> None:
        self.done.set()
        if self.child is not None and self.child.poll() is None:
            os.killpg(self.child.pid, signal.SIGHUP)
            try:
                self.child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.child.pid, signal.SIGKILL)
        if self.master is not None:
            os.close(self.master)
            self.master = None


def _terminal_size() -> tuple[int, int] | None:
    try:
        size = os.get_terminal_size(sys.stdin.fileno())
    except (OSError, ValueError):
        return None
    return (size.lines, size.columns)


def _pump_stdin(to_shell: Port[Any], finished: threading.Event) -> None:
    try:
        fd = sys.stdin.fileno()
        while not finished.is_set():
            readable, _, _ = select.select([fd], [], [], _POLL_S)
            if not readable:
                continue
            data = os.read(fd, _CHUNK)
            if not data:
                break
            to_shell.send(("data", data))
    except (OSError, ValueError):  # stdin was closed under us: that is its end too
        pass
    if not finished.is_set():
        to_shell.send(("eof",))  # input ended: the shell gets end-of-file, its foreground job a hangup


def shell(host_mesh_singleton: HostMesh, *, env: dict[str, str] | None = None, workdir: str | None = None) -> int:
    """Run an interactive shell on a one-host mesh; returns its exit status.

    ``workdir`` defaults to this process's working directory when it exists on
    the host (else the home directory); ``env`` adds variables. Example::

        from actormesh.job import shell
        shell(job.state().trainers.slice(hosts=0))
    """
    size = getattr(host_mesh_singleton, "size", None)
    if not callable(size):
        raise TypeError(f"shell() needs a singleton HostMesh (one host), got {host_mesh_singleton!r}")
    if size() != 1:
        raise ValueError(f"shell() needs a singleton HostMesh (one host); slice the mesh first, e.g. mesh.slice(hosts=0) (it has {size()})")
    if not isinstance(host_mesh_singleton, HostMesh):
        raise TypeError(f"shell() needs a singleton HostMesh (one host), got {host_mesh_singleton!r}")
    if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in dict(env).items()):
        raise TypeError(f"env must be a dict of str to str, got {env!r}")
    procs = host_mesh_singleton.spawn_procs(name="shell")
    try:
        remote = procs.spawn("shell", _Shell)
        port, receiver = Channel.open()
        to_shell = remote.start.call_one(port, dict(env or {}), workdir or os.getcwd(), _terminal_size()).get(timeout=60)
        return _session(to_shell, receiver, remote)
    finally:
        procs.stop().get(timeout=60)


def _session(to_shell: Port[Any], receiver: Any, remote: Any) -> int:
    finished = threading.Event()
    restore = _raw_mode()
    previous = None
    if restore is not None and threading.current_thread() is threading.main_thread():
        def resized(*_: Any) -> None:
            size = _terminal_size()
            if size:
                to_shell.send(("winsize", size))

        previous = signal.signal(signal.SIGWINCH, resized)
    threading.Thread(target=_pump_stdin, args=(to_shell, finished), daemon=True).start()
    write = _terminal_writer()
    quiet = 0
    inbox = Inbox(receiver)
    try:
        while True:
            message = inbox.next(_POLL_S)
            if message is None:
                quiet += 1
                if quiet % 25 == 0:  # every ~5 s of silence: is the shell's proc still there? (raises if not)
                    remote.alive.call_one().get(timeout=30)
                continue
            quiet = 0
            if message[0] == "exit":
                return int(message[1])
            write(message[1])
    finally:
        finished.set()
        to_shell.send(("close",))
        receiver.close()
        if previous is not None:
            signal.signal(signal.SIGWINCH, previous)
        if restore is not None:
            restore()


def _terminal_writer() -> Any:
    """Write straight to stdout's descriptor: nothing stays buffered to fail again at exit
    (a closed terminal raises BrokenPipeError once, here)."""
    try:
        sys.stdout.flush()
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        out = sys.stdout.buffer
        return lambda data: (out.write(data), out.flush())

    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    return write


def _raw_mode() -> Any:
    """Put a terminal stdin in raw mode; return the function that restores it (None: not a terminal)."""
    try:
        import termios
        import tty

        fd = sys.stdin.fileno()
        if not os.isatty(fd):
            return None
        saved = termios.tcgetattr(fd)
        tty.setraw(fd)
    except (ImportError, OSError, ValueError):
        return None
    return lambda: termios.tcsetattr(fd, termios.TCSADRAIN, saved)
