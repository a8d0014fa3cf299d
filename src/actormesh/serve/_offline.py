"""``LLM``: vLLM's offline API (text in, text out, no server) over an ``LLMService``.

A vLLM user writes ``LLM(model).generate(prompts, params)`` and reads
``outputs[i].outputs[0].text``; this is that, with the replicas on actormesh
procs (``tp``, ``pp``, ``replicas``). Prompts are strings or token ids; each
request's text goes through the same detokenizer and stop rules as the HTTP
server (``SamplingParams.stop`` strings, the model's EOS). Any number of prompts
may be given: at most half of ``max_sequences`` run or wait on the replicas at once,
the rest wait here, so a large batch is never refused as overload.

Example::

    with LLM("/models/tiny", tp=2) as llm:
        for out in llm.generate(["Hello, my name is"], SamplingParams(max_tokens=16)):
            print(out.prompt, out.outputs[0].text)
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from ._llm_service import LLMService
from ._openai_main import load_model_dir
from ._openai_prompts import PromptBuilder
from ._openai_schema import ChatMessage
from ._scheduler import check_prompt
from ._text_stream import Piece, TextDecoder, run_sequence
from ._types import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput"]


@dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence (vLLM's names): its text (stop strings and stop tokens cut),
    its token ids, why it ended (``"stop"`` or ``"length"``) and, with ``logprobs``, each
    token's log-probability."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[float | None, ...] | None = None


@dataclass(frozen=True)
class RequestOutput:
    """What ``LLM.generate`` returns per prompt, in prompt order (vLLM's names)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


class LLM:
    """A Hugging Face model directory served by ``replicas`` replicas of ``tp * pp`` procs,
    driven with vLLM's offline calls: :meth:`generate` and :meth:`chat`. Other keyword
    options go to :class:`LLMService` (``max_slots``, ``autoscaling``...)."""

    def __init__(self, model: str | os.PathLike[str], *, tp: int = 1, pp: int = 1, replicas: int = 1,
                 ready_timeout_s: float = 600.0, **options: Any) -> None:
        from ..parallel import Plan
        from ..parallel.hf import hf_causal_lm

        config, self.tokenizer, stops = load_model_dir(model)
        self.stop_token_ids = tuple(stops)
        arch = (getattr(config, "architectures", None) or [None])[0]
        self.service = LLMService(partial(hf_causal_lm, config.to_dict(), arch), Plan(tp=tp, pp=pp), replicas=replicas,
                                  weights=os.fspath(model), **options)
        try:
            self.service.ready(ready_timeout_s)
        except BaseException:
            self.service.stop()
            raise
        self._prompts = PromptBuilder(self.tokenizer, self.service.max_context)

    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Complete each prompt (a string, or token ids); one :class:`RequestOutput` per prompt,
        in order. ``sampling_params``: one for all, or one per prompt (default: greedy, 16 tokens).
        The model's EOS ends a sequence unless ``stop_token_ids`` already names what ends it."""
        texts, ids = self._encode(prompts)
        per = self._params(sampling_params, len(ids))
        return _blocking(self._run(texts, ids, per))

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}``) or several, rendered with the
        tokenizer's chat template and an open assistant turn."""
        many = bool(messages) and not isinstance(messages[0], dict)
        convs = list(messages) if many else [messages]
        ids = [self._prompts.chat_prompt([ChatMessage(**m) for m in conv]) for conv in convs]  # type: ignore[arg-type]
        return _blocking(self._run([None] * len(ids), ids, self._params(sampling_params, len(ids))))

    def _encode(self, prompts: Any) -> tuple[list[str | None], list[list[int]]]:
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("give at least one prompt (a string or a list of token ids)")
        texts = [p if isinstance(p, str) else None for p in prompts]
        return texts, [self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]

    def _params(self, given: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        per: list[SamplingParams] = list(given) if isinstance(given, (list, tuple)) else [given or SamplingParams()] * n  # type: ignore[list-item]
        if not all(isinstance(p, SamplingParams) for p in per):
            raise TypeError(f"sampling_params must be SamplingParams or a list of them, got {given!r}")
        if len(per) != n:
            raise ValueError(f"{n} prompts but {len(per)} SamplingParams: give one, or one per prompt")
        # the model's EOS ends a sequence, as in vLLM, unless the caller chose the stop ids
        return [p if p.stop_token_ids else replace(p, stop_token_ids=self.stop_token_ids) for p in per]

    async def _run(self, texts: list[str | None], ids: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        svc = self.service
        runs = [(i, j, _choice(p, j)) for i, p in enumerate(params) for j in range(p.n)]
        for i, _, p in runs:  # a bad prompt (too long, out of vocabulary) is refused before any runs
            check_prompt(ids[i], p, svc.max_context, svc.vocab_size)
        # Half the service's room: a request's stream can end before its replica call returns (and frees
        # its place), so up to twice this many may still count there at once.
        room = asyncio.Semaphore(max(1, svc.max_sequences // 2))

        async def one(i: int, j: int, p: SamplingParams) -> CompletionOutput:
            async with room:
                pieces = [piece async for piece in run_sequence(svc, j, ids[i], p, TextDecoder(self.tokenizer, p.stop))]
            return _output(j, pieces, p.logprobs)

        outs = await asyncio.gather(*(one(*run) for run in runs))
        per: list[list[CompletionOutput]] = [[] for _ in ids]
        for (i, _, _), out in zip(runs, outs):
            per[i].append(out)
        return [RequestOutput(str(i), texts[i], ids[i], per[i]) for i in range(len(ids))]

    def close(self) -> None:
        """Stop every replica's procs."""
        self.service.stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _blocking(work: Any) -> list[RequestOutput]:
    """Run ``work`` (a coroutine) to its end on a loop of its own; refused inside a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    work.close()
    raise RuntimeError("LLM.generate and LLM.chat block until done, so they cannot run inside an event loop; "
                       "in async code iterate llm.service.generate(prompt_ids, params) (a TokenGenerator)")


def _choice(params: SamplingParams, j: int) -> SamplingParams:
    """The engine request of sequence ``j`` of a prompt: one sequence, its own seed."""
    if params.n == 1:
        return params
    return replace(params, n=1, seed=None if params.seed is None else params.seed + j)


def _output(index: int, pieces: list[Piece], logprobs: bool) -> CompletionOutput:
    tokens = tuple(t for p in pieces for t in p.token_ids)
    scores = tuple(lp for p in pieces for _, lp, _ in p.logprobs) if logprobs else None
    return CompletionOutput(index, "".join(p.text for p in pieces), tokens, pieces[-1].finish_reason or "stop", scores)
