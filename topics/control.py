"""`llm.control`: cancellations, read by every decode worker (and later postguard)."""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec


class CancelReason(enum.StrEnum):
    client_gone = "client_gone"
    output_guard = "output_guard"
    deadline = "deadline"


# A client id (`topics.requests.ID_PATTERN`, 64 at most), or `<tenant>/` before one: every decode and
# prefill worker remembers the last cancellations it heard, so an id of a megabyte was a megabyte each.
CANCEL_ID = r"^(?:[^/\s]{1,128}/)?[A-Za-z0-9._:-]{1,64}\Z"


class Cancel(msgspec.Struct, frozen=True, tag="cancel.v2", tag_field="kind"):
    # the pipeline's request id (`<tenant>/<client id>`), or the client's id before it has seen one
    id: Annotated[str, msgspec.Meta(pattern=CANCEL_ID)]
    reason: CancelReason
    at: float
