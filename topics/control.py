"""`llm.control`: cancellations, read by every decode worker (and later postguard)."""

from __future__ import annotations

import enum

import msgspec


class CancelReason(enum.StrEnum):
    client_gone = "client_gone"
    output_guard = "output_guard"
    deadline = "deadline"


class Cancel(msgspec.Struct, frozen=True, tag="cancel.v2", tag_field="kind"):
    id: str  # the pipeline's request id (`<tenant>/<client id>`), or the client's id before it has seen one
    reason: CancelReason
    at: float
