"""One running generation as the scheduler and the KV store see it: ids to feed, cache, sampler, sink."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.backends.sampling import SamplingParams

__all__ = ["Sequence", "SequenceSink"]


class SequenceSink(Protocol):
    """Where a sequence's tokens go; called on the event loop, never from the model thread."""

    def on_token(self, token_id: int) -> bool:
        """Take the newly sampled token; return True when the sequence needs no further step."""
        ...

    def on_error(self, error: BaseException) -> None:
        """The sequence was stopped by `error` (a cancel, a model failure, a shutdown)."""
        ...


@dataclass(eq=False)  # identity semantics: the scheduler keeps sequences in lists and compares by `is`
class Sequence:
    request_id: str
    pending_ids: list[int]  # fed to the model at the next step: the whole prompt before the first step
    sampling: SamplingParams
    position: int  # completion index of the token the next step samples (resume tokens count)
    sink: SequenceSink
    cache: Any = None  # the model's KV cache (a transformers Cache); None until the first step has run

    @property
    def step_cost(self) -> int:
        """Tokens the next step feeds: the prompt length for a prefill, 1 for a decode step."""
        return len(self.pending_ids)
