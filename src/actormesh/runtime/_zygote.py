"""The spawner's side of this host's zygote (``python -m actormesh.zygote``).

One zygote per spawning process, started on its first spawn from the loop
thread (the zygote's parent-death signal follows that thread, as a worker's
does). Every spawn after that is one request on a socket: the zygote forks a
worker that has actormesh imported already, answers with its pid, and later
with its exit code. What the spawner keeps per worker is a :class:`ForkedProc`,
the part of ``subprocess.Popen`` that ``_spawn`` uses, so supervision cannot
tell the two apart: exit codes and signals are reported the same way, and
SIGKILL goes through a pidfd, which cannot hit a recycled pid.

If the zygote dies, its workers die with it (their parent-death signal): each
is reported killed once its pidfd says it is gone, and the next spawn starts a
fresh zygote.
"""

from __future__ import annotations

import array
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("actormesh.spawn")

__all__ = ["ForkedProc", "Zygote", "zygote_available"]

#: Request header, as ``actormesh.zygote.HEADER`` reads it: body length, fd count.
_HEADER = struct.Struct("!II")

Forked = Callable[["ForkedProc | None", "str | None"], None]


def zygote_available() -> bool:
    """Whether this OS can watch a process that is not our child (pidfds, Linux 5.3+)."""
    return hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal") and hasattr(socket, "send_fds")


class ForkedProc:
    """A worker the zygote forked; ``returncode`` is set when the zygote reports its end."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:  # gone already: its exit report is on its way
            self._pidfd = -1

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        """SIGKILL, unless it has ended (the pidfd keeps a recycled pid safe)."""
        if self.returncode is None and self._pidfd >= 0:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def ended(self, code: int) -> None:
        """Record its exit code (loop thread) and release its pidfd."""
        if self.returncode is not None:
            return
        self.returncode = code
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        self._ended.set()


class Zygote:
    """The requests and answers of one zygote process (loop thread only, except ``close``)."""

    def __init__(self, loop: Any) -> None:
        self._loop = loop
        self._sock: socket.socket | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._next_id = 0
        self._waiting: dict[int, tuple[Forked, Callable[[int], None]]] = {}
        self._procs: dict[int, tuple[ForkedProc, Callable[[int], None]]] = {}
        self._buf = bytearray()
        self._closing = False
        self._out: deque[tuple[bytes, list[int]]] = deque()
        #: Set when a spawn it was asked for never came (stopped, stuck): spawns go to a
        #: successor, while this one still reports the ends of the workers it forked.
        self.stuck = False
        self.retired: list[Zygote] = []

    def successor(self) -> Zygote:
        """A new zygote for the spawns to come; this one is kept, retired, until ``close``."""
        new = Zygote(self._loop)
        new.retired = [*self.retired, self]
        self.retired = []
        return new

    def fork(self, spec: dict[str, Any], env: dict[str, str], stdio: Sequence[int],
             forked: Forked, exited: Callable[[int], None]) -> None:
        """Ask for a worker with this bootstrap ``spec``, environment and stdout/stderr fds.

        ``forked(proc, None)`` once it runs (``forked(None, why)`` if it could not
        be started), then ``exited(code)`` when it ends. Raises OSError if no
        zygote could be started."""
        if self._sock is None:
            self._start()
        self._next_id += 1
        self._waiting[self._next_id] = (forked, exited)
        self._send({"id": self._next_id, "spec": spec, "env": env}, stdio)

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._popen = subprocess.Popen([sys.executable, "-m", "actormesh.zygote"], stdin=theirs.fileno(), close_fds=True)
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        self._buf.clear()
        self._send({"parent_pid": os.getpid(), "sys_path": [p for p in sys.path if p], "cwd": os.getcwd()}, ())
        self._loop.add_reader(ours.fileno(), self._readable)

    def _send(self, message: dict[str, Any], fds: Sequence[int]) -> None:
        """Queue one request; its fds are duplicated here, so the caller may close its own."""
        body = json.dumps(message).encode()
        self._out.append((_HEADER.pack(len(body), len(fds)) + body, [os.dup(fd) for fd in fds]))
        if len(self._out) == 1:
            self._flush()

    def _flush(self) -> None:
        """Write what is queued without blocking the loop (the zygote may still be importing)."""
        sock = self._sock
        assert sock is not None
        while self._out:
            data, fds = self._out[0]
            try:
                sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [])
            except BlockingIOError:
                self._loop.add_writer(sock.fileno(), self._flush)
                return
            except OSError:
                self._lost()  # fails what waits; the next spawn starts a new zygote
                return
            for fd in fds:  # they went with the first byte
                os.close(fd)
            if sent < len(data):
                self._out[0] = (data[sent:], [])
            else:
                self._out.popleft()
        self._loop.remove_writer(sock.fileno())

    def _readable(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._lost()
            return
        self._buf += data
        while (end := self._buf.find(b"\n")) >= 0:
            answer = json.loads(self._buf[:end])
            del self._buf[:end + 1]
            self._answer(answer)

    def _answer(self, answer: dict[str, Any]) -> None:
        if "exit" in answer:
            entry = self._procs.pop(answer["exit"], None)
            if entry is not None:
                entry[0].ended(answer["code"])
                entry[1](answer["code"])
            return
        forked, exited = self._waiting.pop(answer["id"])
        if "error" in answer:
            forked(None, answer["error"])
            return
        proc = ForkedProc(answer["pid"])
        self._procs[proc.pid] = (proc, exited)
        forked(proc, None)

    def _lost(self) -> None:
        """The zygote is gone: its workers die with it (parent-death signal)."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        self._loop.remove_reader(sock.fileno())
        self._loop.remove_writer(sock.fileno())
        sock.close()
        for _, fds in self._out:
            for fd in fds:
                os.close(fd)
        self._out.clear()
        popen, self._popen = self._popen, None
        code = None if popen is None else popen.poll()
        if code is None and popen is not None:
            self._reap_later(popen)
        if (self._procs or self._waiting) and not self._closing:
            log.warning("this host's zygote ended (exit code %s); the %d procs it forked die with it", code, len(self._procs))
        waiting, self._waiting = self._waiting, {}
        for forked, _ in waiting.values():
            forked(None, f"the zygote that forks this host's procs ended (exit code {code}) before it started this one")
        procs, self._procs = self._procs, {}
        for proc, exited in procs.values():
            self._when_gone(proc, exited)

    def _when_gone(self, proc: ForkedProc, exited: Callable[[int], None]) -> None:
        pidfd = proc._pidfd

        def gone() -> None:
            if pidfd >= 0:
                self._loop.remove_reader(pidfd)
            proc.ended(-signal.SIGKILL)
            exited(-signal.SIGKILL)

        if pidfd < 0:
            gone()
        else:
            self._loop.add_reader(pidfd, gone)

    def _reap_later(self, popen: subprocess.Popen[bytes]) -> None:
        """Collect an ending zygote's exit status when it comes, without a thread."""
        try:
            pidfd = os.pidfd_open(popen.pid)
        except OSError:
            popen.poll()
            return

        def reap() -> None:
            self._loop.remove_reader(pidfd)
            os.close(pidfd)
            popen.poll()

        self._loop.add_reader(pidfd, reap)

    def close(self, timeout_s: float = 2.0) -> None:
        """Hang up (any thread): the zygote exits, and with it any worker it still has.

        The loop thread sees the hang-up and reports those workers' ends."""
        self._closing = True
        for old in self.retired:
            old.close(timeout_s)
        sock, popen = self._sock, self._popen
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if popen is not None:
            try:
                popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
