"""`llm.admitted`, `llm.routed.<pool>`, `llm.prefilled`: the request as each stage passes it on.

Each stage copies the envelope forward with what it added (`msgspec.structs.replace`) and its own
time in `timings` (stage name -> milliseconds spent in the handler).
"""

from __future__ import annotations

import msgspec

from topics.requests import Request


class Route(msgspec.Struct, frozen=True):
    backend: str  # a backend name from the config file
    pool: str  # names the topic `llm.routed.<pool>` whose workers serve this backend
    fallbacks: tuple[str, ...] = ()


class Prefill(msgspec.Struct, frozen=True):
    handle: str  # KV state in the prefill worker's backend; decode recomputes it if it cannot reach it
    first_token_id: int
    first_text: str
    prompt_tokens: int
    finished: str | None = None  # finish reason when the first token already ended the request
    worker: str = ""  # which prefill worker holds `handle`


class Envelope(msgspec.Struct, frozen=True, tag="envelope.v1", tag_field="kind"):
    request: Request
    principal: str = ""  # who ingest authenticated the request as
    admitted_at: float = 0.0
    route: Route | None = None
    prefill: Prefill | None = None
    timings: dict[str, float] = {}
