"""Drafting without torch: the n-gram proposer and the adaptive draft length, shared by the batch-1
library (speculative.py) and the scheduler, which drafts for running sequences inside its decode steps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["AdaptiveDraftLength", "NGramProposer", "ngram_draft_length"]


@dataclass(frozen=True)
class NGramProposer:
    """Prompt lookup decoding: the tokens that followed the most recent earlier occurrence of the last n tokens.

    n goes from `max_n` down to `min_n`; the first n with a match wins. No model: it costs microseconds
    and shines when the answer copies from the prompt (summaries, rewrites, code edits).
    """

    max_n: int = 3
    min_n: int = 2  # a one-token match is mostly chance, and a wasted verification costs more than a plain step

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {self.min_n}..{self.max_n}")

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        ids = list(token_ids)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            suffix, last = ids[-n:], ids[-1]
            for start in range(len(ids) - n - 1, -1, -1):  # an occurrence with at least one token after it
                if ids[start + n - 1] == last and ids[start : start + n] == suffix:
                    return ids[start + n : start + n + k]
        return []


@dataclass
class AdaptiveDraftLength:
    """Draft length k from the running acceptance rate: one longer while it is high, one shorter while low.

    The rate is an exponential moving average of accepted/proposed per step. Fixed k: min_k = max_k = k.
    """

    k: int = 4
    min_k: int = 1
    max_k: int = 8
    smoothing: float = 0.3  # weight of the newest step in the running rate
    raise_above: float = 0.7
    lower_below: float = 0.4
    rate: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.min_k <= self.k <= self.max_k:
            raise ValueError(f"need 0 <= min_k <= k <= max_k, got {self.min_k}, {self.k}, {self.max_k}")
        self.rate = (self.raise_above + self.lower_below) / 2  # neutral until something is observed

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return  # the proposer had no guess: nothing learnt about its accuracy
        self.rate += self.smoothing * (accepted / proposed - self.rate)
        if self.rate > self.raise_above:
            self.k = min(self.k + 1, self.max_k)
        elif self.rate < self.lower_below:
            self.k = max(self.k - 1, self.min_k)


def ngram_draft_length(max_k: int, adaptive: bool = True) -> AdaptiveDraftLength:
    """The draft length of one sequence drafting by n-gram lookup: starts at `max_k`, adapts within
    1..max_k (fixed at max_k when not `adaptive`). A rejected n-gram draft costs only its share of a
    verification forward (the proposer is free), so k stays up at a lower acceptance rate than the
    library defaults, which are meant for a draft model (0.5 / 0.2 measured best in bench.speculative)."""
    return AdaptiveDraftLength(max_k, 1 if adaptive else max_k, max_k, raise_above=0.5, lower_below=0.2)
