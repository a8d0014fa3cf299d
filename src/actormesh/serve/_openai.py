"""The machinery behind the OpenAI-compatible routes (see ``_openai_routes``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events), ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics`` (Prometheus text).

A client that goes away cancels its request: the token iterator is closed,
which frees the request's batch slot in the engine. For streaming requests
Starlette cancels the response on disconnect; for the rest, and for the time
before the first token, :func:`_unless_disconnected` races the work against the
client's ``http.disconnect``.

"""

from __future__ import annotations

import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ._http_metrics import ServerMetrics
from ._openai_errors import OpenAIError, from_generator_failure
from ._openai_prompts import PromptBuilder
from ._openai_schema import ChatCompletionRequest, CompletionRequest, unsupported_fields
from ._text_stream import Piece, TextDecoder, close_iterator, merge, run_sequence
from ._types import SamplingParams, TokenGenerator

#: ``GET /health``'s check: sync or async, returning whether the server is healthy
HealthCheck = Callable[[], "bool | Awaitable[bool]"]


class Disconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def _unless_disconnected(request: Request, work: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``work()``; cancel it and raise Disconnected if the client goes away first."""
    result: list[Any] = []
    failure: list[Exception] = []

    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    tg.cancel_scope.cancel()
                    return

        async def run() -> None:
            try:
                result.append(await work())
            except Exception as exc:  # re-raised bare below, not wrapped in an ExceptionGroup
                failure.append(exc)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        tg.start_soon(run)
    if failure:
        raise failure[0]
    if not result:
        raise Disconnected()
    return result[0]


def wants_logprobs(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether the answer reports each chosen token's log-probability."""
    if isinstance(req, CompletionRequest):
        return req.logprobs is not None
    return bool(req.logprobs)


def top_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int:
    """How many of the most probable tokens to list per position."""
    if isinstance(req, CompletionRequest):
        return req.logprobs or 0
    if req.top_logprobs and not req.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code=None)
    return req.top_logprobs or 0


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class Endpoint:
    """What the completion and chat routes share: sampling, running, shaping."""

    def __init__(self, app: OpenAIApp, name: str) -> None:
        self.app = app
        self.name = name  # metric label: "completions" or "chat"

    def params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int, choice: int) -> SamplingParams:
        seed = None if req.seed is None else req.seed + choice
        # The legacy completions' echo with logprobs scores the prompt too (lm-eval's loglikelihood uses it).
        echo_scored = isinstance(req, CompletionRequest) and req.echo and wants_logprobs(req)
        return SamplingParams(
            prompt_logprobs=top_logprobs(req) if echo_scored else None,
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=seed,
            stop_token_ids=(() if req.ignore_eos else self.app.stop_token_ids) + tuple(req.stop_token_ids or ()),
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_tokens=req.min_tokens,
            logprobs=wants_logprobs(req),
            top_logprobs=top_logprobs(req),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=req.token_bias(),
        )

    def streams(
        self, req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]], max_tokens: int
    ) -> AsyncIterator[Piece]:
        total, limit = len(prompts) * req.n, getattr(self.app.generator, "max_sequences", None)
        if isinstance(limit, int) and 0 < limit < total:
            raise OpenAIError(400, f"this request asks for {total} sequences ({len(prompts)} prompt(s), n={req.n}) and this "
                              f"server holds at most {limit} at once, so it could never run whole; send fewer prompts "
                              "per request or a smaller n", param="n" if req.n > 1 else "prompt", code=None)
        try:
            params = [self.params(req, max_tokens, j) for j in range(req.n)]
        except ValueError as exc:  # values each valid alone that do not fit together (min_tokens > max_tokens)
            field = str(exc).split(" ", 1)[0]
            raise OpenAIError(400, str(exc), param=field if field in type(req).model_fields else None, code=None) from None
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        runs = []
        for p, ids in enumerate(prompts):
            for j in range(req.n):
                decoder = TextDecoder(self.app.tokenizer, stops)
                runs.append(run_sequence(self.app.generator, p * req.n + j, ids, params[j], decoder))
        return merge(runs)

    async def first(self, request: Request, pieces: AsyncIterator[Piece], start: float) -> Piece:
        """Wait for the first piece (answering errors with a proper status)."""
        try:
            piece = await _unless_disconnected(request, pieces.__anext__)
        except Disconnected:
            self.app.metrics.cancelled.labels(self.name).inc()
            await close_iterator(pieces)
            raise
        except BaseException as exc:
            await close_iterator(pieces)
            if isinstance(exc, Exception):
                raise from_generator_failure(exc) from exc
            raise
        self.app.metrics.ttft.labels(self.name).observe(time.perf_counter() - start)
        return piece

    async def collect(self, request: Request, pieces: AsyncIterator[Piece], first: Piece, total: int) -> list[dict[str, Any]]:
        """Run every choice to its end; return ``[{"text", "finish_reason", "tokens", "logprobs"}]``
        (``logprobs``: the chosen tokens' ``(text, log-probability)``, when asked for)."""
        out: list[dict[str, Any]] = [{"text": "", "finish_reason": None, "tokens": 0, "logprobs": [], "prompt": None}
                                     for _ in range(total)]

        def add(piece: Piece) -> None:
            slot = out[piece.index]
            slot["text"] += piece.text
            slot["logprobs"].extend(piece.logprobs)
            if piece.prompt is not None:
                slot["prompt"] = piece.prompt
            slot["tokens"] = piece.completion_tokens
            if piece.finish_reason:
                slot["finish_reason"] = piece.finish_reason

        async def rest() -> None:
            async for piece in pieces:
                add(piece)

        add(first)
        try:
            await _unless_disconnected(request, rest)
        except Disconnected:
            self.app.metrics.cancelled.labels(self.name).inc()
            raise
        except Exception as exc:
            raise from_generator_failure(exc) from exc
        finally:
            await close_iterator(pieces)
        return out

    async def stream(
        self, pieces: AsyncIterator[Piece], first: Piece, chunk: Callable[[Piece], dict[str, Any]], usage: Callable[[int], dict[str, Any] | None]
    ) -> AsyncIterator[str]:
        """Server-sent events: one chunk per piece, usage if asked, then ``[DONE]``."""
        tokens: dict[int, int] = {}
        ended = False  # stays False only when the client went away (cancellation)
        try:
            piece: Piece | None = first
            while piece is not None:
                tokens[piece.index] = piece.completion_tokens
                if piece.text or piece.finish_reason:
                    yield _sse(chunk(piece))
                piece = await anext(pieces, None)
            ended = True
            last = usage(sum(tokens.values()))
            if last is not None:
                yield _sse(last)
        except Exception as exc:
            ended = True
            yield _sse(from_generator_failure(exc).body())
        finally:
            if not ended:
                self.app.metrics.cancelled.labels(self.name).inc()
            self.app.metrics.completion_tokens.labels(self.name).inc(sum(tokens.values()))
            await close_iterator(pieces)
        yield "data: [DONE]\n\n"


class OpenAIApp:
    """The state behind the routes: generator, tokenizer, model name, metrics."""

    def __init__(
        self,
        generator: TokenGenerator,
        tokenizer: Any,
        model_name: str,
        stop_token_ids: Sequence[int] | None,
        health: HealthCheck | None,
    ) -> None:
        self.generator = generator
        self.tokenizer = tokenizer
        self.model_name = model_name
        if stop_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            stop_token_ids = [] if eos is None else [eos]
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.health = health
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self.prompts = PromptBuilder(tokenizer, generator.max_context)

    def check_request(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.model != self.model_name:
            raise OpenAIError(
                404,
                f"The model `{req.model}` does not exist. This server serves `{self.model_name}` (see GET /v1/models).",
                param="model",
                code="model_not_found",
            )
        top_logprobs(req)  # a 400 for top_logprobs without logprobs
        try:
            bias = req.token_bias()
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="logit_bias") from None
        outside = [t for t in bias or {} if t >= self.prompts.vocab_size]
        if outside:
            raise OpenAIError(400, f"logit_bias names token id {outside[0]}, outside the vocabulary [0, {self.prompts.vocab_size})",
                              param="logit_bias")
        bad = unsupported_fields(req)
        if bad:
            raise OpenAIError(
                400,
                f"not supported by this server: {', '.join(bad)} (leave unset)",
                param=bad[0],
                code="unsupported_parameter",
            )

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "actormesh",
            "max_model_len": self.generator.max_context,
        }

    async def healthy(self) -> bool:
        if self.health is None:
            return True
        verdict = self.health()
        if inspect.isawaitable(verdict):
            verdict = await verdict
        return bool(verdict)


async def health_route(state: OpenAIApp) -> JSONResponse:
    """``GET /health``: 200 ``{"status": "ok"}`` or 503 ``{"status": "unhealthy"}``."""
    try:
        ok = await state.healthy()
    except Exception as exc:  # a failing check is an unhealthy verdict, with its reason
        return JSONResponse({"status": "unhealthy", "reason": f"{type(exc).__name__}: {exc}"}, status_code=503)
    return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)


def metrics_route(state: OpenAIApp) -> Response:
    """``GET /metrics``: Prometheus text exposition."""
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


def streaming_response(body: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent events, not buffered by proxies."""
    return StreamingResponse(
        body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def new_id(prefix: str) -> str:
    """``cmpl-…`` / ``chatcmpl-…`` identifiers."""
    return f"{prefix}-{uuid.uuid4().hex}"
