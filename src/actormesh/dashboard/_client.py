"""Reading a running controller's dashboard from another process (``actormesh top``).

A controller that serves a dashboard writes its URL (and, off loopback, its
token) to ``<job dir>/dashboard.json``; :func:`locate` finds it for this user
on this machine, or takes the URL (and a token from ``--token`` or
``ACTORMESH_DASHBOARD_TOKEN``) for a controller elsewhere.
"""

from __future__ import annotations

import os
from typing import Any

from ._server import find_dashboards

__all__ = ["locate", "fetch_state", "DashboardNotFound"]


class DashboardNotFound(RuntimeError):
    """No running dashboard could be found (the message says what to do)."""


def locate(url: str | None = None, token: str | None = None) -> tuple[str, str | None]:
    """(url, token) of the dashboard to read: ``url`` if given, else this machine's only one."""
    token = token or os.environ.get("ACTORMESH_DASHBOARD_TOKEN") or None
    if url:
        return (url if url.endswith("/") else url + "/"), token
    found = find_dashboards()
    if not found:
        raise DashboardNotFound(
            "no running actormesh dashboard found for this user on this machine; start the job with "
            "configure(dashboard_port=8265) (or `actormesh dashboard script.py`), or pass --url http://host:port/"
        )
    if len(found) > 1:
        urls = ", ".join(sorted(d["url"] for d in found))
        raise DashboardNotFound(f"{len(found)} running dashboards ({urls}); choose one with --url")
    return found[0]["url"], token or found[0].get("token")


def fetch_state(url: str, token: str | None, timeout_s: float = 10.0) -> dict[str, Any]:
    """The job's state from the dashboard at ``url`` (raises DashboardNotFound when unreachable)."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(url + "api/state", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise DashboardNotFound(f"the dashboard at {url} does not answer: {exc}") from exc
    if response.status_code == 401:
        raise DashboardNotFound(f"the dashboard at {url} needs the job's token: pass --token or set ACTORMESH_DASHBOARD_TOKEN")
    response.raise_for_status()
    return response.json()
