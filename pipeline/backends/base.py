"""The backend protocol: what route, prefill and decode depend on, and nothing more.

A backend turns a `GenerationRequest` into text. The split form (`prefill` then `decode`) lets the
prefill stage emit the first token early and hand the decode stage a KV handle; `generate` is the
one-call form used by direct callers and benchmarks. `cancel` stops a running request at its next step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Message:
    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    messages: tuple[Message, ...] = ()  # chat form: the chat template is applied
    prompt: str | None = None  # completion form: used as-is, no template
    max_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    tenant: str = "default"  # isolates cached prefixes: one tenant's prompt never serves another's
    # Completion token ids already consumed when a decode worker resumes another's stream, and how many
    # characters of their text were sent (None: all of it). The continuation is what the first worker
    # would have produced: sampling is seeded per (seed, completion index).
    resume_token_ids: tuple[int, ...] = field(default=())
    resume_sent_chars: int | None = None
    priority: Literal["interactive", "batch"] = "interactive"  # the engine's scheduling lane


@dataclass(frozen=True)
class Prefilled:
    handle: str  # names the KV state in the backend's KV store
    first_token_id: int
    first_text: str  # text of the first token ("" while a stop string may be starting)
    prompt_tokens: int
    finish_reason: FinishReason | None  # set when the first token already ends the request


@dataclass(frozen=True)
class Delta:
    text: str  # new text since the previous delta (may be "")
    token_ids: tuple[int, ...]  # tokens this delta covers
    finish_reason: FinishReason | None = None  # set on the last delta only


class Backend(Protocol):
    name: str

    async def prefill(self, request: GenerationRequest) -> Prefilled: ...

    def decode(self, request: GenerationRequest, prefilled: Prefilled) -> AsyncIterator[Delta]:
        """Continue after the first token; resumes from `prefilled.handle` or recomputes if it is gone."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]: ...

    async def cancel(self, request_id: str) -> None: ...

    def count_prompt_tokens(self, request: GenerationRequest) -> int: ...
