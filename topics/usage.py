"""`llm.usage`: one record per finished request, keyed by tenant, for billing and dashboards."""

from __future__ import annotations

import msgspec


class UsageRecord(msgspec.Struct, frozen=True, tag="usage.v2", tag_field="kind"):
    id: str
    tenant: str
    model: str
    outcome: str  # "done" or an error code
    prompt_tokens: int
    completion_tokens: int
    total_ms: float
    timings: dict[str, float]
    at: float
