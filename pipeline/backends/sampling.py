"""Choose the next token from logits: greedy, or temperature plus top-p with a seeded generator.

The generator is re-seeded from (request seed, completion position) for every token instead of being
carried along, so a sequence recomputed in another process after a handoff samples exactly what the
original would have sampled.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "sample_token"]

_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive seeds apart


@dataclass(frozen=True)
class SamplingParams:
    temperature: float  # 0 means greedy
    top_p: float
    seed: int

    @classmethod
    def of(cls, temperature: float, top_p: float, seed: int | None) -> SamplingParams:
        """Parameters for one request; a request without a seed gets a random one."""
        return cls(temperature, top_p, secrets.randbits(63) if seed is None else seed)


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """One token id from the 1-D `logits` of the completion token at index `position`."""
    if params.temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    generator = torch.Generator(device=logits.device)
    generator.manual_seed(((params.seed & _MASK63) * _GOLDEN + position) & _MASK63)
    return int(torch.multinomial(probs, 1, generator=generator))
