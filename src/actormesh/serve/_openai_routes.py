"""The OpenAI-compatible HTTP app: any TokenGenerator plus a tokenizer, on FastAPI.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events), ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Example::

    from transformers import AutoTokenizer
    app = create_openai_app(engine, AutoTokenizer.from_pretrained(d), model_name="tiny")
    uvicorn.run(app, port=8000)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ._http_metrics import MetricsMiddleware
from ._openai import (
    Disconnected,
    Endpoint,
    HealthCheck,
    OpenAIApp,
    health_route,
    metrics_route,
    new_id,
    streaming_response,
    wants_logprobs,
)
from ._openai_logprobs import CompletionLogprobs, chat_logprobs
from ._openai_errors import OpenAIError, install_error_handlers
from ._openai_schema import ChatCompletionRequest, CompletionRequest
from ._text_stream import Piece, close_iterator
from ._types import TokenGenerator

#: status logged for a request whose client went away (nginx's convention; never seen by the client)
CLIENT_CLOSED = 499


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _prompt_only(pieces: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    """The pieces of ``max_tokens=0``: each choice's prompt scores, none of its new text."""
    try:
        async for p in pieces:
            yield Piece(p.index, "", "length" if p.finish_reason else None, 0, (), p.prompt)
    finally:
        await close_iterator(pieces)


def _add_completions(app: FastAPI, state: OpenAIApp) -> None:
    ep = Endpoint(state, "completions")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        start = time.perf_counter()
        state.check_request(req)
        scored = wants_logprobs(req)
        prompt_only = req.max_tokens == 0
        if prompt_only and not req.echo:
            raise OpenAIError(400, "max_tokens=0 generates nothing, which only makes sense with echo (the prompt back, "
                              "scored with logprobs); set max_tokens >= 1 or echo", param="max_tokens", code=None)
        prompts = state.prompts.completion_prompts(req)
        max_tokens = state.prompts.max_tokens(prompts, 1 if prompt_only else req.max_tokens, "prompt")
        prompt_tokens = sum(len(p) for p in prompts)
        state.metrics.prompt_tokens.labels(ep.name).inc(prompt_tokens)
        pieces = ep.streams(req, prompts, max_tokens)
        if prompt_only:  # one token is generated (the prompt is scored by the step that picks it), then dropped
            pieces = _prompt_only(pieces)
        try:
            first = await ep.first(request, pieces, start)
        except Disconnected:
            return Response(status_code=CLIENT_CLOSED)
        head = {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": state.model_name}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            listed = CompletionLogprobs()
            echoed: set[int] = set()

            def chunk(p: Piece) -> dict[str, Any]:
                prompt_text = ""
                if req.echo and p.index not in echoed:  # a choice's first chunk starts with its prompt
                    echoed.add(p.index)
                    prompt_text = state.tokenizer.decode(prompts[p.index // req.n], skip_special_tokens=True)
                text = prompt_text + p.text
                lps = listed.entries(p.index, p.logprobs, p.prompt, prompt_text) if scored else None
                choice = {"index": p.index, "text": text, "logprobs": lps, "finish_reason": p.finish_reason}
                return {**head, "choices": [choice]}

            def usage(completion_tokens: int) -> dict[str, Any] | None:
                return {**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)} if include_usage else None

            return streaming_response(ep.stream(pieces, first, chunk, usage))
        try:
            out = await ep.collect(request, pieces, first, len(prompts) * req.n)
        except Disconnected:
            return Response(status_code=CLIENT_CLOSED)
        completion_tokens = sum(o["tokens"] for o in out)
        state.metrics.completion_tokens.labels(ep.name).inc(completion_tokens)
        choices = []
        listed = CompletionLogprobs()
        for i, o in enumerate(out):
            echo = state.tokenizer.decode(prompts[i // req.n], skip_special_tokens=True) if req.echo else ""
            if scored and req.echo and o["prompt"] is None:
                raise OpenAIError(400, "echo with logprobs scores the prompt, and this server's generator gave no "
                                  "prompt log-probabilities (SamplingParams.prompt_logprobs); drop echo or logprobs",
                                  param="echo", code="unsupported_parameter")
            lps = listed.entries(i, o["logprobs"], o["prompt"], echo) if scored else None
            choices.append({"index": i, "text": echo + o["text"], "logprobs": lps, "finish_reason": o["finish_reason"]})
        return JSONResponse({**head, "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)})


def _add_chat(app: FastAPI, state: OpenAIApp) -> None:
    ep = Endpoint(state, "chat")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        start = time.perf_counter()
        state.check_request(req)
        prompt = state.prompts.chat_prompt(req.messages)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = state.prompts.max_tokens([prompt], requested, "messages")
        state.metrics.prompt_tokens.labels(ep.name).inc(len(prompt))
        pieces = ep.streams(req, [prompt], max_tokens)
        try:
            first = await ep.first(request, pieces, start)
        except Disconnected:
            return Response(status_code=CLIENT_CLOSED)
        head = {"id": new_id("chatcmpl"), "created": int(time.time()), "model": state.model_name}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            greeted: set[int] = set()

            def chunk(p: Piece) -> dict[str, Any]:
                delta: dict[str, Any] = {} if p.index in greeted else {"role": "assistant"}
                greeted.add(p.index)
                if p.text or "role" in delta:
                    delta["content"] = p.text
                lps = chat_logprobs(p.logprobs) if req.logprobs else None
                choice = {"index": p.index, "delta": delta, "logprobs": lps, "finish_reason": p.finish_reason}
                return {**head, "object": "chat.completion.chunk", "choices": [choice]}

            def usage(completion_tokens: int) -> dict[str, Any] | None:
                if not include_usage:
                    return None
                return {**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage(len(prompt), completion_tokens)}

            return streaming_response(ep.stream(pieces, first, chunk, usage))
        try:
            out = await ep.collect(request, pieces, first, req.n)
        except Disconnected:
            return Response(status_code=CLIENT_CLOSED)
        completion_tokens = sum(o["tokens"] for o in out)
        state.metrics.completion_tokens.labels(ep.name).inc(completion_tokens)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": o["text"]},
                "logprobs": chat_logprobs(o["logprobs"]) if req.logprobs else None,
                "finish_reason": o["finish_reason"],
            }
            for i, o in enumerate(out)
        ]
        body = {**head, "object": "chat.completion", "choices": choices, "usage": _usage(len(prompt), completion_tokens)}
        return JSONResponse(body)


def _add_info(app: FastAPI, state: OpenAIApp) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [state.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != state.model_name:
            raise OpenAIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return state.model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        return await health_route(state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return metrics_route(state)


def create_openai_app(
    generator: TokenGenerator,
    tokenizer: Any,
    *,
    model_name: str,
    stop_token_ids: Sequence[int] | None = None,
    health: HealthCheck | None = None,
) -> FastAPI:
    """An OpenAI-compatible FastAPI app over ``generator``.

    ``tokenizer`` is a Hugging Face tokenizer (``AutoTokenizer.from_pretrained``):
    it encodes prompts, renders chats with its chat template (or the plain
    ``role: content`` fallback when it has none) and decodes tokens.
    ``stop_token_ids`` defaults to the tokenizer's EOS token. ``health`` (sync or
    async, returning a bool) decides ``GET /health``: 200 or 503.
    The app's state is at ``app.state.openai`` (an ``OpenAIApp``).
    """
    state = OpenAIApp(generator, tokenizer, model_name, stop_token_ids, health)
    app = FastAPI(title=f"actormesh OpenAI-compatible server ({model_name})")
    app.state.openai = state
    install_error_handlers(app)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    _add_completions(app, state)
    _add_chat(app, state)
    _add_info(app, state)
    return app
