"""OpenAI's error conventions: every failure is ``{"error": {...}}`` with a status.

==========================================  ======  =========================
what went wrong                              status  ``type`` / ``code``
==========================================  ======  =========================
body is not JSON, or a field is invalid      400     invalid_request_error
prompt + max_tokens over the context          400     ... / context_length_exceeded
a field OpenAI defines that is not supported  400     ... / unsupported_parameter
unknown model                                 404     ... / model_not_found
unknown path                                  404     invalid_request_error
a replica died: may or may not have run       503     server_error / service_unavailable
no replica healthy, or the service stopped    503     server_error / service_unavailable
every replica at its limits (did not run)     429     server_error / overloaded
any other failure of the generator            500     server_error
==========================================  ======  =========================

The 429, and the 503 of no healthy replica, carry ``Retry-After``: the request
did not run, so a client may send it again.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import SupervisionError, TransportError
from ._errors import ServiceOverloaded, ServiceStopped, ServiceUnavailable


#: ``Retry-After`` (seconds) of a request that did not run because every replica was busy or
#: none was up: clients that honour it (the ``openai`` client does) come back after this long.
RETRY_AFTER_S = 1


class OpenAIError(Exception):
    """A failure answered with OpenAI's error body and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        #: sent as ``Retry-After``: the request did not run and may be tried again after this long
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """This error as a JSON response (with ``Retry-After`` when a retry may succeed)."""
        headers = None if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_generator_failure(exc: BaseException) -> OpenAIError:
    """Translate an exception raised by a TokenGenerator into an OpenAIError."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):
        return OpenAIError(400, str(exc) or type(exc).__name__)
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ServiceOverloaded):
        return OpenAIError(429, f"every replica is busy; the request did not run, retry later ({text})",
                           type="server_error", code="overloaded", retry_after_s=RETRY_AFTER_S)
    if isinstance(exc, ServiceUnavailable):  # replicas may come back (rebuilt): worth a retry
        return OpenAIError(503, f"no replica can take the request; it did not run ({text})",
                           type="server_error", code="service_unavailable", retry_after_s=RETRY_AFTER_S)
    if isinstance(exc, ServiceStopped):
        return OpenAIError(503, f"no replica can take the request; it did not run ({text})",
                           type="server_error", code="service_unavailable")
    if isinstance(exc, (SupervisionError, TransportError)):
        return OpenAIError(
            503,
            f"the replica serving this request failed; the request may or may not have run ({text})",
            type="server_error",
            code="service_unavailable",
        )
    return OpenAIError(500, f"generation failed: {text}", type="server_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line for pydantic's errors, and the first offending field."""
    parts, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx", {}).get("error", "")
            return f"We could not parse the JSON body of your request ({ctx}).", None
        field = ".".join(loc) or "body"
        param = param or field
        parts.append(f"{field}: {err.get('msg', 'invalid')}")
    return "Invalid request: " + "; ".join(parts), param


def install_error_handlers(app: FastAPI) -> None:
    """Answer validation errors, HTTP errors and OpenAIError in OpenAI's shape."""

    async def on_openai_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return exc.response()

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        return OpenAIError(400, message, param=param).response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path} (see GET /v1/models, POST /v1/completions, POST /v1/chat/completions)"
        return OpenAIError(exc.status_code, message).response()

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
