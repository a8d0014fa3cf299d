"""One generation step over a batch of slots: the plan, the forward passes, sampling.

A :class:`StepPlan` says what one step of continuous batching computes: for
each row, the slot (see :class:`KVCache`), the new tokens fed (a whole prompt
for a request joining the batch, else its last sampled token), the position
of the first of them, and how to pick the row's next token. It is plain data,
so the rank that schedules (rank 0 of a replica) can broadcast it and every
rank runs the same step. :class:`StepRunner` runs plans on one rank's model
chunk: prefill rows (right-padded to the longest prompt) in one forward, decode
rows in another; under pipeline parallelism each stage receives the previous
stage's hidden states and sends its own on; the rank holding the vocabulary
head (the last stage's first tensor-parallel rank) samples with
:class:`Sampler` and, if it is not rank 0, sends the tokens to rank 0.

The model chunk must provide ``forward_cached(x, positions, cache, last)``
(:class:`actormesh.parallel.hf.HFCausalLM` and
:class:`actormesh.parallel.models.GPT` do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._kv_cache import KVCache
from ._prompt_scores import RowScores, last_positions, score_rows, scores_to_rank0
from ._sampling import Sampler, Shaping

__all__ = ["StepPlan", "StepRunner", "StageLinks"]


@dataclass
class StepPlan:
    """One engine step, identical on every rank of a replica.

    ``kind`` is ``"step"`` (run the rows), ``"idle"`` (nothing to run: keeps
    followers' waits short), ``"swap"`` (install staged weights) or ``"stop"``.
    Row ``i`` feeds ``tokens[i]`` into slot ``slots[i]`` starting at position
    ``starts[i]`` (0 for a prompt) and picks its next token with
    ``sampling[i] = (temperature, top_k, top_p, min_p)``; ``seeds`` gives the sampling
    seed of each slot whose request starts in this step, ``shaping`` the
    penalties and logit bias of those that have them (:class:`Shaping`);
    ``version`` names the staged weights a ``"swap"`` installs.
    """

    kind: str = "step"
    slots: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    sampling: list[tuple[float, int, float, float]] = field(default_factory=list)
    seeds: dict[int, int] = field(default_factory=dict)
    shaping: dict[int, Shaping] = field(default_factory=dict)
    version: int = 0  #: for "swap": which staged weights to install
    logprobs: bool = False  #: also give each sampled token's log-probability (``StepRunner.last_logprobs``)
    top_logprobs: int = 0  #: and the most probable tokens of each row, this many (``StepRunner.last_top_logprobs``)
    #: prefill rows whose prompt is scored (see _prompt_scores), each with how many top tokens per position
    prompt_logprobs: dict[int, int] = field(default_factory=dict)

    def groups(self) -> list[list[int]]:
        """Row indices of the prefill pass (new prompts), of one pass per prompt to score (it keeps
        every position's logits, so one at a time bounds them), and of the decode pass (one token each)."""
        scored = self.prompt_logprobs
        prefill = [i for i, s in enumerate(self.starts) if s == 0 and i not in scored]
        scoring = [[i] for i, s in enumerate(self.starts) if s == 0 and i in scored]
        decode = [i for i, s in enumerate(self.starts) if s != 0]
        return [g for g in (prefill, *scoring, decode) if g]


@dataclass(frozen=True)
class StageLinks:
    """Where this rank sits in a replica's pipeline: global ranks of its peers (None: none)."""

    rank: int
    prev_rank: int | None  #: same tensor-parallel rank, previous stage
    next_rank: int | None  #: same tensor-parallel rank, next stage
    sampler_rank: int  #: the last stage's first tensor-parallel rank
    hidden_size: int
    dtype: Any

    @property
    def is_first(self) -> bool:
        return self.prev_rank is None

    @property
    def is_last(self) -> bool:
        return self.next_rank is None


class StepRunner:
    """Runs :class:`StepPlan`s on one rank's model chunk and its :class:`KVCache`.

    ``links=None``: the chunk is the whole model in this process. Otherwise the
    step's point-to-point sends go to the ranks ``links`` names; every rank
    of the replica must run the same plans in the same order. ``compile``
    (True or a backend name) runs ``forward_cached`` through
    ``torch.compile(dynamic=True)``: a few graphs (prefill/decode, with or
    without a mask) compile on first use, which takes tens of seconds on a
    CPU, then each step runs fused kernels instead of a hundred small ops.
    """

    def __init__(self, chunk: Any, cache: KVCache, device: Any, links: StageLinks | None = None,
                 compile: bool | str = False) -> None:
        import torch

        self.chunk, self.cache, self.device, self.links = chunk, cache, device, links
        self.sampler = Sampler()
        self.last_logprobs: list[float] | None = None  #: of the last ``run`` whose plan asked for them (rank 0)
        #: per row, the most probable tokens as (id, log-probability) pairs, when the last plan asked (rank 0)
        self.last_top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
        #: per row of the last plan's ``prompt_logprobs``, its prompt's scores (rank 0; see _prompt_scores)
        self.last_prompt_logprobs: dict[int, RowScores] | None = None
        self.forward = chunk.forward_cached
        self.compiled = bool(compile)
        if compile:
            backend = compile if isinstance(compile, str) else "inductor"
            self.forward = torch.compile(chunk.forward_cached, dynamic=True, backend=backend)

    @property
    def samples(self) -> bool:
        """This rank picks the tokens (holds the vocabulary head's output)."""
        return self.links is None or self.links.rank == self.links.sampler_rank

    def run(self, plan: StepPlan) -> list[int] | None:
        """Run ``plan``; the next token of every row on rank 0, None on other ranks."""
        import torch

        order: list[int] = []
        logits: list[Any] = []
        scores: dict[int, Any] = {}
        with torch.no_grad():
            for rows in plan.groups():
                full = rows[0] in plan.prompt_logprobs  # a group scores all its rows or none
                out = self._forward(plan, rows, full)
                order.extend(rows)
                if out is not None:
                    if full:
                        if self.samples:
                            scores.update(score_rows(out, plan, rows))
                        out = last_positions(out, plan, rows)
                    logits.append(out)
        tokens: list[int] | None = None
        logprobs: list[float] | None = None
        top: Any = None
        if self.samples:
            rows_logits = torch.cat(logits) if len(logits) > 1 else logits[0]
            picked = self.sampler.sample(rows_logits, plan, order)
            tokens = [0] * len(order)
            for row, tok in zip(order, picked):
                tokens[row] = tok
            if plan.logprobs:
                logprobs = [0.0] * len(order)
                chosen, top = Sampler.logprobs(rows_logits, picked, plan.top_logprobs)
                for row, lp in zip(order, chosen):
                    logprobs[row] = lp
                if top is not None:  # rows in plan order, as tokens
                    where = torch.tensor(order).argsort()
                    top = (top[0][where], top[1][where])
        tokens, self.last_logprobs, top = self._to_rank0(tokens, logprobs, top, len(order), plan)
        self.last_prompt_logprobs = scores_to_rank0(self.links, scores if self.samples else None, plan)
        self.last_top_logprobs = None if top is None else [
            tuple(zip(ids, values)) for ids, values in zip(top[0].tolist(), top[1].double().tolist())]
        return tokens

    def _forward(self, plan: StepPlan, rows: list[int], full: bool = False) -> Any:
        """One pass over ``rows`` (all prefill or all decode); logits ``[len(rows), vocab]`` on the last
        stage, or with ``full`` every position's, ``[len(rows), width, vocab]``."""
        import torch
        import torch.distributed as dist

        lens = [len(plan.tokens[r]) for r in rows]
        width = max(lens)
        starts = [plan.starts[r] for r in rows]
        slots = [plan.slots[r] for r in rows]
        ids = torch.tensor([plan.tokens[r] + [0] * (width - n) for r, n in zip(rows, lens)], dtype=torch.long)
        positions = torch.tensor(starts, dtype=torch.long)[:, None]
        if width > 1:
            positions = positions + torch.arange(width)[None, :]
        if self.device.type != "cpu":
            positions = positions.to(self.device)
        self.cache.bind(torch.tensor(slots, device=self.device), positions,
                        # compiled: always a mask, so one graph serves uniform and ragged batches
                        uniform=not self.compiled and len(set(lens)) == 1 and len(set(starts)) == 1,
                        slot_ids=slots, kv_len=max(starts) + width)  # padded positions are written too
        # one new token per row: it is already the last one
        last = torch.tensor(lens, device=self.device) - 1 if (width > 1 or self.compiled) and not full else None
        links = self.links
        if links is None or links.is_first:
            x = ids.to(self.device)
        else:
            x = torch.empty((len(rows), width, links.hidden_size), dtype=links.dtype, device=self.device)
            dist.recv(x, src=links.prev_rank)
        h = self.forward(x, positions, self.cache, last)
        if links is not None and not links.is_last:
            dist.send(h.contiguous(), dst=links.next_rank)
            return None
        return h if full else h[:, -1]

    def _to_rank0(self, tokens: list[int] | None, logprobs: list[float] | None, top: Any, n: int,
                  plan: StepPlan) -> tuple[list[int] | None, list[float] | None, Any]:
        """Bring the sampled tokens (their log-probabilities, the top tokens) to rank 0 when another rank sampled them."""
        import torch
        import torch.distributed as dist

        links = self.links
        if links is None or links.sampler_rank == 0:
            return (tokens, logprobs, top) if links is None or links.rank == 0 else (None, None, None)
        k = plan.top_logprobs if plan.logprobs else 0
        if links.rank == links.sampler_rank:
            dist.send(torch.tensor(tokens, dtype=torch.long), dst=0)
            if plan.logprobs:
                dist.send(torch.tensor(logprobs, dtype=torch.float64), dst=0)
            if k:
                dist.send(top[0].cpu().contiguous(), dst=0)
                dist.send(top[1].cpu().double().contiguous(), dst=0)
            return None, None, None
        if links.rank == 0:
            buf = torch.empty(n, dtype=torch.long)
            dist.recv(buf, src=links.sampler_rank)
            lps, got = None, None
            if plan.logprobs:
                lp_buf = torch.empty(n, dtype=torch.float64)
                dist.recv(lp_buf, src=links.sampler_rank)
                lps = lp_buf.tolist()
            if k:
                ids, values = torch.empty((n, k), dtype=torch.long), torch.empty((n, k), dtype=torch.float64)
                dist.recv(ids, src=links.sampler_rank)
                dist.recv(values, src=links.sampler_rank)
                got = (ids, values)
            return buf.tolist(), lps, got
        return None, None, None
