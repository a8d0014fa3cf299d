"""Drawing groups of completions from a generator service, retrying the ones a dying replica took."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

from ..serve import ReplicaFailed, SamplingParams, ServiceOverloaded, ServiceUnavailable
from ._grpo import Sample

__all__ = ["generate_groups"]

log = logging.getLogger(__name__)

#: a completion a failing replica took is drawn again at most this many times
RETRIES = 3


async def _one(generator: Any, prompt: list[int], params: SamplingParams, version: int, group: int,
               dropped: Counter[str]) -> Sample | None:
    for attempt in range(RETRIES + 1):
        try:
            pairs = [pair async for pair in generator.generate(prompt, params)]
        except (ReplicaFailed, ServiceOverloaded, ServiceUnavailable) as exc:
            # The replica died (the service rebuilds it with the current weights) or all were busy
            # rebuilding: sampling has no side effect, so drawing again is safe.
            kind = f"generation retried ({type(exc).__name__})"
            if not dropped[kind]:
                log.warning("a completion failed on a generator replica; drawing it again: %r", exc)
            dropped[kind] += 1
            if attempt == RETRIES:
                raise
            await asyncio.sleep(0.2 * (attempt + 1))  # back off while the service rebuilds the replica
            continue
        if not pairs:
            return None
        return Sample(prompt, [t for t, _ in pairs], [lp for _, lp in pairs], version, group=group)
    return None


async def generate_groups(generator: Any, prompts: list[list[int]], group_size: int, params: SamplingParams,
                          version: int, timeout_s: float, dropped: Counter[str]) -> list[list[Sample]]:
    """``group_size`` completions of every prompt, all requested at once (each group in prompt order).

    A completion that came back empty (an immediate stop token) is left out of its group.
    """
    async def everything() -> list[Sample | None]:
        return list(await asyncio.gather(*[_one(generator, p, params, version, g, dropped)
                                           for g, p in enumerate(prompts) for _ in range(group_size)]))

    samples = await asyncio.wait_for(everything(), timeout_s)
    return [[s for s in samples[g * group_size:(g + 1) * group_size] if s is not None] for g in range(len(prompts))]
