"""Engine backends: what the ``LLMEngine`` loop drives, and the one for a model in this process."""

from __future__ import annotations

from typing import Any, Protocol

from ..parallel import StepPlan

__all__ = ["EngineBackend", "LocalBackend"]


class EngineBackend(Protocol):
    """What the engine loop drives: the model of one process, or of a whole replica."""

    max_context: int
    vocab_size: int | None

    def run(self, plan: StepPlan) -> list[int]:
        """Run one step; the next token of every row. After a plan with ``logprobs=True``, a backend
        that can also has their log-probabilities in ``last_logprobs`` (and, with ``top_logprobs``,
        each row's most probable tokens in ``last_top_logprobs``); after a plan with
        ``prompt_logprobs``, the prompts' scores in ``last_prompt_logprobs``."""
        ...

    def idle(self) -> None:
        """Nothing to run this turn (a replica tells its followers so)."""
        ...

    def swap(self, weights: Any) -> None:
        """Install new weights between two steps."""
        ...

    def close(self) -> None:
        """The loop is ending."""
        ...


class LocalBackend:
    """A whole model in this process: a ``forward_cached`` model (``HFCausalLM``, ``GPT``) and its KV cache."""

    def __init__(self, model: Any, max_slots: int, max_context: int | None = None, device: Any = None,
                 compile: bool | str = False) -> None:
        import torch

        from ..parallel import KVCache, StepRunner

        if not callable(getattr(model, "forward_cached", None)):
            raise TypeError(f"{type(model).__name__} has no forward_cached(x, positions, cache, last): use "
                            "actormesh.parallel.hf.hf_causal_lm(...) or actormesh.parallel.models.GPT")
        model_max = int(model.max_context)
        self.max_context = model_max if max_context is None else int(max_context)
        if not 1 < self.max_context <= model_max:
            raise ValueError(f"max_context={max_context} must be in 2..{model_max} (the model's positions)")
        param = next(model.parameters())
        self.device = param.device if device is None else torch.device(device)
        self.vocab_size = _vocab_size(model)
        self.model = model.eval()
        cache = KVCache(max_slots, self.max_context, model.sliding_window)
        self.runner = StepRunner(model, cache, self.device, compile=compile)

    def run(self, plan: StepPlan) -> list[int]:
        out = self.runner.run(plan)
        assert out is not None
        return out

    @property
    def last_logprobs(self) -> list[float] | None:
        """The last step's log-probabilities, when its plan asked for them."""
        return self.runner.last_logprobs

    @property
    def last_top_logprobs(self) -> list[tuple[tuple[int, float], ...]] | None:
        """The last step's most probable tokens per row, when its plan asked for them."""
        return self.runner.last_top_logprobs

    @property
    def last_prompt_logprobs(self) -> dict[int, Any] | None:
        """The last step's prompt scores per row, when its plan asked for them (see ``StepPlan.prompt_logprobs``)."""
        return self.runner.last_prompt_logprobs

    def idle(self) -> None:
        pass

    def swap(self, weights: Any) -> None:
        from ..parallel import load_weights

        load_weights([self.model], weights)

    def close(self) -> None:
        self.runner.cache.clear()


def _vocab_size(model: Any) -> int | None:
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    return int(size) if size is not None else None
