"""Any Service over HTTP (Ray Serve's HTTP ingress): one ``POST /<endpoint>`` per endpoint.

The body gives the call's arguments: a JSON object is keyword arguments, a JSON
array positional ones, any other JSON value the one positional argument, and
an empty body none. The reply is the endpoint's value as JSON (dataclasses and
pydantic models too, through FastAPI's encoder). Errors keep what a client
must know, with a JSON body ``{"error": {"message", "type"}}``:

=====================================================  ======  =========================
what happened                                          status  ``type``
=====================================================  ======  =========================
body not JSON; arguments that do not fit the endpoint  400     ``invalid_request``
every replica full (did not run)                       429     ``overloaded`` (Retry-After)
no replica up (did not run)                            503     ``unavailable`` (Retry-After)
the service was stopped (did not run)                  503     ``stopped``
the replica died with it in flight (may have run)      503     ``replica_failed``
the endpoint raised                                    500     ``endpoint_error``
its value is not JSON                                  500     ``not_json``
=====================================================  ======  =========================

``GET /-/healthz`` is 200 while a replica is healthy, else 503; ``GET /-/routes``
lists the endpoints.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from ..errors import ActorError, SupervisionError
from ._errors import ServiceOverloaded, ServiceStopped, ServiceUnavailable
from ._openai_errors import RETRY_AFTER_S
from ._openai_server import OpenAIServer
from ._service import Service

__all__ = ["create_service_app", "serve_http"]

def _error(status: int, kind: str, message: str, retry: bool = False) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if retry else None
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)


def _arguments(raw: bytes) -> tuple[list[Any], dict[str, Any]]:
    if not raw.strip():
        return [], {}
    body = json.loads(raw)
    if isinstance(body, dict):
        return [], body
    if isinstance(body, list):
        return body, {}
    return [body], {}


def _failure(name: str, exc: BaseException) -> JSONResponse:
    """The response for a call of ``name`` that raised ``exc`` (at once or from its future)."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ServiceOverloaded):
        return _error(429, "overloaded", f"every replica is busy; {name} did not run, retry later ({text})", retry=True)
    if isinstance(exc, ServiceUnavailable):
        return _error(503, "unavailable", f"no replica can take {name}; it did not run ({text})", retry=True)
    if isinstance(exc, ServiceStopped):
        return _error(503, "stopped", f"the service was stopped; {name} did not run ({text})")
    if isinstance(exc, SupervisionError):
        return _error(503, "replica_failed", f"the replica running {name} failed; it may or may not have run ({text})")
    if isinstance(exc, ActorError):
        return _error(500, "endpoint_error", f"{name} raised {type(exc.exception).__name__}: {exc.exception}")
    return _error(500, "endpoint_error", f"{name} failed: {text}")


def create_service_app(svc: Service[Any], endpoints: Sequence[str] | None = None) -> FastAPI:
    """A FastAPI app that calls ``svc``'s ``endpoints`` (default: all) with ``route``."""
    names = list(svc.endpoint_names if endpoints is None else endpoints)
    unknown = sorted(set(names) - set(svc.endpoint_names))
    if unknown:
        raise ValueError(f"{unknown} are not endpoints of service {svc.name} (its endpoints: {sorted(svc.endpoint_names)})")
    app = FastAPI(title=f"actormesh service {svc.name}", docs_url=None, redoc_url=None, openapi_url=None)

    async def call(name: str, request: Request) -> Any:
        try:
            args, kwargs = _arguments(await request.body())
        except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
            return _error(400, "invalid_request", f"the body of a call to {name} must be JSON: {exc}")
        try:
            value = await svc.endpoint(name).route(*args, **kwargs)
        except TypeError as exc:  # arguments that do not fit the endpoint: checked before it runs
            if isinstance(exc, ActorError):
                return _failure(name, exc)
            return _error(400, "invalid_request", str(exc))
        except Exception as exc:
            return _failure(name, exc)
        try:
            return JSONResponse(jsonable_encoder(value))
        except (TypeError, ValueError) as exc:
            return _error(500, "not_json", f"{name} returned a {type(value).__name__}, which is not JSON: {exc}")

    def route_of(name: str) -> Any:
        async def handler(request: Request) -> Any:
            return await call(name, request)

        return handler

    for name in names:
        app.add_api_route(f"/{name}", route_of(name), methods=["POST"], name=name)

    @app.get("/-/healthz")
    def healthz() -> JSONResponse:
        up = svc.metrics().healthy_replicas
        return JSONResponse({"healthy_replicas": up}, status_code=200 if up else 503)

    @app.get("/-/routes")
    def routes() -> dict[str, list[str]]:
        return {"service": [svc.name], "routes": [f"POST /{n}" for n in names]}

    return app


def serve_http(svc: Service[Any], host: str = "127.0.0.1", port: int = 8000,
               endpoints: Sequence[str] | None = None) -> OpenAIServer:
    """Serve ``svc`` over HTTP from a background thread; ``.url``, ``.stop()`` (the
    service keeps running: stop it yourself). ``port=0`` picks a free port."""
    return OpenAIServer(create_service_app(svc, endpoints), host, port).start()
