"""Running an ASGI app on uvicorn: in a background thread, or in the foreground.

Example::

    with OpenAIServer(app, port=0) as server:   # port 0: an ephemeral port
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn

#: how long open connections (streams) get to finish when the server stops
GRACEFUL_SHUTDOWN_S = 5


class OpenAIServer:
    """A uvicorn server for ``app`` on ``host:port`` (port 0 picks a free port).

    The socket is bound and listening from the constructor on, so :attr:`port` and
    :attr:`url` are known at once and a client that dials early waits instead of being refused. :meth:`start` serves from a background thread (with its own
    event loop) and returns when the server accepts connections;
    :meth:`serve_forever` serves in the calling thread until SIGINT/SIGTERM.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so, and without it
        # each streamed event waits ~40 ms for the client's delayed ACK (Nagle).
        self._sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise OSError(f"cannot listen on {host}:{port}: {exc} (pick another --port, or 0 for any free port)") from exc
        # Listening from here on: a client that dials as soon as the URL is printed waits in the
        # backlog until uvicorn accepts, instead of being refused while the server starts.
        self._sock.listen(2048)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self._log_level = log_level
        self._server = self._make_server(app)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _make_server(self, app: Any) -> uvicorn.Server:
        config = uvicorn.Config(
            app, log_level=self._log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off", access_log=False
        )
        return uvicorn.Server(config)

    @property
    def app(self) -> Any:
        """The ASGI app served."""
        return self._server.config.app

    def set_app(self, app: Any) -> None:
        """Serve ``app`` (before start: the port can be held while the app is being built)."""
        if self._thread is not None:
            raise RuntimeError("set_app after start(): the server is already serving")
        self._server = self._make_server(app)

    def close(self) -> None:
        """Release the port of a server that was never started."""
        self._sock.close()

    @property
    def url(self) -> str:
        """``http://host:port`` (IPv6 hosts bracketed)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:  # reported by start()/stop() in the caller's thread
            self._error = exc

    def start(self, timeout_s: float = 30.0) -> OpenAIServer:
        """Serve from a background thread; return once it accepts connections."""
        if self._thread is not None:
            raise RuntimeError("this server was already started; make a new OpenAIServer")
        if self.app is None:
            raise RuntimeError("no app to serve: pass one to OpenAIServer or call set_app first")
        self._thread = threading.Thread(target=self._run, name=f"openai-server:{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server on {self.url} failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the HTTP server on {self.url} did not start within {timeout_s}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop serving (open streams get GRACEFUL_SHUTDOWN_S) and join the thread."""
        thread = self._thread
        self._server.should_exit = True
        if thread is not None:
            thread.join(timeout_s / 2)
            if thread.is_alive():
                self._server.force_exit = True
                thread.join(timeout_s / 2)
            if thread.is_alive():
                raise TimeoutError(f"the HTTP server on {self.url} did not stop within {timeout_s}s")
        self._sock.close()

    def serve_forever(self) -> None:
        """Serve in this thread until SIGINT or SIGTERM."""
        if self.app is None:
            raise RuntimeError("no app to serve: pass one to OpenAIServer or call set_app first")
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        finally:
            self._sock.close()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
