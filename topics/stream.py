"""`llm.tokens` (decode to postguard), `llm.checked` (postguard to emit) and `llm.responses.<name>`
(emit to clients): a tagged union of numbered chunks and exactly one terminal event per request.

`Chunk.seq` runs 0..n-1 with no gap; `Done.chunks` is n and `Done.digest` the hash chain of the chunk
texts (`digest_step`: resumable, so a worker that takes a stream over continues it). postguard and emit
check it against the chain of the chunks they took: a stream whose chunks came from two attempts cut
differently ends `stream_incomplete`, not as an answer.
Every event carries the pipeline's request id (`<tenant>/<client id>`, topics.hops) and the tenant.
Stages that end a request early (ingest rejects it, a handler fails) send a `Failed` into the stream
topics, so emit is the only writer of reply topics. Ingest's refusals of requests it could not
authenticate carry the client's own id and the tenant "" (nobody was authenticated). A refusal under
the client's own id (all of ingest's, and the runner's for a record it could not read) also carries a
`nonce` naming the record it refuses: one client id can be refused many times (the same bytes sent again
after a 429, another tenant's or a stranger's request under the same id), so postguard and emit keep one
terminal event per refused record, not per id.

Ids and timings are bounded by the schema (topics.hops: `RequestId`, `Timings`), a rate limit names one of
the gateway's scopes and resources, a nonce is a short token: a record past them (written by whoever can
write to these topics) is unreadable, dead-lettered like any schema error, and never reaches a log line, a
span, a usage record or a metric label.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable
from typing import Annotated, Literal

import msgspec

from topics.cache import CacheTier, Ticket
from topics.errors import ErrorCode
from topics.hops import RequestId, Timings

EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


def digest_step(digest: str, text: str) -> str:
    """The digest after one more chunk: sha256(previous hex digest + text), from EMPTY_DIGEST."""
    return hashlib.sha256(digest.encode() + text.encode()).hexdigest()


def digest_of(texts: Iterable[str]) -> str:
    """The digest of a whole stream of chunk texts."""
    digest = EMPTY_DIGEST
    for text in texts:
        digest = digest_step(digest, text)
    return digest


class FinishReason(enum.StrEnum):
    stop = "stop"  # an end-of-sequence token or a stop string
    length = "length"  # max_tokens reached


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Chunk(msgspec.Struct, frozen=True, omit_defaults=True, tag="chunk.v2", tag_field="kind"):
    id: RequestId
    reply_to: str
    seq: int
    text: str
    tenant: str
    token_ids: tuple[int, ...] = ()  # the completion tokens this chunk covers (empty after postguard rewrites text)
    model: str = ""  # the model (route) the client asked for: postguard checks the answer against its topics
    cache: CacheTier | None = None  # set when the cache answered: the chunks of the stored answer


class Done(msgspec.Struct, frozen=True, omit_defaults=True, tag="done.v2", tag_field="kind"):
    id: RequestId
    reply_to: str
    chunks: int
    digest: str  # the hash chain of the chunk texts (digest_step)
    finish_reason: FinishReason
    usage: Usage
    tenant: str
    model: str
    created_at: float
    timings: Timings = {}  # stage -> ms; emit adds "total" (created_at to terminal)
    cache: CacheTier | None = None  # which tier answered; None: generated
    ticket: Ticket | None = None  # a miss the cache may store: emit stores the answer under it (topics.cache)
    cost: float = 0.0  # set by emit: what the request is billed at the configured prices (gateway.prices)
    deadline_s: float = 300.0  # the request's: how long a stage after decode waits out an outage with it


LimitScope = Literal["key", "tenant", "ip", "global"]  # what a limit counts by (pipeline.gateway.limits.Scope)


class RateLimit(msgspec.Struct, frozen=True):
    """Which limit refused a request: the bridge turns it into `x-ratelimit-*` headers."""

    scope: LimitScope
    resource: Literal["requests", "tokens"]  # a spent budget is `budget_exceeded`, with no RateLimit
    limit: int  # per window
    remaining: int
    reset_s: float  # seconds until the window has room again


class Failed(msgspec.Struct, frozen=True, tag="error.v2", tag_field="kind"):
    id: RequestId
    reply_to: str
    code: ErrorCode
    message: str  # safe for the client: never echoes prompt text or credentials
    retriable: bool
    tenant: str
    model: str
    created_at: float
    chunks: int = 0  # chunks sent before the error
    usage: Usage = Usage()
    timings: Timings = {}
    retry_after_s: float | None = None
    rate_limit: RateLimit | None = None  # set when code is rate_limited
    cost: float = 0.0  # set by emit: what the tokens used before the error are billed
    deadline_s: float = 300.0  # the request's: how long a stage after decode waits out an outage with it
    # Set on a refusal under the client's own id (no "<tenant>/"): an opaque digest of the refused record
    # (topic, partition, offset), so a replay of that record is dropped and another record's refusal is not.
    nonce: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._:-]{1,64}\Z")] | None = None


StreamEvent = Chunk | Done | Failed
Terminal = Done | Failed
