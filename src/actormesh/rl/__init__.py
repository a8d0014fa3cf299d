"""Post-training on one controller: GRPO with a generator service, a reference model and a trainer under any plan.

Example::

    from functools import partial
    import torch, transformers
    from actormesh.parallel import Plan
    from actormesh.parallel.hf import hf_causal_lm
    from actormesh.rl import GRPOConfig, GRPOLoop

    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, max_position_embeddings=16, tie_word_embeddings=False)
    reward = lambda prompt, completion: float(completion[:1] == [(prompt[-1] + 1) % 26])
    prompts = lambda step: [[27, (step * 7 + i) % 26] for i in range(8)]
    with GRPOLoop(partial(hf_causal_lm, cfg), reward, prompts, GRPOConfig(group_size=8, max_tokens=1),
                  partial(torch.optim.AdamW, lr=3e-3), trainer_plan=Plan(dp=2)) as loop:
        for report in loop.run(100):
            print(report.step, report.reward_mean)
"""

from ._buffer import ReplayBuffer
from ._grpo import GRPOConfig, Sample, group_advantages, grpo_loss, pack_batch, token_logprobs
from ._loop import GRPOLoop, StepReport
from ._reference import ReferenceModel

__all__ = ["GRPOConfig", "GRPOLoop", "StepReport", "ReplayBuffer", "ReferenceModel", "Sample", "group_advantages",
           "grpo_loss", "pack_batch", "token_logprobs"]
