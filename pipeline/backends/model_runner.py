"""Run the model for one scheduler step: one forward per sequence, then sample its next token.

Called in the backend's single model thread. Each sequence keeps its own `DynamicCache`, so a
sequence's numbers do not depend on which other sequences share the step (a batch of one and a
batch of sixteen give the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from pipeline.backends.sampling import SamplingParams, sample_token

__all__ = ["ModelRunner", "StepInput", "StepOutput"]


@dataclass(frozen=True)
class StepInput:
    input_ids: tuple[int, ...]  # the whole prompt for a prefill, the last token for a decode step
    cache: Any  # the sequence's Cache, or None for a prefill (a fresh one is made)
    sampling: SamplingParams
    position: int  # completion index of the token to sample


@dataclass(frozen=True)
class StepOutput:
    token_id: int
    cache: Any  # the sequence's Cache, now covering `input_ids` too


class ModelRunner:
    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model

    @property
    def context_length(self) -> int:
        return int(self._model.config.max_position_embeddings)

    def step(self, inputs: list[StepInput]) -> list[StepOutput]:
        """Advance each sequence by one token (in order); blocking, so run it off the event loop."""
        with torch.inference_mode():
            return [self._advance(item) for item in inputs]

    def _advance(self, item: StepInput) -> StepOutput:
        cache = item.cache if item.cache is not None else DynamicCache(config=self._model.config)
        ids = torch.tensor([item.input_ids], dtype=torch.long, device=self._model.device)
        out = self._model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = sample_token(out.logits[0, -1], item.sampling, item.position)
        return StepOutput(token_id=token, cache=out.past_key_values)
