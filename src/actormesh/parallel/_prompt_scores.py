"""Scoring a prompt: each prompt token's log-probability given the tokens before it.

A row of a :class:`~._generate.StepPlan` listed in ``plan.prompt_logprobs``
(a request with ``SamplingParams.prompt_logprobs``, in its prefill step) runs
in a prefill pass of its own whose last stage keeps the logits of every
position, not only the last one's: position ``i`` predicts token ``i + 1``.
The rank holding the vocabulary head scores the rows (:func:`score_rows`)
and, if it is not rank 0, sends the scores there (:func:`scores_to_rank0`);
the shapes are known on both sides from the plan, so nothing else travels.
Only the rows that asked pay for the full logits: ``[1, prompt, vocabulary]``
each, like vLLM's prompt log-probabilities.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RowScores", "last_positions", "score_rows", "scores_to_rank0"]

#: Per scored row: each prompt token after the first, its log-probability, and (when the
#: row asked for k > 0) the k most probable tokens at its position as ``(id, log-probability)``.
RowScores = tuple[list[float], list[tuple[tuple[int, float], ...]] | None]


def last_positions(logits: Any, plan: Any, rows: list[int]) -> Any:
    """Each row's logits at its last fed token: ``[len(rows), vocab]`` from ``[len(rows), width, vocab]``."""
    import torch

    last = torch.tensor([len(plan.tokens[r]) - 1 for r in rows], device=logits.device)
    return logits[torch.arange(len(rows), device=logits.device), last]


def score_rows(logits: Any, plan: Any, rows: list[int]) -> dict[int, tuple[Any, Any]]:
    """Score ``rows`` from their full logits ``[len(rows), width, vocab]`` (the sampling rank):
    per row, the prompt's log-probabilities ``[n - 1]`` (float64) and, for k > 0, the top
    tokens ``(ids [n - 1, k], values [n - 1, k])`` (else None)."""
    import torch

    out: dict[int, tuple[Any, Any]] = {}
    for j, row in enumerate(rows):
        fed = plan.tokens[row]
        n = len(fed)
        scores = torch.log_softmax(logits[j, : n - 1].float(), dim=-1)
        nxt = torch.tensor(fed[1:], dtype=torch.long, device=scores.device)[:, None]
        chosen = scores.gather(1, nxt)[:, 0].double().cpu()
        k = plan.prompt_logprobs[row]
        top = None
        if k and n > 1:
            values, ids = scores.topk(k, dim=-1)  # k <= vocabulary: checked with the prompt
            top = (ids.cpu().contiguous(), values.double().cpu().contiguous())
        out[row] = (chosen, top)
    return out


def scores_to_rank0(links: Any, scores: dict[int, tuple[Any, Any]] | None, plan: Any) -> dict[int, RowScores] | None:
    """The scores, as Python lists, on rank 0 (None on the other ranks); sent there by point-to-point
    messages when another rank holds the head. Every rank of the replica calls this with the same plan."""
    import torch
    import torch.distributed as dist

    if not plan.prompt_logprobs:
        return None
    if links is None or links.sampler_rank == 0:
        if links is not None and links.rank != 0:
            return None
        assert scores is not None
        return {row: _as_lists(chosen, top) for row, (chosen, top) in scores.items()}
    rows = [r for r in sorted(plan.prompt_logprobs) if len(plan.tokens[r]) > 1]  # a one-token prompt has no scores
    if links.rank == links.sampler_rank:
        assert scores is not None
        for row in rows:
            chosen, top = scores[row]
            dist.send(chosen, dst=0)
            if top is not None:
                dist.send(top[0], dst=0)
                dist.send(top[1], dst=0)
        return None
    if links.rank != 0:
        return None
    got: dict[int, RowScores] = {r: ([], None) for r in plan.prompt_logprobs}
    for row in rows:
        n, k = len(plan.tokens[row]) - 1, plan.prompt_logprobs[row]
        chosen = torch.empty(n, dtype=torch.float64)
        dist.recv(chosen, src=links.sampler_rank)
        top = None
        if k:
            top = (torch.empty((n, k), dtype=torch.long), torch.empty((n, k), dtype=torch.float64))
            dist.recv(top[0], src=links.sampler_rank)
            dist.recv(top[1], src=links.sampler_rank)
        got[row] = _as_lists(chosen, top)
    return got


def _as_lists(chosen: Any, top: Any) -> RowScores:
    if top is None:
        return chosen.tolist(), None
    return chosen.tolist(), [tuple(zip(ids, values)) for ids, values in zip(top[0].tolist(), top[1].tolist())]
