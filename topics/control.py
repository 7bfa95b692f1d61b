"""`llm.control`: cancellations, read by every decode worker (and later postguard)."""

from __future__ import annotations

import enum

import msgspec

from topics.hops import REQUEST_ID, RequestId


class CancelReason(enum.StrEnum):
    client_gone = "client_gone"
    output_guard = "output_guard"
    deadline = "deadline"


# A client id (`topics.requests.ID_PATTERN`, 64 at most), or `<tenant>/` before one: every decode and
# prefill worker remembers the last cancellations it heard, so an id of a megabyte was a megabyte each.
CANCEL_ID = REQUEST_ID  # topics.hops: the same rule as every other request id on the wire


class Cancel(msgspec.Struct, frozen=True, tag="cancel.v2", tag_field="kind"):
    # the pipeline's request id (`<tenant>/<client id>`), or the client's id before it has seen one
    id: RequestId
    reason: CancelReason
    at: float
