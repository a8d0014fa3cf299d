"""GRPO's arithmetic: group-relative advantages, the clipped-ratio loss with a KL penalty, and batch packing.

Theory of operation. For each prompt the generator draws ``group_size``
completions; each completion's reward minus its group's mean, divided by the
group's standard deviation (plus a small epsilon), is its advantage: a group
whose completions all score the same teaches nothing and gets zeros. The loss
of a completion token is ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)``
with ``ratio = exp(logp - logp_old)`` (``logp_old`` as the generator sampled
it), plus ``kl_coef`` times the k3 estimate of KL(policy || reference),
``exp(ref - logp) - (ref - logp) - 1``. Tokens are averaged over all of a
batch's completion tokens (``"token"``) or per completion first (``"sequence"``).

A batch travels to the trainer as ``(inputs, targets)``, the shape
:class:`actormesh.parallel.Trainer` slices among data-parallel ranks:
``inputs[B, T]`` are prompt + completion token ids (right-padded),
``targets[B, T, 5]`` hold, for the logits at each position, the next token,
whether it is a completion token (the mask), the advantage, the old and the
reference log-probabilities. :func:`grpo_loss` reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["GRPOConfig", "Sample", "group_advantages", "grpo_loss", "pack_batch", "token_logprobs"]

_NORMS = ("token", "sequence")


@dataclass(frozen=True)
class GRPOConfig:
    """How the loop samples and what the loss weighs.

    ``group_size`` completions per prompt (at least 2: advantages are relative
    to the group), ``prompts_per_step`` prompts per trainer step, so a step's
    batch is ``prompts_per_step * group_size`` completions; ``clip_eps`` the
    ratio clip, ``kl_coef`` the KL penalty's weight (0: no reference model
    needed), ``norm`` ``"token"`` or ``"sequence"``; ``max_policy_lag``: a
    sample drawn with weights more than this many versions old is dropped;
    ``mode`` ``"sync"`` (generate, then train) or ``"async"`` (generation runs
    ahead while the trainer steps); ``sync_every``: push new weights to the
    generators after this many trainer steps.
    """

    group_size: int = 8
    prompts_per_step: int = 8
    max_tokens: int = 8
    temperature: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    norm: str = "token"
    max_policy_lag: int = 1
    mode: str = "sync"
    sync_every: int = 1
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"group_size must be an int >= 2 (advantages are relative to the group), got {self.group_size!r}")
        for name in ("prompts_per_step", "max_tokens", "sync_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.max_policy_lag, int) or self.max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be an int >= 0, got {self.max_policy_lag!r}")
        if self.norm not in _NORMS:
            raise ValueError(f"norm must be one of {_NORMS}, got {self.norm!r}")
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if self.clip_eps <= 0 or self.kl_coef < 0 or self.temperature <= 0:
            raise ValueError("clip_eps must be > 0, kl_coef >= 0 and temperature > 0 (GRPO samples), got "
                             f"{self.clip_eps!r}, {self.kl_coef!r}, {self.temperature!r}")

    @property
    def batch_size(self) -> int:
        """Completions per trainer step."""
        return self.prompts_per_step * self.group_size

    def check_batch(self, batch_size: int) -> None:
        """ValueError unless ``batch_size`` is a whole number of groups."""
        if batch_size % self.group_size:
            raise ValueError(f"a batch of {batch_size} completions is not a multiple of group_size={self.group_size}")


@dataclass
class Sample:
    """One completion: its prompt, tokens, their log-probabilities as sampled, reward and weights version."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    version: int
    reward: float = 0.0
    group: int = 0  #: which prompt's group (completions of one group share a prompt)
    advantage: float = 0.0
    ref_logprobs: list[float] | None = None


def group_advantages(rewards: list[float], group_size: int, eps: float = 1e-4) -> list[float]:
    """Each reward minus its group's mean, over the group's standard deviation (+ ``eps``)."""
    import statistics

    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards are not a multiple of group_size={group_size}")
    out: list[float] = []
    for i in range(0, len(rewards), group_size):
        group = rewards[i:i + group_size]
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        out += [(r - mean) / (std + eps) for r in group]
    return out


def pack_batch(samples: list[Sample], pad_id: int = 0) -> tuple[Any, Any]:
    """``(inputs[B, T], targets[B, T, 5])`` for :func:`grpo_loss` (see the module's docstring)."""
    import torch

    width = max(len(s.prompt) + len(s.tokens) for s in samples) - 1
    inputs = torch.full((len(samples), width), pad_id, dtype=torch.long)
    targets = torch.zeros((len(samples), width, 5), dtype=torch.float32)
    for i, s in enumerate(samples):
        seq = s.prompt + s.tokens
        inputs[i, :len(seq) - 1] = torch.tensor(seq[:-1])
        first, n = len(s.prompt) - 1, len(s.tokens)  # the logits at `first` predict the first completion token
        targets[i, :len(seq) - 1, 0] = torch.tensor(seq[1:], dtype=torch.float32)
        targets[i, first:first + n, 1] = 1.0
        targets[i, first:first + n, 2] = s.advantage
        targets[i, first:first + n, 3] = torch.tensor(s.logprobs)
        ref = s.ref_logprobs if s.ref_logprobs is not None else s.logprobs
        targets[i, first:first + n, 4] = torch.tensor(ref)
    return inputs, targets


def token_logprobs(logits: Any, tokens: Any) -> Any:
    """``log_softmax(logits)`` at ``tokens``: ``logits[B, T, V]``, ``tokens[B, T]`` -> ``[B, T]`` (float32)."""
    import torch

    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def grpo_loss(logits: Any, targets: Any, clip_eps: float = 0.2, kl_coef: float = 0.0, norm: str = "token") -> Any:
    """The GRPO loss of a packed batch (a ``loss_fn`` for :func:`actormesh.parallel.spawn_trainer`).

    Use ``functools.partial(grpo_loss, clip_eps=..., kl_coef=..., norm=...)``.
    """
    import torch

    if norm not in _NORMS:
        raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}")
    tokens, mask, adv, old, ref = targets.unbind(-1)
    logp = token_logprobs(logits, tokens)
    ratio = torch.exp(logp - old)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -surrogate
    if kl_coef:
        delta = ref - logp
        per_token = per_token + kl_coef * (torch.exp(delta) - delta - 1)
    per_token = per_token * mask
    if norm == "token":
        return per_token.sum() / mask.sum().clamp(min=1)
    per_seq = per_token.sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.mean()
