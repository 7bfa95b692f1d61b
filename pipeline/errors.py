"""Errors that carry their policy, so the runner and the bridge handle them generically.

    SluiceError
    ├── StageError          a handler refuses or fails a request: ends it with a terminal error event
    │   └── RetriableError  worth another attempt (a dependency was briefly away) before giving up
    ├── Undeliverable       a message with no safe reply address: dead-lettered, no terminal event
    ├── InfraUnavailable    the broker or a store (Redis) is away: retried with backoff until the
    │                       request's deadline, never dead-lettered as a bug
    └── settings.SettingsError (in pipeline.settings) bad configuration, at start-up only
"""

from __future__ import annotations

from topics.errors import ErrorCode, retriable
from topics.stream import RateLimit


class SluiceError(Exception):
    """Root of sluice's own errors."""


class StageError(SluiceError):
    """A request ends here with `code`; `message` is shown to the client, so it never echoes input."""

    def __init__(
        self, code: ErrorCode, message: str, *, retry_after_s: float | None = None, rate_limit: RateLimit | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.rate_limit = rate_limit
        self.tenant: str | None = None  # who was refused, where the stage knows better than its message (ingest)

    @property
    def retriable(self) -> bool:
        return retriable(self.code)


class RetriableError(StageError):
    """The runner tries the message again with backoff, then dead-letters it."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.internal, message)


class Undeliverable(SluiceError):
    """The message names no reply topic the operator configured, so there is nowhere to answer it."""


class InfraUnavailable(SluiceError):
    """A dependency (the broker, Redis) did not answer. Not the message's fault: the runner retries the
    message with backoff until the request's deadline instead of dead-lettering it."""
