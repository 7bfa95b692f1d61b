"""ingest: the front door. Validates a request against the operator's limits, asks the gateway who sent
it and whether it may (authentication, model, network rules, rate limits, budgets), and passes it on
under the authenticated tenant, without its credential.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from pipeline.errors import StageError, Undeliverable
from pipeline.gateway.build import memory_gateway
from pipeline.gateway.gateway import Gateway
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

    def __init__(self, settings: Settings, gateway: Gateway | None = None) -> None:
        """`gateway` holds the shared state (Redis in production); None: one in memory, for tests."""
        self._gateway = gateway or memory_gateway(settings)
        self._limits = settings.limits
        self._models = frozenset(settings.models)
        self._replies = settings.reply_topics

    async def aclose(self) -> None:
        await self._gateway.aclose()

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
        request, principal = await self._gateway.admit(message)
        envelope = Envelope(request=request, principal=principal.name, admitted_at=now, timings={self.name: clock.ms()})
        yield Out(registry.ADMITTED, message.id, envelope)
