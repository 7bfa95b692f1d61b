"""`llm.dlq`: messages no stage could handle.

The payload itself is not copied (it may hold credentials or a prompt); the record points at it by
topic, partition and offset and carries its size and SHA-256, so an operator can fetch and replay it
within the source topic's retention.
"""

from __future__ import annotations

import msgspec


class DeadLetter(msgspec.Struct, frozen=True, tag="dead_letter.v1", tag_field="kind"):
    stage: str
    topic: str
    partition: int
    offset: int
    error_type: str
    error: str  # the error's message; schema errors name the field, never its value
    payload_bytes: int
    payload_sha256: str
    request_id: str | None = None
    at: float = 0.0
