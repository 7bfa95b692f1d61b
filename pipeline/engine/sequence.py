"""One generation inside the engine: its tokens, how many have KV, its blocks and its state (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from pipeline.engine.drafting import AdaptiveDraftLength, ngram_draft_length
from pipeline.engine.params import EngineRequest, Priority, SamplingParams, SpeculativeParams

__all__ = ["Sequence", "SequenceStatus"]


class SequenceStatus(Enum):
    WAITING = auto()  # queued for (re)admission; holds no blocks
    RUNNING = auto()  # scheduled every step until it finishes; holds blocks
    PARKED = auto()  # prefilled, holds blocks, not scheduled until its decode resumes it
    FINISHED = auto()  # stop token or max_tokens; blocks freed
    ABORTED = auto()  # cancelled or evicted; blocks freed


@dataclass(eq=False)  # identity semantics: queues compare sequences by `is`
class Sequence:
    """Invariant while WAITING, RUNNING or PARKED: `num_computed_tokens < len(token_ids)`, so there is
    always at least one token to feed, and the last step's logits give the next token."""

    seq_id: int
    token_ids: list[int]  # prompt then completion
    num_prompt_tokens: int
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    priority: Priority
    salt: str
    arrival: int  # admission order: older first within a lane; also the aging clock's start
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV sits in `block_table`
    num_cached_tokens: int = 0  # of those, tokens taken from the prefix cache at the last admission
    block_table: list[int] = field(default_factory=list)
    park_after_first: bool = False  # stop being scheduled after the next sampled token (prefill/decode split)
    preemptions: int = 0
    speculative: SpeculativeParams | None = None  # drafts verified in its decode steps (None: one token a step)
    draft_length: AdaptiveDraftLength | None = None  # set with `speculative`: the next step's draft length
    num_new_tokens: int = 0  # tokens the last step appended (1, or up to k + 1 with speculation)

    def __post_init__(self) -> None:
        if self.speculative is not None and self.draft_length is None:
            self.draft_length = ngram_draft_length(self.speculative.num_draft_tokens, self.speculative.adaptive)

    @classmethod
    def from_request(cls, request: EngineRequest, seq_id: int, arrival: int) -> Sequence:
        return cls(
            seq_id=seq_id,
            token_ids=[*request.prompt_ids, *request.completion_ids],
            num_prompt_tokens=len(request.prompt_ids),
            max_tokens=request.max_tokens,
            sampling=request.sampling,
            stop_token_ids=request.stop_token_ids,
            priority=request.priority,
            salt=request.salt,
            arrival=arrival,
            speculative=request.speculative,
        )

    def to_request(self) -> EngineRequest:
        """The request that recreates this sequence elsewhere, tokens generated so far included."""
        return EngineRequest(
            prompt_ids=tuple(self.token_ids[: self.num_prompt_tokens]),
            completion_ids=tuple(self.completion_ids),
            max_tokens=self.max_tokens,
            sampling=self.sampling,
            stop_token_ids=self.stop_token_ids,
            priority=self.priority,
            salt=self.salt,
            speculative=self.speculative,
        )

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_done(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)

    def reached_stop(self) -> bool:
        """Whether the last token ends the sequence: a stop token, or max_tokens reached."""
        last = self.token_ids[-1]
        return self.num_completion_tokens >= self.max_tokens or (
            self.num_completion_tokens > 0 and last in self.stop_token_ids
        )
