"""Errors raised by the engine, each carrying its policy.

    EngineError               root; never raised itself
    ├── RequestTooLarge       the request can never fit the KV pool or the context; retrying will not help
    ├── UnknownHandle         no parked sequence under this handle (never made, evicted, cancelled, taken)
    ├── KVMismatch            an imported KV state does not fit this engine's model or block layout
    ├── SequenceAborted       the sequence was cancelled before it produced what the caller waits for
    ├── StepFailed            the model forward failed; the sequences of that step are aborted
    ├── StepInterrupted       a batch-only step gave way to an arriving interactive request (internal:
    │                         the async engine reschedules; no caller sees it)
    └── EngineClosed          the engine was shut down while the request waited or ran

`retriable` says whether the same request may succeed on a retry (here or elsewhere).
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "EngineClosed",
    "EngineError",
    "KVMismatch",
    "RequestTooLarge",
    "SequenceAborted",
    "StepFailed",
    "StepInterrupted",
    "UnknownHandle",
]


class EngineError(Exception):
    """Root of every error the engine raises on purpose."""

    retriable: ClassVar[bool] = False


class RequestTooLarge(EngineError):
    """Prompt plus max_tokens exceeds the model's context or the whole KV pool."""


class UnknownHandle(EngineError):
    """The handle names no parked sequence; the caller recomputes from the tokens it has."""

    retriable: ClassVar[bool] = True


class KVMismatch(EngineError):
    """An exported KV state came from a different model shape, dtype or block size."""


class SequenceAborted(EngineError):
    """The sequence was cancelled (by its handle) while someone waited on it."""


class StepFailed(EngineError):
    """The model forward raised; the original exception is the `__cause__`."""

    retriable: ClassVar[bool] = True


class StepInterrupted(EngineError):
    """The model stopped a step between two layers because its interrupt was set; nothing of the step
    is accounted (the sequences' computed tokens do not move), so the next step feeds the same tokens."""


class EngineClosed(EngineError):
    """The engine stopped while the sequence was waiting or running."""

    retriable: ClassVar[bool] = True
