"""The terminal error codes every stage may end a request with, and their policy."""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Why a request ended without `done`. The value is what clients see."""

    invalid_request = "invalid_request"  # schema or limit violation: the client must change the request
    unauthorized = "unauthorized"
    forbidden = "forbidden"
    rate_limited = "rate_limited"
    budget_exceeded = "budget_exceeded"  # the key's or tenant's spend reached its budget
    unavailable = "unavailable"  # a dependency (Redis) is down and the gateway is configured to fail closed
    not_found = "not_found"  # unknown model
    cancelled = "cancelled"  # the client went away or asked to stop
    deadline_exceeded = "deadline_exceeded"
    content_filter = "content_filter"
    backend_error = "backend_error"
    internal = "internal"  # a stage failed on the message; it is in the dead-letter topic
    stream_incomplete = "stream_incomplete"  # chunks were lost between decode and the client; retry


# HTTP status the bridge answers with, and whether retrying the same request may succeed.
POLICY: dict[ErrorCode, tuple[int, bool]] = {
    ErrorCode.invalid_request: (400, False),
    ErrorCode.unauthorized: (401, False),
    ErrorCode.forbidden: (403, False),
    ErrorCode.rate_limited: (429, True),
    ErrorCode.budget_exceeded: (402, False),
    ErrorCode.unavailable: (503, True),
    ErrorCode.not_found: (404, False),
    ErrorCode.cancelled: (499, False),
    ErrorCode.deadline_exceeded: (504, True),
    ErrorCode.content_filter: (400, False),
    ErrorCode.backend_error: (502, True),
    ErrorCode.internal: (500, True),
    ErrorCode.stream_incomplete: (502, True),
}


def http_status(code: ErrorCode) -> int:
    return POLICY[code][0]


def retriable(code: ErrorCode) -> bool:
    return POLICY[code][1]
