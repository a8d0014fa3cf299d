"""Running the dashboard: uvicorn on a thread of the controller, and finding it from outside.

:func:`start_dashboard` serves the page for the controller's runtime. On
loopback (the default) it needs no token; bound anywhere else it requires the
job's token, derived from the job secret (HMAC), which is never printed: it is
written with the URL to ``<job dir>/dashboard.json`` (mode 0600, in the job's
private directory), where ``actormesh top`` and ``actormesh dashboard`` (same
user, same machine) read it. :func:`find_dashboards` lists those files.
"""

from __future__ import annotations

import glob
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..runtime import current_runtime
from ._state import Collector

log = logging.getLogger("actormesh.dashboard")

__all__ = ["Dashboard", "start_dashboard", "find_dashboards", "job_token", "INFO_FILE"]

INFO_FILE = "dashboard.json"
_START_TIMEOUT_S = 15.0


def job_token(secret: bytes) -> str:
    """The dashboard token of the job whose secret is ``secret`` (not the secret itself)."""
    return hmac.new(secret, b"actormesh-dashboard-v1", hashlib.sha256).hexdigest()[:40]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class Dashboard:
    """A running dashboard. ``url`` has no token in it; ``token`` is None on loopback."""

    url: str
    host: str
    port: int
    token: str | None
    collector: Collector
    _server: Any = field(repr=False)
    _thread: threading.Thread = field(repr=False)
    _info_path: str | None = field(default=None, repr=False)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and gathering (bounded); idempotent."""
        from ..mesh import remove_log_tap

        remove_log_tap(self.collector.log_line)
        self.collector.stop(timeout_s)
        self._server.should_exit = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        if self._info_path:
            try:
                os.unlink(self._info_path)
            except OSError:
                pass
            self._info_path = None


_running: Dashboard | None = None
_lock = threading.Lock()


def serve_for_runtime(port: int, host: str, runtime: Any) -> str:
    """:func:`start_dashboard` for ``runtime``, as the runtime asks for it (``use_dashboard``); its URL."""
    return start_dashboard(port, host, runtime=runtime).url


def start_dashboard(port: int = 0, host: str = "127.0.0.1", *, runtime: Any = None, interval_s: float = 1.0) -> Dashboard:
    """Serve the dashboard of this controller's job on ``host:port`` (0: a free port).

    Returns at once when it is already running here. Example::

        from actormesh.dashboard import start_dashboard
        dash = start_dashboard()        # http://127.0.0.1:<port>/
        print(dash.url)
    """
    global _running
    try:
        import uvicorn

        from ._app import make_app
    except ImportError as exc:
        raise ImportError(f"the dashboard needs FastAPI, uvicorn and prometheus-client: pip install 'actormesh[dashboard]' ({exc})") from exc
    with _lock:
        if _running is not None and not _running.collector.stopped:
            return _running
        rt = runtime if runtime is not None else current_runtime()
        token = None if _is_loopback(host) else job_token(rt.secret)
        try:
            sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except OSError as exc:
            raise OSError(f"the dashboard cannot listen on {host}:{port}: {exc}; choose another dashboard_port") from exc
        port = sock.getsockname()[1]
        collector = Collector(rt, interval_s=interval_s)
        _tap_logs(collector)
        config = uvicorn.Config(make_app(collector, token), log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="actormesh-dashboard", daemon=True)
        collector.start()
        thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.started:
            collector.stop()
            server.should_exit = True
            raise RuntimeError(f"the dashboard did not start on {host}:{port} within {_START_TIMEOUT_S:.0f}s")
        shown = f"[{host}]" if ":" in host else host
        dash = Dashboard(f"http://{shown}:{port}/", host, port, token, collector, server, thread)
        dash._info_path = _write_info(rt.job_dir, dash)
        _running = dash
    log.info("actormesh dashboard at %s%s", dash.url, "" if token is None else f" (token in {dash._info_path})")
    return dash


def _tap_logs(collector: Collector) -> None:
    from ..mesh import add_log_tap

    add_log_tap(collector.log_line)


def _write_info(job_dir: str, dash: Dashboard) -> str | None:
    path = os.path.join(job_dir, INFO_FILE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": dash.url, "token": dash.token, "pid": os.getpid()}, f)
    except OSError as exc:
        log.warning("could not write %s (actormesh top will need --url): %s", path, exc)
        return None
    return path


def find_dashboards() -> list[dict[str, Any]]:
    """Dashboards of this user's running controllers on this machine: dicts of url, token, pid."""
    found = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "actormesh-*", INFO_FILE)):
        try:
            if os.stat(path).st_uid != os.getuid():
                continue  # another user's job (root can read it, but it is not ours)
            with open(path) as f:
                info = json.load(f)
            os.kill(int(info["pid"]), 0)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable, not ours, or its controller is gone
        found.append(info)
    return found
