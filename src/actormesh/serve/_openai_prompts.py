"""Prompts to token ids: completion prompts, chats, and the context-length check.

Chats are rendered with the tokenizer's chat template
(``apply_chat_template(..., add_generation_prompt=True)``). A tokenizer with no
template gets a plain fallback, one line per message and an open assistant turn::

    system: You are terse.
    user: Hi
    assistant:
"""

from __future__ import annotations

from typing import Any

from ._openai_errors import OpenAIError
from ._openai_schema import ChatMessage, CompletionRequest


def checked_text(text: str, param: str) -> str:
    """``text`` if it is valid Unicode; a 400 naming ``param`` for one the tokenizer cannot take
    (JSON's ``\\ud800`` escape decodes to a lone surrogate, which no UTF-8 encoder accepts)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise OpenAIError(400, f"{param} is not valid Unicode text: {exc.reason} ({text[exc.start:exc.end]!r} at "
                          f"character {exc.start}); send each character whole", param=param) from None
    return text


def render_chat_fallback(messages: list[dict[str, str]]) -> str:
    """The documented plain rendering used when the tokenizer has no chat template."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class PromptBuilder:
    """Encodes prompts for one tokenizer and checks them against ``max_context``."""

    def __init__(self, tokenizer: Any, max_context: int) -> None:
        self.tokenizer = tokenizer
        self.max_context = int(max_context)
        self.vocab_size = len(tokenizer)

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt of a completion request (a string, strings, ids or lists of ids)."""
        raw = req.prompt
        if isinstance(raw, str):
            items: list[Any] = [raw]
        elif raw and all(isinstance(x, int) for x in raw):
            items = [raw]
        else:
            items = list(raw)
        if not items:
            raise OpenAIError(400, "prompt must not be an empty list", param="prompt")
        prompts = []
        for item in items:
            ids = self.tokenizer.encode(checked_text(item, "prompt")) if isinstance(item, str) else list(item)
            if not ids:
                raise OpenAIError(400, "prompt must not be empty", param="prompt")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise OpenAIError(
                    400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", param="prompt"
                )
            prompts.append(ids)
        return prompts

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        """Token ids of a conversation followed by an open assistant turn."""
        plain = [{"role": m.role, "content": checked_text(m.text(), f"messages.{i}.content")} for i, m in enumerate(messages)]
        if getattr(self.tokenizer, "chat_template", None):
            try:
                text = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
            except Exception as exc:  # templates raise on conversations they reject (roles out of order)
                raise OpenAIError(400, f"the model's chat template rejected the messages: {exc}", param="messages") from exc
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(render_chat_fallback(plain))
        if not ids:
            raise OpenAIError(400, "messages render to an empty prompt", param="messages")
        return ids

    def max_tokens(self, prompts: list[list[int]], requested: int | None, param: str) -> int:
        """``requested`` (or all the room left) after checking each prompt fits the context.

        Raises a 400 ``context_length_exceeded`` naming the prompt and completion sizes.
        """
        longest = max(len(p) for p in prompts)
        room = self.max_context - longest
        if requested is None:
            if room < 1:
                raise self._too_long(longest, 1, param)
            return room
        if requested > room:
            raise self._too_long(longest, requested, param)
        return requested

    def _too_long(self, prompt_len: int, completion: int, param: str) -> OpenAIError:
        return OpenAIError(
            400,
            f"This model's maximum context length is {self.max_context} tokens. However, you requested "
            f"{prompt_len + completion} tokens ({prompt_len} in the {param}, {completion} in the completion). "
            "Please reduce the length of the prompt or of max_tokens.",
            param="max_tokens" if completion > 1 else param,
            code="context_length_exceeded",
        )
