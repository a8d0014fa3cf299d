"""How ``actormesh debug`` reaches a running controller: a private socket in its job dir.

Theory of operation
-------------------
The debug controller listens on ``<job dir>/debug.sock`` (mode 0600 inside the
0700 job directory) with the transport's HMAC handshake, keyed by a fresh
random console key in ``<job dir>/debug.key`` (0600). The key is not the job
secret: it opens the console, not the job. Only the same user can read it,
and it is never printed, logged or put in argv or the environment.

After the handshake, frames of one JSON object travel both ways::

    controller -> console   {"out": text}  {"prompt": text}  {"bye": text}
    console -> controller   {"line": text} {"eof": true}

The console process is a plain terminal: it prints ``out``, answers each
``prompt`` with one line typed by the person (``input()``, so line editing
works) and leaves on ``bye`` or when the socket closes.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import AuthenticationError
from ..transport import HANDSHAKE_BYTES, Connection, FrameDecoder, Handshake, encode_frame

__all__ = ["DebugClientError", "SOCKET_NAME", "KEY_NAME", "ConnIO", "DebugServerInfo", "find_debug_servers", "write_key", "run_client",
           "MAX_FRAME_BYTES"]

SOCKET_NAME = "debug.sock"
KEY_NAME = "debug.key"
MAX_FRAME_BYTES = 64 << 20  # a `p` of a big object still fits


def write_key(job_dir: str, key: bytes) -> str:
    """Write the console key (0600) in ``job_dir``; return its path."""
    path = os.path.join(job_dir, KEY_NAME)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, key.hex().encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def _encode(msg: dict[str, Any]) -> list[bytes]:
    return [json.dumps(msg).encode()]


class ConnIO:
    """The console's I/O over one authenticated ``actormesh debug`` connection (controller side)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lines: asyncio.Queue[Optional[str]] = asyncio.Queue()
        self.closed = False

    def feed(self, frame: list[Any]) -> None:
        """A frame from the console (loop thread)."""
        try:
            msg = json.loads(bytes(frame[0]))
            line = None if msg.get("eof") else str(msg["line"])
        except (ValueError, KeyError, TypeError, AttributeError):
            line = None  # not our protocol: treat as the console leaving
        self._lines.put_nowait(line)

    def feed_closed(self) -> None:
        """The connection closed: pending and later reads return None."""
        self.closed = True
        self._lines.put_nowait(None)

    async def read_line(self, prompt: str) -> Optional[str]:
        if self.closed:
            return None
        self._conn.send(_encode({"prompt": prompt}))
        return await self._lines.get()

    async def write(self, text: str) -> None:
        if text and not self.closed:
            self._conn.send(_encode({"out": text}))

    def close(self, bye: str, code: int = 0) -> None:
        """Say ``bye`` (the console exits with ``code``) and close the connection."""
        if not self.closed:
            self._conn.send(_encode({"bye": bye, "code": code}))
            self.closed = True
        self._conn.close()


@dataclass(frozen=True)
class DebugServerInfo:
    """A running controller with a debug socket."""

    pid: int
    job_dir: str
    command: str

    @property
    def socket_path(self) -> str:
        return os.path.join(self.job_dir, SOCKET_NAME)


def _owner_pid(job_dir: str) -> int:
    try:
        with open(os.path.join(job_dir, "owner")) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _command_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def find_debug_servers(root: Optional[str] = None) -> list[DebugServerInfo]:
    """This user's running controllers whose debug controller listens (newest first)."""
    root = root or tempfile.gettempdir()
    found = []
    try:
        names = [n for n in os.listdir(root) if n.startswith("actormesh-")]
    except OSError:
        return []
    for name in names:
        job_dir = os.path.join(root, name)
        try:
            st = os.stat(job_dir)
        except OSError:
            continue
        if st.st_uid != os.getuid() or not os.path.exists(os.path.join(job_dir, SOCKET_NAME)):
            continue
        pid = _owner_pid(job_dir)
        if pid and not os.path.exists(f"/proc/{pid}"):
            continue  # its controller is gone; the directory is swept by the next one
        found.append((st.st_mtime, DebugServerInfo(pid, job_dir, _command_of(pid) if pid else "?")))
    return [info for _, info in sorted(found, key=lambda t: -t[0])]


class DebugClientError(RuntimeError):
    """``actormesh debug`` could not reach or authenticate to the controller."""


def _connect(job_dir: str, timeout_s: float) -> tuple[socket.socket, bytes]:
    """Dial and authenticate; return the socket and bytes read past the handshake."""
    try:
        with open(os.path.join(job_dir, KEY_NAME)) as f:
            key = bytes.fromhex(f.read().strip())
    except (OSError, ValueError) as exc:
        raise DebugClientError(f"cannot read the console key in {job_dir}: {exc}") from exc
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(os.path.join(job_dir, SOCKET_NAME))
        hs = Handshake(key, dialer=True)
        sock.sendall(hs.start())
        got = 0
        while not hs.done:
            data = sock.recv(HANDSHAKE_BYTES - got) if got < HANDSHAKE_BYTES else b""
            if not data:
                raise DebugClientError("the controller closed the connection during the handshake (wrong key?)")
            got += len(data)
            reply = hs.receive(data)
            if reply:
                sock.sendall(reply)
    except (OSError, socket.timeout) as exc:
        sock.close()
        raise DebugClientError(f"cannot connect to the debug socket in {job_dir}: {exc}") from exc
    except AuthenticationError as exc:
        sock.close()
        raise DebugClientError(f"the controller refused the console key in {job_dir} in the handshake "
                               "(the key belongs to another controller?)") from exc
    except Exception:
        sock.close()
        raise
    return sock, hs.leftover


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(b"".join(bytes(s) for s in encode_frame(_encode(msg))))


def run_client(job_dir: str, *, connect_timeout_s: float, idle_timeout_s: float) -> int:
    """Be the terminal of the controller's console until it says bye; return an exit code.

    ``idle_timeout_s`` bounds a wait for the controller while no prompt is shown
    (it answers every command within ``debug_attach_timeout``).
    """
    sock, leftover = _connect(job_dir, connect_timeout_s)
    decoder = FrameDecoder(MAX_FRAME_BYTES)
    frames = list(decoder.feed(leftover)) if leftover else []
    try:
        while True:
            while not frames:
                sock.settimeout(idle_timeout_s)
                try:
                    data = sock.recv(1 << 16)
                except socket.timeout:
                    print(f"\nthe controller did not answer for {idle_timeout_s:.0f}s; leaving the console", flush=True)
                    return 1
                if not data:
                    print("\nthe controller closed the debug console (the job ended?)", flush=True)
                    return 0
                frames.extend(decoder.feed(data))
            msg = json.loads(bytes(frames.pop(0)[0]))
            if "out" in msg:
                print(msg["out"], end="", flush=True)
            elif "prompt" in msg:
                try:
                    _send(sock, {"line": input(msg["prompt"])})
                except (EOFError, KeyboardInterrupt):
                    print(flush=True)
                    _send(sock, {"eof": True})
            elif "bye" in msg:
                if msg["bye"]:
                    print(msg["bye"], flush=True)
                return int(msg.get("code", 0))
    except (BrokenPipeError, ConnectionResetError):
        print("\nthe controller closed the debug console (the job ended?)", flush=True)
        return 0
    except OSError as exc:
        print(f"\nthe debug connection broke: {exc}", flush=True)
        return 1
    finally:
        sock.close()
