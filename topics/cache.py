"""The answer cache on the wire: the ticket a miss carries to emit, and `llm.cache.entries` (compacted).

A request the cache stage may answer later travels on as a miss with a `Ticket` (on the hop, then on
decode's `Done`): emit stores the finished answer under it, in Redis (the exact tier) and as an
`Entry` on `llm.cache.entries` keyed by `Ticket.key`, from which every cache worker builds its
per-tenant vector index (the semantic tier). A `Purge` record on the same topic drops a tenant's
entries (of one model, or all) stored before it. A hit is replayed as the entry's chunks, each and the
`Done` marked with the tier that answered (`CacheTier`).

No text of the question is kept: the semantic tier compares an embedding and digests of the question's
salient tokens (numbers, names, negations: `pipeline.cache.traps`); the answer is stored as sent.
"""

from __future__ import annotations

import enum

import msgspec


class CacheTier(enum.StrEnum):
    exact = "hit-exact"
    semantic = "hit-semantic"


class Ticket(msgspec.Struct, frozen=True):
    key: str  # the exact key (pipeline.cache.keys): tenant, model, the whole request, its parameters
    context: str  # digest of everything but the last user turn: what a semantic hit must share exactly
    ttl_s: float
    vector: bytes = b""  # the last user turn's embedding, float16 (empty: no semantic tier for it)
    salient: bytes = b""  # its salient tokens as digests (pipeline.cache.traps.Salient, msgpack)


class Entry(msgspec.Struct, frozen=True, tag="cache_entry.v1", tag_field="kind"):
    key: str
    tenant: str
    model: str
    context: str
    chunks: tuple[str, ...]  # the answer as the client received it, chunk by chunk
    finish_reason: str  # topics.stream.FinishReason (stop or length: nothing else is stored)
    prompt_tokens: int
    completion_tokens: int
    stored_at: float
    expires_at: float
    vector: bytes = b""
    salient: bytes = b""


class Purge(msgspec.Struct, frozen=True, tag="cache_purge.v1", tag_field="kind"):
    tenant: str
    model: str | None  # None: every model
    at: float  # entries stored before this are dropped


TableRecord = Entry | Purge
