"""Monarch's job-level switches for the tools: ``job.enable_telemetry(TelemetryConfig(...))``
and ``job.enable_admin(MeshAdminConfig(...))``, honoured when ``state()`` connects.

In actormesh both are served by the controller's dashboard (docs/dashboard.md):
telemetry turns on the runtime's figures in every proc (``configure(telemetry=True)``)
and, with ``include_dashboard``, serves the web page and its JSON API; the mesh
admin is that JSON API (hosts, procs, actor meshes, their status and failures)
on ``admin_addr``. ``JobState.telemetry_url`` / ``admin_url`` say where.
There is no SQL query engine: ``JobState.query_engine`` is None, and
``batch_size`` / ``retention_secs`` are recorded without effect.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from .. import config
from ..runtime import current_runtime, serve_telemetry

__all__ = ["DEFAULT_JOB_PATH", "TelemetryConfig", "MeshAdminConfig", "start_tools"]

#: Where a job's state is cached for other processes by convention
#: (``job.state(cached_path=DEFAULT_JOB_PATH)``, ``job_load(DEFAULT_JOB_PATH)``).
DEFAULT_JOB_PATH = os.path.join(".actormesh", "job_state.pkl")


def _port(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"{name} must be a TCP port number (0-65535; 0 picks a free one), got {value!r}")
    return value


@dataclass
class TelemetryConfig:
    """Telemetry started by ``state()`` (Monarch's fields).

    ``include_dashboard`` serves the dashboard on ``dashboard_port`` (0: a free
    port). ``batch_size`` and ``retention_secs`` size Monarch's SQL tables,
    which actormesh does not keep: accepted and recorded only.
    """

    batch_size: int = 1000
    retention_secs: int = 600
    include_dashboard: bool = False
    dashboard_port: int = 8265

    def __post_init__(self) -> None:
        for name in ("batch_size", "retention_secs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TelemetryConfig.{name} must be a non-negative int, got {value!r}")
        if not isinstance(self.include_dashboard, bool):
            raise ValueError(f"TelemetryConfig.include_dashboard must be a bool, got {self.include_dashboard!r}")
        _port("TelemetryConfig.dashboard_port", self.dashboard_port)


@dataclass
class MeshAdminConfig:
    """The mesh admin API started by ``state()``: ``admin_addr`` is ``"host:port"``
    (None: loopback, a free port). Anything but loopback requires the job's token."""

    admin_addr: Optional[str] = None

    def __post_init__(self) -> None:
        if self.admin_addr is not None:
            self.host_port()

    def host_port(self) -> tuple[str, int]:
        """``admin_addr`` split into (host, port)."""
        if self.admin_addr is None:
            return "127.0.0.1", 0
        host, sep, port = str(self.admin_addr).rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"MeshAdminConfig.admin_addr must be 'host:port' (e.g. '127.0.0.1:1729', '[::]:1729'), got {self.admin_addr!r}")
        return host.strip("[]"), _port("MeshAdminConfig.admin_addr's port", int(port))


def start_tools(telemetry: TelemetryConfig | None, admin: MeshAdminConfig | None) -> tuple[str | None, str | None]:
    """Turn on what the job asked for in this controller; (telemetry_url, admin_url)."""
    if telemetry is None and admin is None:
        return None, None
    config.configure(telemetry=True)  # procs spawned from now on collect their figures
    where: tuple[str, int] | None = None
    if admin is not None:
        where = admin.host_port()
    elif telemetry is not None and telemetry.include_dashboard:
        where = ("127.0.0.1", telemetry.dashboard_port)
    url = serve_telemetry(current_runtime(), dashboard=where)
    dashboard_url = url if telemetry is not None and telemetry.include_dashboard else None
    return dashboard_url, url if admin is not None else None
