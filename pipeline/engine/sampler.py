"""Choose next tokens from logits: greedy, or temperature, top-k, top-p and repetition penalty with a
seeded draw.

The generator is re-seeded from (request seed, completion index) for every token instead of being
carried along, so a sequence recomputed after a preemption, or continued in another process after a
handoff, samples exactly what it would have sampled without the interruption.
"""

from __future__ import annotations

from collections.abc import Sequence as Ids

import torch

from pipeline.engine.params import SamplingParams

__all__ = ["apply_penalty", "sample_batch", "sample_token", "seeded_generator", "token_probs"]

_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive seeds apart


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], histories: list[Ids[int]], indices: list[int]) -> list[int]:
    """One token per row of `logits` [rows, vocab]; row i uses params[i], its token history (for the
    repetition penalty) and the completion index of the token it samples."""
    if all(p.greedy and p.repetition_penalty == 1.0 for p in params):
        return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
    return [sample_token(logits[i], params[i], indices[i], histories[i]) for i in range(len(params))]


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int, history: Ids[int] = ()) -> int:
    """One token id from the 1-D `logits` of the completion token at index `position`."""
    logits = apply_penalty(logits, params, history)
    if params.greedy:
        return int(torch.argmax(logits))
    generator = seeded_generator(params, position, logits.device)
    return int(torch.multinomial(token_probs(logits, params), 1, generator=generator))


def seeded_generator(params: SamplingParams, position: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of the draw for the completion token at index `position`."""
    generator = torch.Generator(device=device)
    generator.manual_seed(((params.seed & _MASK63) * _GOLDEN + position) & _MASK63)
    return generator


def apply_penalty(logits: torch.Tensor, params: SamplingParams, history: Ids[int]) -> torch.Tensor:
    """The repetition penalty over every token seen so far (prompt included, as transformers does)."""
    if params.repetition_penalty == 1.0 or not history:
        return logits
    seen = torch.tensor(sorted(set(history)), dtype=torch.long, device=logits.device)
    scores = logits.gather(-1, seen)
    scores = torch.where(scores < 0, scores * params.repetition_penalty, scores / params.repetition_penalty)
    return logits.scatter(-1, seen, scores)


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy draw uses: temperature, then top-k, then top-p (the nucleus always
    keeps the most likely token), renormalised after each cut so it sums to 1: rejection sampling
    compares p(token) with q(token) directly, and a nucleus summing to its mass S < 1 there kept a draft
    with probability S * p(draft) instead of p(draft)."""
    logits = logits.float()
    # Shifted so that the largest is 0 before the division: a temperature of 1e-40 (the API allows any
    # above 0) then gives 0 and -inf, a one-hot draw, not inf / inf = NaN, which failed the whole step
    # and every request batched with this one.
    probs = torch.softmax((logits - logits.max(dim=-1, keepdim=True).values) / params.temperature, dim=-1)
    if params.top_k and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
