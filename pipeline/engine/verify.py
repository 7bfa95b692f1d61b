"""Verification of a chunk with drafts (scheduler.py's speculative decode steps): which of the drafts
the target keeps, and the target's own token after them, from the chunk's logits at every position.

The drafts are n-gram guesses, a deterministic proposal, so verification is plain decoding with a check
(`accept_coupled`): row i draws exactly what plain decoding draws for the completion token at index
`chunk.completion_index + i` (`sample_token`: the same penalty, the same distribution, the generator
seeded by that index), a draft is kept while it equals the draw, and the first draw that differs is
emitted and ends the step. Greedy: `accept_greedy`, the argmax of every row at once. Either way a
sequence emits exactly the tokens plain decoding would, whether a step drafted or not and however many
drafts the step's token budget and free blocks allowed, so a seeded request's tokens do not depend on
the load around it, nor on whether a recompute or handoff speculated. The repetition penalty of row i
counts the drafts before it, as plain decoding would have counted them as tokens.
"""

from __future__ import annotations

import torch

from pipeline.engine.sampler import apply_penalty, sample_token
from pipeline.engine.scheduler import ScheduledChunk
from pipeline.engine.speculative import accept_coupled, accept_greedy

__all__ = ["verify"]


def verify(chunk: ScheduledChunk, logits: torch.Tensor) -> tuple[int, ...]:
    """The tokens `chunk` emits: its kept drafts, then one of the target's. `logits` [1 + drafts, vocab]:
    row i scores the token after `chunk.token_ids[i]`."""
    params = chunk.seq.sampling
    drafts = list(chunk.token_ids[1:])
    history = list(chunk.seq.token_ids)
    if params.greedy:
        if params.repetition_penalty != 1.0:
            logits = torch.stack([apply_penalty(logits[i], params, history + drafts[:i]) for i in range(len(logits))])
        return tuple(accept_greedy(drafts, logits))

    def draw(i: int) -> int:  # plain decoding's draw for this completion index, the drafts before it as text
        return sample_token(logits[i], params, chunk.completion_index + i, history + drafts[:i])

    return tuple(accept_coupled(drafts, draw))
