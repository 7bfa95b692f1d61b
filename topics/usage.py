"""`llm.usage`: one record per finished request, keyed by tenant, for billing and dashboards."""

from __future__ import annotations

import msgspec

from topics.hops import RequestId, Timings


class UsageRecord(msgspec.Struct, frozen=True, tag="usage.v2", tag_field="kind"):
    id: RequestId
    tenant: str
    model: str  # a configured model; "other" for a refusal of a model the client named that is not configured
    outcome: str  # "done" or an error code
    prompt_tokens: int
    completion_tokens: int
    total_ms: float
    timings: Timings
    at: float
    cost: float = 0.0  # at the configured prices (gateway.prices), in their currency units
    cache: str | None = None  # the cache tier that answered ("exact", "semantic"); None: generated
