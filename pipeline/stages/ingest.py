"""ingest: the front door. Validates a request against the operator's limits and passes it on.

Authentication and rate limits (the gateway issue) plug in here; until then every well-formed
request is admitted under its tenant name.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from pipeline.errors import StageError, Undeliverable
from pipeline.settings import Settings
from pipeline.stage import Out, Stopwatch
from topics import registry
from topics.envelope import Envelope
from topics.errors import ErrorCode
from topics.requests import Request


class IngestStage:
    name = "ingest"
    input_topics = (registry.REQUESTS,)
    input_type = Request
    ordered = False

    def __init__(self, settings: Settings) -> None:
        self._limits = settings.limits
        self._models = frozenset(settings.models)
        self._replies = settings.reply_topics

    def check(self, request: Request, now: float) -> None:
        """Raises StageError with a reason the client can act on; returns if the request is admissible."""
        if request.reply_to not in self._replies:
            raise Undeliverable("reply_to is not a configured reply topic")
        limits = self._limits
        if (request.prompt is None) == (not request.messages):
            raise StageError(ErrorCode.invalid_request, "exactly one of `messages` and `prompt` must be given")
        if len(request.messages) > limits.max_messages:
            raise StageError(ErrorCode.invalid_request, f"at most {limits.max_messages} messages are allowed")
        size = sum(len(m.content.encode()) for m in request.messages) + len((request.prompt or "").encode())
        if size > limits.max_prompt_bytes:
            raise StageError(ErrorCode.invalid_request, f"prompt is {size} bytes; the limit is {limits.max_prompt_bytes}")
        if request.sampling.max_tokens > limits.max_tokens_cap:
            raise StageError(ErrorCode.invalid_request, f"max_tokens may be at most {limits.max_tokens_cap}")
        if request.model not in self._models:
            raise StageError(ErrorCode.not_found, f"unknown model; available: {', '.join(sorted(self._models))}")
        if now > request.created_at + request.deadline_s:
            raise StageError(ErrorCode.deadline_exceeded, "the request's deadline passed before it was admitted")

    async def handle(self, message: Request) -> AsyncIterator[Out]:
        clock = Stopwatch()
        now = time.time()
        self.check(message, now)
        envelope = Envelope(request=message, principal=message.tenant, admitted_at=now, timings={self.name: clock.ms()})
        yield Out(registry.ADMITTED, message.id, envelope)
