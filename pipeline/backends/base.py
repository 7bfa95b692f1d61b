"""The backend protocol: what the generation stages depend on, and nothing more.

Every backend has the base, `Backend`: `generate` turns a `GenerationRequest` into a stream of text
deltas, `cancel` stops a running request at its next step. The prefill/decode split is a capability
(`SplitBackend`): `prefill` returns the first token and a KV handle early, `decode` continues from the
handle. Sluice's own engine (`local`) and the instant backend split; a pool whose backend cannot (Triton,
an OpenAI-compatible server) is served by one generation stage that calls `generate`, with the same
guarantees (topology.py wires it).

Resume: a request may carry the completion tokens already delivered (`resume_token_ids`) or, for a
backend that speaks text only, the delivered text (`resume_text`); a backend continues after them where
it can, and says so with `resumes` (else a successor regenerates from the start, the client's copy
dropping what it already has by sequence number).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

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
    resume_text: str = ""  # the completion text already delivered (backends that speak text, not tokens)
    priority: Literal["interactive", "batch"] = "interactive"  # the engine's scheduling lane
    stream: bool = True  # False: the client waits for the whole answer (a backend may fetch it in one piece)


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
    token_ids: tuple[int, ...]  # tokens this delta covers (empty from a backend that speaks text only)
    finish_reason: FinishReason | None = None  # set on the last delta only
    # On the last delta, from a backend that counts tokens itself (an upstream server's usage): the
    # prompt's tokens and the completion's, which the stage reports instead of counting token ids.
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


@runtime_checkable
class Backend(Protocol):
    name: str

    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]: ...

    async def cancel(self, request_id: str) -> None: ...

    async def aclose(self) -> None:
        """Releases what it holds (connections, an engine): once its process's stages have stopped."""
        ...


@runtime_checkable
class SplitBackend(Backend, Protocol):
    """A backend with the prefill/decode split (and a tokenizer of its own)."""

    async def prefill(self, request: GenerationRequest) -> Prefilled: ...

    def decode(self, request: GenerationRequest, prefilled: Prefilled) -> AsyncIterator[Delta]:
        """Continue after the first token; resumes from `prefilled.handle` or recomputes if it is gone."""
        ...

    def count_prompt_tokens(self, request: GenerationRequest) -> int: ...


@runtime_checkable
class KVHandoff(Protocol):
    """A split backend that can leave a prefilled sequence's KV where a decode worker in another process
    finds it by handle (pipeline/engine/kv_store.py); prefill calls it after sending the first token."""

    async def hand_off(self, prefilled: Prefilled) -> bool:
        """Publish the KV under `prefilled.handle`; False when it was not kept (decode then recomputes)."""
        ...
