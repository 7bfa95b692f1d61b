"""Errors raised by backends, each carrying its policy.

    BackendError              root; never raised itself
    ├── Cancelled             the request was cancelled (client gone, guard fired, deadline)
    ├── InvalidRequest        the request cannot be served as given; retrying will not help
    ├── ModelError            the model's forward pass failed (or the upstream answered 5xx, timed out);
    │                         another backend may succeed
    ├── Overloaded            the upstream refused for load (429), with its retry-after
    ├── Filtered              the upstream's own content filter ended the answer
    └── BackendClosed         the backend was shut down while the request was running

`retriable` says whether the same request may succeed on a retry (here or on another backend);
`code` is the terminal error code the runner and the bridge put on the wire.
"""

from __future__ import annotations

from typing import ClassVar

from topics.errors import ErrorCode

__all__ = ["BackendClosed", "BackendError", "Cancelled", "Filtered", "InvalidRequest", "ModelError", "Overloaded"]


class BackendError(Exception):
    """Root of every error a backend raises on purpose."""

    retriable: ClassVar[bool] = False
    code: ClassVar[ErrorCode] = ErrorCode.backend_error


class Cancelled(BackendError):
    """The request was cancelled through `Backend.cancel`; its stream ends without a finish reason."""

    code: ClassVar[ErrorCode] = ErrorCode.cancelled


class InvalidRequest(BackendError):
    """The request is malformed for this backend: no prompt, both prompt forms, too long, nothing left to generate."""

    code: ClassVar[ErrorCode] = ErrorCode.invalid_request


class ModelError(BackendError):
    """The model failed while running a step (the original exception is the `__cause__`)."""

    retriable: ClassVar[bool] = True


class BackendClosed(BackendError):
    """The backend was closed while the request was waiting or running."""

    retriable: ClassVar[bool] = True


class Overloaded(BackendError):
    """The upstream refused for load (HTTP 429): retriable after `retry_after_s`, here or elsewhere."""

    retriable: ClassVar[bool] = True
    code: ClassVar[ErrorCode] = ErrorCode.rate_limited

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Filtered(BackendError):
    """The upstream ended the answer with its content filter (`finish_reason: "content_filter"`): the request
    ends as `content_filter`, as when postguard stops it, so the cut answer is never taken for a whole one
    (nor stored in the cache)."""

    code: ClassVar[ErrorCode] = ErrorCode.content_filter
