"""One engine sequence seen as speculative decoding's `TargetModel` (speculative.py): append tokens
to its KV and get every position's logits in one forward, or keep only the first n positions.

The sequence is driven alone (not through `step()`), with the engine's paged KV and block manager,
so a verified sequence can be handed back to the scheduler or exported like any other."""

from __future__ import annotations

import torch

from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.params import EngineRequest
from pipeline.engine.sequence import Sequence

__all__ = ["EngineTarget"]


class EngineTarget:
    def __init__(self, engine: LLMEngine, request: EngineRequest | None = None) -> None:
        self.engine = engine
        self.seq: Sequence = engine.scheduler.new_sequence(request or EngineRequest((0,), max_tokens=1))
        self.seq.token_ids.clear()
        self.seq.num_prompt_tokens = 0

    def forward_tokens(self, token_ids: list[int]) -> torch.Tensor:
        """Append `token_ids` to the KV cache; float logits [len(token_ids), vocab]."""
        self.seq.token_ids.extend(token_ids)  # kept equal to the KV's tokens, so full blocks hash correctly
        return self.engine.forward_tokens(self.seq, token_ids)

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` positions of the KV (0 empties it and frees every block)."""
        self.engine.truncate(self.seq, max(0, self.seq.num_computed_tokens - num_tokens))
        del self.seq.token_ids[self.seq.num_computed_tokens :]

    def close(self) -> None:
        self.engine.block_manager.deallocate(self.seq)
