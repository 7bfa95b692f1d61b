"""Verification of a chunk with drafts (scheduler.py's speculative decode steps): which of the drafts
the target keeps, and the target's own token after them, from the chunk's logits at every position.

Greedy: `accept_greedy`, so the output is exactly the target's greedy output. Temperature: rejection
sampling with the n-gram drafts as a deterministic proposal (q one-hot at the draft: keep draft i with
probability p_i(draft), else draw from p_i with the draft taken out), so every emitted token is
distributed as the target's own sample. The repetition penalty of row i counts the drafts before it, as
plain decoding would have counted them as tokens.
"""

from __future__ import annotations

import torch

from pipeline.engine.sampler import apply_penalty, seeded_generator, token_probs
from pipeline.engine.scheduler import ScheduledChunk
from pipeline.engine.speculative import accept_greedy, accept_rejection_sampling

__all__ = ["verify"]


def verify(chunk: ScheduledChunk, logits: torch.Tensor) -> tuple[int, ...]:
    """The tokens `chunk` emits: its kept drafts, then one of the target's. `logits` [1 + drafts, vocab]:
    row i scores the token after `chunk.token_ids[i]`."""
    params = chunk.seq.sampling
    drafts = list(chunk.token_ids[1:])
    if params.repetition_penalty != 1.0:
        history = list(chunk.seq.token_ids)
        logits = torch.stack([apply_penalty(logits[i], params, history + drafts[:i]) for i in range(logits.shape[0])])
    if params.greedy:
        return tuple(accept_greedy(drafts, logits))
    # seeded by the first new token's completion index: a recomputed step draws the same
    generator = seeded_generator(params, chunk.completion_index)
    return tuple(accept_rejection_sampling(drafts, None, token_probs(logits, params).cpu(), generator))
