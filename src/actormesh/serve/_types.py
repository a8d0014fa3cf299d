"""The contract between generation engines and the HTTP front door.

An engine (a local ``LLMEngine``, or a service of ``LLMServer`` replicas) is a
``TokenGenerator``: given prompt token ids and ``SamplingParams`` it yields new
token ids as they are decoded. Closing the iterator early (``aclose()``, or the
consumer going away) cancels the request and frees its batch slot.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


#: the most alternatives per position a request may ask for (OpenAI's chat limit)
MAX_TOP_LOGPROBS = 20
#: the seeds a torch generator takes (``manual_seed``): a 64-bit int, signed or not
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick new tokens. ``temperature == 0`` (or below 1e-5, as in vLLM) means greedy.

    Example::

        SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=1)
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  #: 0 = no top-k filter
    top_p: float = 1.0  #: 1.0 = no nucleus filter
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    #: also report each new token's log-probability under the model (``LLMService.sample``, ``Event.logprob``)
    logprobs: bool = False
    #: with ``logprobs``: also the ``top_logprobs`` most probable tokens at each position, as
    #: ``(token id, log-probability)`` pairs (generators then yield ``(token, logprob, top)``)
    top_logprobs: int = 0
    #: OpenAI's penalties, in [-2, 2]: subtracted from the logit of every token generated so far,
    #: once (presence) or once per time it was generated (frequency)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: added to the logits of these token ids, in [-100, 100] (-100 bans a token, 100 all but forces it)
    logit_bias: Mapping[int, float] | None = None
    #: also score the prompt (vLLM's name): each prompt token's log-probability given the tokens
    #: before it and, at each position, this many most probable tokens; None: not scored.
    #: Generators then yield one :class:`PromptLogprobs` before the first token.
    prompt_logprobs: int | None = None
    #: vLLM's: drop the tokens less probable than this times the most probable one (0: off)
    min_p: float = 0.0
    #: vLLM's (HF's rule): every token of the prompt or generated so far has a positive logit
    #: divided by it and a negative one multiplied; > 1 discourages repeats (1: off)
    repetition_penalty: float = 1.0
    #: vLLM's: none of ``stop_token_ids`` is picked before this many new tokens
    min_tokens: int = 0
    #: vLLM's: strings that end the text (not included); a str or a sequence of them. Applied where
    #: tokens become text (``LLM``, the HTTP server), not by token generators
    stop: tuple[str, ...] = ()
    #: vLLM's: sequences per prompt, for the text layer (``LLM.generate`` runs ``n`` requests, the
    #: ``j``-th with ``seed + j`` when seeded); one engine request is one sequence (n must be 1 there)
    n: int = 1

    def __post_init__(self) -> None:
        # Each value is checked here because one request's bad value, once in a batch, would
        # fail the step of every request beside it (NaN temperature) or the engine (a str of stop ids).
        _int("max_tokens", self.max_tokens, 1)
        if self.seed is not None:
            _int("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1], "None or ")
        if not _real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        _int("top_k", self.top_k, 0, None, "", " (0 turns it off)")
        if not _real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable):
            raise ValueError(f"stop_token_ids must be a sequence of token ids (ints >= 0), got {self.stop_token_ids!r}")
        stops = tuple(self.stop_token_ids)
        for token in stops:
            _int("stop_token_ids entries", token, 0)
        object.__setattr__(self, "stop_token_ids", stops)  # frozen: a tuple, whatever sequence was given
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be True or False, got {self.logprobs!r}")
        _int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS, "None or ")
        if not _real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1] (0 turns it off), got {self.min_p!r}")
        if not _real(self.repetition_penalty) or not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 turns it off), got {self.repetition_penalty!r}")
        _int("min_tokens", self.min_tokens, 0, self.max_tokens, "", " (at most max_tokens)")
        _int("n", self.n, 1)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop) if isinstance(self.stop, Iterable) else None
        if stop is None or not all(isinstance(x, str) for x in stop):
            raise ValueError(f"stop must be a string or a sequence of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, Mapping):
            raise ValueError(f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}")
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
            if not _real(bias) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")


def _real(value: object) -> bool:
    """A real number that is not a bool (NaN passes here; the range checks refuse it)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _int(name: str, value: object, low: int, high: int | None = None, prefix: str = "", note: str = "") -> None:
    """ValueError unless ``value`` is an int (not a bool) in ``[low, high]``."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok or not low <= int(value) or (high is not None and int(value) > high):  # type: ignore[call-overload]
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {prefix}an int {bound}{note}, got {value!r}")


#: One prompt token scored: its id, its log-probability given the tokens before it (None for
#: the first, which has none), and the most probable tokens at its position as ``(id, log-probability)``.
PromptToken = tuple[int, "float | None", tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class PromptLogprobs:
    """What a generator yields first for a request with ``SamplingParams.prompt_logprobs``:
    every prompt token, scored (:data:`PromptToken`), in order."""

    tokens: tuple[PromptToken, ...]


@runtime_checkable
class TokenGenerator(Protocol):
    """Anything that turns prompts into streams of token ids.

    Optional: an int attribute ``max_sequences``, the most requests it holds at once
    (running and queued); the HTTP server refuses a request of more sequences with a
    400 instead of a 429 that no retry could cure (``LLMService`` has it).
    """

    #: the longest prompt + max_tokens the model accepts
    max_context: int

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[int]:
        """Yield new token ids for ``prompt_ids``; raises ValueError for a prompt over the context."""
        ...
