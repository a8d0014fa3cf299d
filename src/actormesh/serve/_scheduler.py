"""Continuous batching as a pure state machine: requests in, step plans out, tokens in, events out.

Theory of operation: a request waits until a batch slot is free, then joins
the running batch at the next step: that step prefills its prompt (row start
0) while the other rows decode one token each. After every step
:meth:`Scheduler.commit` turns the sampled tokens into events: a token for
the caller, or the end of the request (a stop token, which is not emitted;
``max_tokens`` reached) which frees its slot for a waiting request. A
cancelled request leaves between two steps. No I/O and no threads here: the
engine (``_engine.py``) calls these methods from its one loop thread.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..parallel import Shaping, StepPlan
from ._types import PromptLogprobs, PromptToken, SamplingParams

__all__ = ["Event", "Request", "Scheduler", "check_prompt"]


@dataclass(frozen=True)
class Event:
    """What a request's caller hears: a ``token``, or the end (``finish`` reason or ``error``)."""

    token: int | None = None
    finish: str | None = None  #: "stop" (a stop token), "length" (max_tokens), "cancelled"
    error: BaseException | None = None
    logprob: float | None = None  #: the token's log-probability, when the request asked for it
    #: the most probable tokens at this position, ``(id, log-probability)``, when the request asked for them
    top: tuple[tuple[int, float], ...] | None = None
    #: the scored prompt (``SamplingParams.prompt_logprobs``): an event of its own, before the first token
    prompt: PromptLogprobs | None = None


@dataclass(eq=False)
class Request:
    """One generation request and its progress."""

    id: str
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    slot: int = -1
    generated: list[int] = field(default_factory=list)
    position: int = 0  #: position of the next token fed (0: prompt not yet prefilled)
    pending: int | None = None  #: the last sampled token, fed at the next step


def shaping_of(params: SamplingParams, prompt: list[int]) -> Shaping | None:
    """The logit shaping a request asks for (None: none, the common case, which costs nothing)."""
    repeat = params.repetition_penalty != 1.0
    banned = tuple(int(t) for t in params.stop_token_ids) if params.min_tokens else ()
    if not (params.presence_penalty or params.frequency_penalty or params.logit_bias or repeat or banned):
        return None
    bias = tuple(sorted((int(t), float(b)) for t, b in (params.logit_bias or {}).items()))
    return Shaping(float(params.presence_penalty), float(params.frequency_penalty), bias, float(params.repetition_penalty),
                   tuple(prompt) if repeat else (), int(params.min_tokens), banned)


def check_prompt(prompt_ids: list[int], params: SamplingParams, max_context: int, vocab_size: int | None = None) -> list[int]:
    """The prompt as a list of ints; ValueError naming the problem if it is empty, out of vocabulary or too long."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be actormesh.serve.SamplingParams, got {type(params).__name__}")
    if params.n != 1:
        raise ValueError(f"n={params.n}: one generation request is one sequence; LLM.generate runs n of them "
                         "(or send n requests, each with its own seed)")
    try:
        ids = [int(t) for t in prompt_ids]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"prompt_ids must be a sequence of token ids (ints): {exc}") from None
    if not ids:
        raise ValueError("the prompt is empty: give at least one token id")
    if vocab_size is not None and not all(0 <= t < vocab_size for t in ids):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ValueError(f"token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})")
    if vocab_size is not None and params.logit_bias:
        outside = [t for t in params.logit_bias if t >= vocab_size]
        if outside:
            raise ValueError(f"logit_bias names token id {outside[0]}, outside the model's vocabulary (0..{vocab_size - 1})")
    if vocab_size is not None and params.top_logprobs > vocab_size:
        raise ValueError(f"top_logprobs={params.top_logprobs} is more than the model's vocabulary of {vocab_size} tokens")
    if vocab_size is not None and (params.prompt_logprobs or 0) > vocab_size:
        raise ValueError(f"prompt_logprobs={params.prompt_logprobs} is more than the model's vocabulary of {vocab_size} tokens")
    if len(ids) + params.max_tokens > max_context:
        raise ValueError(f"prompt of {len(ids)} tokens + max_tokens={params.max_tokens} = {len(ids) + params.max_tokens} "
                         f"is over the model's context of {max_context} tokens: shorten the prompt or lower max_tokens")
    return ids


class Scheduler:
    """Slots, the waiting queue and the running batch of one engine."""

    def __init__(self, max_slots: int, max_context: int, seed: int | None = None) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.max_slots, self.max_context = max_slots, max_context
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.free = list(range(max_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.admitting = True  #: False while draining for a weight swap
        self._seeds = random.Random(seed)

    def add(self, request: Request) -> None:
        """Queue ``request``; it joins the batch at the first step with a free slot."""
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.running) or (self.admitting and bool(self.waiting))

    def cancel(self, request_id: str) -> Request | None:
        """Remove a waiting or running request (its slot is free at once); None if unknown or finished."""
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                return req
        for slot, req in self.running.items():
            if req.id == request_id:
                self._retire(req)
                return req
        return None

    def plan(self) -> StepPlan | None:
        """The next step: admit waiting requests into free slots, then one row per running request."""
        plan = StepPlan()
        while self.admitting and self.waiting and self.free:
            req = self.waiting.popleft()
            req.slot = self.free.pop()
            self.running[req.slot] = req
            seed = req.params.seed if req.params.seed is not None else self._seeds.getrandbits(63)
            plan.seeds[req.slot] = seed
            shaping = shaping_of(req.params, req.prompt)
            if shaping is not None:
                plan.shaping[req.slot] = shaping
        for slot, req in sorted(self.running.items()):  # by slot: consecutive slots read the cache without a copy
            plan.slots.append(slot)
            plan.tokens.append(list(req.prompt) if req.position == 0 else [req.pending])  # type: ignore[list-item]
            plan.starts.append(req.position)
            p = req.params
            plan.sampling.append((float(p.temperature), int(p.top_k), float(p.top_p), float(p.min_p)))
            plan.logprobs = plan.logprobs or p.logprobs
            plan.top_logprobs = max(plan.top_logprobs, p.top_logprobs)
            if req.position == 0 and p.prompt_logprobs is not None:
                plan.prompt_logprobs[len(plan.slots) - 1] = p.prompt_logprobs
        return plan if plan.slots else None

    def commit(self, plan: StepPlan, tokens: list[int], logprobs: list[float] | None = None,
               tops: list[tuple[tuple[int, float], ...]] | None = None,
               prompts: dict[int, Any] | None = None) -> list[tuple[Request, Event]]:
        """Apply the step's sampled ``tokens`` (their ``logprobs``, each row's most probable tokens ``tops``,
        the scores of the prompts it was asked to score ``prompts``); the events to deliver, in row order."""
        events: list[tuple[Request, Event]] = []
        for row, (slot, fed, start, token) in enumerate(zip(plan.slots, plan.tokens, plan.starts, tokens)):
            req = self.running[slot]
            if row in plan.prompt_logprobs:
                scores = (prompts or {}).get(row)
                if scores is None:  # a backend that cannot score prompts: this request fails, not the engine
                    self._retire(req)
                    events.append((req, Event(error=RuntimeError("the engine's backend gave no scores for a prompt "
                                                                 "that asked for them (SamplingParams.prompt_logprobs)"))))
                    continue
                events.append((req, Event(prompt=_scored_prompt(fed, scores))))
            req.position = start + len(fed)
            if token in req.params.stop_token_ids:
                self._retire(req)
                events.append((req, Event(finish="stop")))
                continue
            req.generated.append(token)
            req.pending = token
            logprob = logprobs[row] if logprobs is not None and req.params.logprobs else None
            k = req.params.top_logprobs
            top = tops[row][:k] if tops is not None and k else None
            events.append((req, Event(token=token, logprob=logprob, top=top)))
            if len(req.generated) >= req.params.max_tokens:
                self._retire(req)
                events.append((req, Event(finish="length")))
        return events

    def drop_all(self) -> list[Request]:
        """Remove every waiting and running request (to fail them); returns them."""
        out = list(self.running.values()) + list(self.waiting)
        for req in list(self.running.values()):
            self._retire(req)
        self.waiting.clear()
        return out

    def _retire(self, req: Request) -> None:
        del self.running[req.slot]
        self.free.append(req.slot)


def _scored_prompt(prompt: list[int], scores: Any) -> PromptLogprobs:
    """A prompt and its scores (``_prompt_scores.RowScores``) as the event carries them: the first
    token has no log-probability (nothing comes before it)."""
    chosen, tops = scores
    out: list[PromptToken] = [(prompt[0], None, ())]
    for i, token in enumerate(prompt[1:]):
        out.append((token, float(chosen[i]), tuple(tops[i]) if tops is not None else ()))
    return PromptLogprobs(tuple(out))
