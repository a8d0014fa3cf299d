"""How a generation step picks each row's next token: a request's logit shaping
(:class:`Shaping`: penalties, bias), then temperature, top-k and top-p
(:func:`sample_token`); :class:`Sampler` keeps each slot's seeded generator and
the counts its penalties need. Runs on the rank that holds the vocabulary head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._generate import StepPlan

__all__ = ["GREEDY_BELOW", "Sampler", "Shaping", "sample_token"]


@dataclass(frozen=True)
class Shaping:
    """How a request changes the logits before its tokens are picked, in this order:
    ``repetition_penalty`` (vLLM's, as in HF: every token of ``context``, the prompt, or
    generated so far, has a positive logit divided by it and a negative one multiplied);
    ``logit_bias`` adds to the given token ids; ``presence_penalty`` subtracts from every
    token it has generated once or more, ``frequency_penalty`` that many times; until
    ``min_tokens`` are generated, ``stop_ids`` cannot be picked. Log-probabilities are
    reported from the unchanged logits."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    context: tuple[int, ...] = ()  #: the prompt's token ids, for ``repetition_penalty`` only
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  #: banned while fewer than ``min_tokens`` are generated


#: a temperature below this picks greedily (vLLM's rule): dividing the logits by it would overflow them
GREEDY_BELOW = 1e-5


def sample_token(logits: Any, temperature: float, top_k: int, top_p: float, generator: Any, min_p: float = 0.0) -> int:
    """Draw one token id from ``logits[vocab]``: temperature, then top-k, then nucleus (top-p),
    then min-p filtering.

    ``temperature < GREEDY_BELOW`` (0 too) is greedy (argmax). Top-p keeps the most probable
    tokens whose cumulative probability reaches ``top_p`` (always at least one); min-p (vLLM's)
    drops the tokens less probable than ``min_p`` times the most probable one.
    """
    import torch

    if temperature < GREEDY_BELOW:
        return int(logits.argmax())
    scores = logits.float() / temperature
    if 0 < top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more probable tokens
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)  # the most probable always stays
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    """Picks each row's next token; one seeded ``torch.Generator`` per slot, so a request's samples
    depend only on its seed and its logits, not on which other requests share the batch. A slot
    whose request has a :class:`Shaping` also keeps the counts of the tokens it generated."""

    def __init__(self) -> None:
        self.generators: dict[int, Any] = {}
        self.shaping: dict[int, Shaping] = {}
        self.counts: dict[int, dict[int, int]] = {}

    def _shaped(self, logits: Any, slot: int) -> Any:
        """One row's logits after its request's penalties and bias (a copy; the input is unchanged)."""
        import torch

        shape = self.shaping[slot]
        out = logits.float().clone()
        counts = self.counts.get(slot) or {}
        if shape.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(shape.context).union(counts)), dtype=torch.long, device=out.device)
            vals = out[seen]
            out[seen] = torch.where(vals > 0, vals / shape.repetition_penalty, vals * shape.repetition_penalty)
        if shape.logit_bias:
            ids, bias = zip(*shape.logit_bias)
            out[torch.tensor(ids, device=out.device)] += torch.tensor(bias, device=out.device)
        if counts and (shape.presence_penalty or shape.frequency_penalty):
            ids = torch.tensor(list(counts), device=out.device)
            times = torch.tensor(list(counts.values()), dtype=out.dtype, device=out.device)
            out[ids] -= shape.presence_penalty + shape.frequency_penalty * times
        if shape.stop_ids and sum(counts.values()) < shape.min_tokens:
            out[torch.tensor(shape.stop_ids, device=out.device)] = float("-inf")
        return out

    @staticmethod
    def logprobs(logits: Any, tokens: list[int], top: int = 0) -> tuple[list[float], Any]:
        """Each row's log-probability of its token under the model's distribution (the raw logits);
        with ``top``, also the ``top`` most probable tokens per row: ``(ids, values)``, each ``[rows, top]``."""
        import torch

        picked = torch.tensor(tokens, device=logits.device)[:, None]
        scores = torch.log_softmax(logits.float(), dim=-1)
        chosen = scores.gather(1, picked)[:, 0].tolist()
        if not top:
            return chosen, None
        values, ids = scores.topk(top, dim=-1)  # top <= vocabulary: checked with the prompt
        return chosen, (ids, values)

    def sample(self, logits: Any, plan: StepPlan, rows: list[int]) -> list[int]:
        """Tokens for ``rows`` of ``plan`` from ``logits[len(rows), vocab]``."""
        import torch

        for slot, seed in plan.seeds.items():  # a request starts in this slot
            gen = torch.Generator(device=logits.device)
            gen.manual_seed(seed)
            self.generators[slot] = gen
            self.shaping.pop(slot, None)
            self.counts.pop(slot, None)
        self.shaping.update(plan.shaping)
        greedy = logits.argmax(-1).tolist()
        out = []
        for j, row in enumerate(rows):
            temperature, top_k, top_p, min_p = plan.sampling[row]
            slot = plan.slots[row]
            shaped = slot in self.shaping
            row_logits = self._shaped(logits[j], slot) if shaped else logits[j]
            if temperature < GREEDY_BELOW:
                tok = int(row_logits.argmax()) if shaped else int(greedy[j])
            else:
                tok = sample_token(row_logits, temperature, top_k, top_p, self.generators[slot], min_p)
            if shaped:
                counts = self.counts.setdefault(slot, {})
                counts[tok] = counts.get(tok, 0) + 1
            out.append(tok)
        return out
