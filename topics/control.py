"""`llm.control`: cancellations, read by every decode worker (and later postguard)."""

from __future__ import annotations

import enum

import msgspec


class CancelReason(enum.StrEnum):
    client_gone = "client_gone"
    output_guard = "output_guard"
    deadline = "deadline"


class Cancel(msgspec.Struct, frozen=True, tag="cancel.v1", tag_field="kind"):
    id: str  # request id
    reason: CancelReason
    at: float
