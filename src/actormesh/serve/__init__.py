"""Serving: services of replicas, routers, batching, generation engines and the
OpenAI-compatible HTTP front door (DESIGN.md §7b).

Services (docs/serve.md)::

    Service, service            N replicas of an actor class behind a router
    batched                     gather concurrent calls of an endpoint into one call with a list
    Router, RoundRobin, LeastLoaded
    ServiceMetrics, ReplicaMetrics
    ServiceError, ServiceOverloaded, ServiceUnavailable, ServiceStopped, UnknownSession, ReplicaFailed

Generation (docs/generate.md): :class:`LLMEngine` (continuous batching with a KV
cache in this process), :func:`spawn_llm_server` / :class:`LLMServer` (one
replica on a proc mesh under ``Plan(tp=..., pp=...)``) and
:class:`LLMServerClient` (a replica as a :class:`TokenGenerator`).

HTTP (docs/serve_http.md): ``serve_openai`` (a model directory over OpenAI's
API), ``LLMService`` (a Service of LLMServer replicas as one TokenGenerator),
``create_openai_app`` and ``OpenAIServer``, and vLLM's offline ``LLM`` (``generate``,
``chat``; docs/generate.md) are loaded on first use. Importing this package imports
neither torch nor FastAPI.
"""

from typing import Any

from ._autoscale import Autoscaling
from ._batching import batched
from ._backend import EngineBackend, LocalBackend
from ._engine import EngineClosedError, LLMEngine
from ._handle import HandleEndpoint, ServiceHandle
from ._errors import ReplicaFailed, ServiceError, ServiceOverloaded, ServiceStopped, ServiceUnavailable, UnknownSession
from ._llm_client import LLMServerClient
from ._llm_server import LLMServer, spawn_llm_server
from ._metrics import ReplicaMetrics, ServiceMetrics
from ._router import LeastLoaded, ReplicaLoad, RoundRobin, Router
from ._service import ReplicaInfo, Service, ServiceEndpoint, Session, service
from ._types import PromptLogprobs, SamplingParams, TokenGenerator

__all__ = [
    "SamplingParams",
    "PromptLogprobs",
    "TokenGenerator",
    "Service",
    "Autoscaling",
    "ServiceHandle",
    "HandleEndpoint",
    "ServiceEndpoint",
    "Session",
    "ReplicaInfo",
    "service",
    "batched",
    "Router",
    "ReplicaLoad",
    "RoundRobin",
    "LeastLoaded",
    "ServiceMetrics",
    "ReplicaMetrics",
    "ServiceError",
    "ServiceOverloaded",
    "ServiceUnavailable",
    "ServiceStopped",
    "UnknownSession",
    "ReplicaFailed",
    "EngineBackend",
    "EngineClosedError",
    "LLMEngine",
    "LLMServer",
    "LLMServerClient",
    "LocalBackend",
    "spawn_llm_server",
    "LLMService",
    "create_openai_app",
    "OpenAIServer",
    "serve_openai",
    "LLM",
    "RequestOutput",
    "CompletionOutput",
    "create_service_app",
    "serve_http",
]

#: lazily loaded name -> module that defines it (FastAPI and uvicorn load on first use)
_LAZY = {
    "LLMService": "._llm_service",
    "create_openai_app": "._openai_routes",
    "OpenAIServer": "._openai_server",
    "serve_openai": "._openai_main",
    "LLM": "._offline",
    "RequestOutput": "._offline",
    "CompletionOutput": "._offline",
    "create_service_app": "._http_ingress",
    "serve_http": "._http_ingress",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
