"""``ReferenceModel``: a frozen copy of the policy, scoring completions for GRPO's KL term."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..runtime import Actor, endpoint

__all__ = ["ReferenceModel"]


class ReferenceModel(Actor):
    """Holds ``model_fn()`` with ``weights`` (a state dict; None: the model as built under ``seed``), in eval mode.

    ``logprobs(inputs, targets)``: the log-probability of each next token
    (``targets[..., 0]`` of a packed batch) under the reference, ``[B, T]``.
    """

    def __init__(self, model_fn: Callable[[], Any], weights: Mapping[str, Any] | None = None, seed: int = 0) -> None:
        import torch

        from ..parallel import load_weights

        torch.manual_seed(seed)
        self.model = model_fn().eval()
        if weights is not None:
            load_weights([self.model], weights)
        for p in self.model.parameters():
            p.requires_grad_(False)

    @endpoint
    def logprobs(self, inputs: Any, targets: Any) -> Any:
        import torch

        from ._grpo import token_logprobs

        with torch.no_grad():
            return token_logprobs(self.model(inputs), targets[..., 0])
