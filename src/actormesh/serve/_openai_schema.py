"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Only requests are modelled: responses are plain dicts built in ``_openai``
(the official client parses them). Fields are those of OpenAI's API reference;
``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids`` and
``ignore_eos`` are extensions, with vLLM's names and meanings (the ``openai`` client sends
them in ``extra_body``). Fields that OpenAI defines but this
server does not implement (tools, suffix, best_of other than n) are accepted by the
schema only so that
:func:`unsupported_fields` can answer them with a 400 that names the field,
rather than a silent wrong answer. A field that
OpenAI does not define is a 400 too (``extra="forbid"``): a typo such as
``max_token`` must not be ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with token counts."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Sampling fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False  #: extension (as in vLLM): generate past the EOS token, e.g. for benchmarks
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  #: extension (vLLM)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)  #: extension (vLLM)
    min_tokens: int = Field(default=0, ge=0)  #: extension (vLLM): no stop token before this many
    stop_token_ids: list[int] | None = None  #: extension (vLLM): token ids that end a choice, beside EOS
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    #: vLLM's range (a signed 64-bit int): the ``n`` choices of a request draw with ``seed + i``
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    #: token id (as a string, as in OpenAI's API) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` by token id; ValueError naming a key that is not one, or a bias out of range."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys are token ids, got {key!r}") from None
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {key!r}: {bias!r}")
            out[token] = float(bias)
        return out


class CompletionRequest(_Common):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    #: 0 only with ``echo``: the prompt alone, scored with ``logprobs`` (nothing generated)
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    #: each chosen token's log-probability and this many of the most probable tokens per position
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    """One ``{"type": "text", "text": ...}`` part of a message's content."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a conversation. Content is text, or a list of text parts."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        # Only an assistant turn may come without content (in OpenAI's API, one that made tool calls).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None  #: each chosen token's log-probability
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  #: and this many of the most probable tokens (needs logprobs)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


#: field -> the value that means "not used"; anything else is answered with a 400
_UNSUPPORTED: dict[str, Any] = {
    "suffix": None,
    "tools": None,
    "tool_choice": None,
}


def unsupported_fields(req: CompletionRequest | ChatCompletionRequest) -> list[str]:
    """Names of fields set to something this server does not implement.

    ``best_of`` equal to ``n`` and ``response_format`` of type ``text`` mean the
    default behaviour and are allowed; ``logprobs: false`` likewise.
    """
    bad = []
    for name, neutral in _UNSUPPORTED.items():
        value = getattr(req, name, None)
        if value is None or value == neutral or value is False:
            continue
        if name == "tool_choice" and value == "none":
            continue
        bad.append(name)
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != req.n:
        bad.append("best_of")
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.get("type", "text") != "text":
        bad.append("response_format")
    return bad
