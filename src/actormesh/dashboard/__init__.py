"""The job dashboard: a web page, its JSON API and ``/metrics``, served by the controller.

Turn it on with ``configure(dashboard_port=8265)`` before the first spawn (or
``ACTORMESH_DASHBOARD_PORT``, or ``actormesh dashboard script.py``), or call
:func:`start_dashboard`. It shows hosts, procs and actor meshes with their
status, per-actor message rates and latency, failures with their traceback and
supervision path, restarts and a log tail, updated live over server-sent
events. ``actormesh top`` shows the same in a terminal. Needs the dashboard
extra (``pip install 'actormesh[dashboard]'``). See docs/dashboard.md.
"""

from ._client import DashboardNotFound, fetch_state, locate
from ..runtime import use_dashboard as _use_dashboard
from ._server import INFO_FILE, Dashboard, find_dashboards, job_token, serve_for_runtime, start_dashboard
from ._state import Collector

_use_dashboard(serve_for_runtime)  # configure(dashboard_port=...) reaches this layer through it

__all__ = ["DashboardNotFound", "fetch_state", "locate", "Dashboard", "Collector", "start_dashboard", "find_dashboards", "job_token", "INFO_FILE", "serve_for_runtime"]
