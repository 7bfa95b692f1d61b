"""`llm.tokens` (decode to emit) and `llm.responses.<name>` (emit to clients): a tagged union of
numbered chunks and exactly one terminal event per request.

`Chunk.seq` runs 0..n-1 with no gap; `Done.chunks` is n and `Done.digest` the SHA-256 of the text.
Stages that end a request early (ingest rejects it, a handler fails) send a `Failed` on `llm.tokens`,
so emit is the only writer of reply topics.
"""

from __future__ import annotations

import msgspec

from topics.errors import ErrorCode


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Chunk(msgspec.Struct, frozen=True, tag="chunk.v1", tag_field="kind"):
    id: str  # request id
    reply_to: str
    seq: int
    text: str


class Done(msgspec.Struct, frozen=True, tag="done.v1", tag_field="kind"):
    id: str
    reply_to: str
    chunks: int
    digest: str  # sha256 hex of the concatenated chunk texts
    finish_reason: str  # "stop" or "length"
    usage: Usage
    timings: dict[str, float] = {}  # stage -> ms; emit adds "total" (created_at to terminal)
    tenant: str = "default"
    model: str = ""
    created_at: float = 0.0


class RateLimit(msgspec.Struct, frozen=True):
    """Which limit refused a request: the bridge turns it into `x-ratelimit-*` headers."""

    scope: str  # "key", "tenant", "ip" or "global"
    resource: str  # "requests" or "tokens"
    limit: int  # per window
    remaining: int
    reset_s: float  # seconds until the window has room again


class Failed(msgspec.Struct, frozen=True, tag="error.v1", tag_field="kind"):
    id: str
    reply_to: str
    code: ErrorCode
    message: str  # safe for the client: never echoes prompt text or credentials
    retriable: bool
    chunks: int = 0  # chunks sent before the error
    usage: Usage = Usage()
    timings: dict[str, float] = {}
    retry_after_s: float | None = None
    rate_limit: RateLimit | None = None  # set when code is rate_limited
    tenant: str = "default"
    model: str = ""
    created_at: float = 0.0


StreamEvent = Chunk | Done | Failed
Terminal = Done | Failed
