"""The dashboard's ASGI app (FastAPI): the page, its JSON API, live events, ``/metrics``.

Routes:

- ``GET /``: the page (``page.html``), which loads ``/api/state`` and then
  follows ``/api/events``;
- ``GET /api/state``: the job's state as JSON (see ``_state.Collector``);
- ``GET /api/events``: server-sent events, one ``state`` event per new version
  (and a comment every 15 s to keep proxies from closing the stream);
- ``GET /metrics``: the runtime's figures as Prometheus text.

When a token is set (a bind to anything but loopback), every route needs it:
``Authorization: Bearer <token>``, or ``?token=<token>`` once, which sets a
same-site cookie for the page's own requests.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources

from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from ..telemetry import PROMETHEUS_CONTENT_TYPE, render_prometheus
from ._state import Collector

__all__ = ["make_app", "COOKIE"]

COOKIE = "actormesh_dashboard"
_KEEPALIVE_S = 15.0
_POLL_S = 0.05


def _authorized(request: Request, token: str) -> tuple[bool, bool]:
    """(allowed, came with ?token=) for ``request``."""
    header = request.headers.get("authorization", "")
    offered = [header[7:] if header.lower().startswith("bearer ") else "", request.cookies.get(COOKIE, "")]
    query = request.query_params.get("token", "")
    if any(o and hmac.compare_digest(o, token) for o in offered):
        return True, False
    if query and hmac.compare_digest(query, token):
        return True, True
    return False, False


def make_app(collector: Collector, token: str | None) -> FastAPI:
    """The app serving ``collector``'s state; ``token`` None means no check (loopback)."""
    app = FastAPI(title="actormesh dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    if token is not None:

        @app.middleware("http")
        async def require_token(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            ok, via_query = _authorized(request, token)
            if not ok:
                return JSONResponse({"error": "this dashboard needs the job's token: see docs/dashboard.md (Authorization: Bearer, or ?token=)"}, status_code=401)
            response = await call_next(request)
            if via_query:
                response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
            return response

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        html = resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    @app.get("/api/state")
    async def state() -> Response:
        return Response(collector.state_json()[1], media_type="application/json")

    @app.get("/api/events")
    async def events(request: Request) -> StreamingResponse:
        return StreamingResponse(_event_stream(request, collector), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_prometheus(collector.snapshots()), media_type=PROMETHEUS_CONTENT_TYPE)

    return app


async def _event_stream(request: Request, collector: Collector) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    version, quiet_since = -1, loop.time()
    collector.watchers += 1
    try:
        while not collector.stopped and not await request.is_disconnected():
            latest, text = collector.state_json()
            if latest != version:
                version, quiet_since = latest, loop.time()
                yield f"event: state\nid: {version}\ndata: {text}\n\n"
            elif loop.time() - quiet_since > _KEEPALIVE_S:
                quiet_since = loop.time()
                yield ": keep-alive\n\n"
            await asyncio.sleep(_POLL_S)
    finally:
        collector.watchers -= 1
