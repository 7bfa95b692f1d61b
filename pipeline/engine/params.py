"""What a request asks of the engine: sampling parameters and the request itself (no torch here)."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from enum import IntEnum

__all__ = ["EngineRequest", "Priority", "SamplingParams", "SpeculativeParams"]


class Priority(IntEnum):
    """Scheduling lanes: interactive work is admitted first; batch work ages into the interactive lane."""

    INTERACTIVE = 0
    BATCH = 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    repetition_penalty: float = 1.0  # 1 means none (the CTRL/HF rule: divide positive logits, multiply negative)
    seed: int = 0  # with the completion index, seeds each token's draw (see sampler.py)

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature < math.inf and 0.0 < self.top_p <= 1.0 and self.top_k >= 0
                and 0.0 < self.repetition_penalty < math.inf):  # written so that NaN fails every test
            raise ValueError(f"bad sampling parameters: {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def of(cls, temperature: float, top_p: float, seed: int | None, **kwargs: float) -> SamplingParams:
        """Parameters for one request; a request without a seed gets a random one."""
        return cls(temperature, top_p, seed=secrets.randbits(63) if seed is None else seed, **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SpeculativeParams:
    """Speculative decoding inside the engine's decode steps (scheduler.py): n-gram prompt lookup drafts up
    to `num_draft_tokens` tokens per step, verified with the other sequences' work in the same forward."""

    num_draft_tokens: int = 4  # the most drafts verified in one step (the adaptive length starts here)
    adaptive: bool = True  # move the length between 1 and num_draft_tokens with the acceptance rate

    def __post_init__(self) -> None:
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be 1..{MAX_DRAFT_TOKENS}, got {self.num_draft_tokens}")


MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class EngineRequest:
    """One generation as the engine takes it: token ids in, token ids out (text is the caller's business)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int  # completion tokens in all, `completion_ids` included
    sampling: SamplingParams = field(default_factory=SamplingParams)
    completion_ids: tuple[int, ...] = ()  # completion tokens already produced (resume, recompute, import)
    stop_token_ids: frozenset[int] = frozenset()
    priority: Priority = Priority.INTERACTIVE
    salt: str = ""  # the tenant: prefix-cache blocks are shared only between requests with the same salt
    speculative: SpeculativeParams | None = None  # None: one token per decode step
