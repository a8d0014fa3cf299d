"""The contract between generation engines and the HTTP front door.

An engine (a local ``LLMEngine``, or a service of ``LLMServer`` replicas) is a
``TokenGenerator``: given prompt token ids and ``SamplingParams`` it yields new
token ids as they are decoded. Closing the iterator early (``aclose()``, or the
consumer going away) cancels the request and frees its batch slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


#: the most alternatives per position a request may ask for (OpenAI's chat limit)
MAX_TOP_LOGPROBS = 20
#: the seeds a torch generator takes (``manual_seed``): a 64-bit int, signed or not
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick new tokens. ``temperature == 0`` means greedy.

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

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64 - 1], got {self.seed!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or not isinstance(
                self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an int in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")


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
