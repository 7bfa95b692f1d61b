"""Refuses, before any guard work, a request that cannot fit its model's context.

The backend checks the exact count (chat template included) at prefill; by then a 32 KB prompt has
cost the guard seconds. This check counts only the tokens of the message contents, with the model's
own tokenizer (`tokenizers`, no torch), which can never exceed the templated count: it refuses only
requests that prefill would certainly refuse, and says by how much. Models without a local checkpoint
(the instant backend, or one not converted on this machine) are not checked here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from pipeline.checkpoints import MODEL_DIRNAME
from pipeline.errors import StageError
from topics.errors import ErrorCode
from topics.requests import Request


@dataclass(frozen=True)
class ModelContext:
    tokenizer: Tokenizer
    context_tokens: int  # max_position_embeddings of the checkpoint

    @classmethod
    def from_checkpoint(cls, path: Path) -> ModelContext | None:
        tokenizer, config = path / "tokenizer.json", path / "config.json"
        if not (tokenizer.is_file() and config.is_file()):
            return None
        context = int(json.loads(config.read_text())["max_position_embeddings"])
        return cls(Tokenizer.from_file(str(tokenizer)), context)


class ContextLimit:
    def __init__(self, models: dict[str, ModelContext]) -> None:
        self._models = models  # model name as clients ask for it -> its tokenizer and context

    @classmethod
    def from_settings(cls, backends: tuple, model_cache: Path) -> ContextLimit:  # type: ignore[type-arg]
        local = ModelContext.from_checkpoint(model_cache / MODEL_DIRNAME)
        return cls({b.model: local for b in backends if b.kind == "local" and local is not None})

    def content_tokens(self, request: Request) -> int | None:
        """Tokens in the request's texts alone, or None when its model is not known here."""
        model = self._models.get(request.model)
        if model is None:
            return None
        texts = [m.content for m in request.messages] + ([request.prompt] if request.prompt is not None else [])
        return sum(len(e.ids) for e in model.tokenizer.encode_batch(texts, add_special_tokens=False))

    def check(self, request: Request) -> int | None:
        """The content token count; raises a 400 `invalid_request` when it cannot fit with max_tokens."""
        tokens = self.content_tokens(request)
        if tokens is None:
            return None
        context = self._models[request.model].context_tokens
        if tokens + request.sampling.max_tokens > context:
            raise StageError(ErrorCode.invalid_request, f"context_length: the prompt has at least {tokens} tokens and "
                             f"max_tokens is {request.sampling.max_tokens}; the model's context is {context} tokens")
        return tokens
