"""prefill: the context phase. Computes the prompt, sends the first token at once (time to first
token), and hands decode the KV state by handle."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from pipeline.backends.base import Backend
from pipeline.backends.errors import BackendError
from pipeline.errors import StageError
from pipeline.stage import Out, Stopwatch
from pipeline.stages.generation import digest, generation_request, to_wire
from topics import registry
from topics.envelope import Envelope
from topics.errors import ErrorCode
from topics.stream import Chunk, Done, Usage


class PrefillStage:
    name = "prefill"
    input_type = Envelope
    ordered = False

    def __init__(self, backend: Backend, pool: str, worker: str = "0") -> None:
        self._backend = backend
        self._worker = worker
        self.input_topics = (registry.routed_topic(pool),)

    async def handle(self, message: Envelope) -> AsyncIterator[Out]:
        clock = Stopwatch()
        request = message.request
        try:
            prefilled = await self._backend.prefill(generation_request(request))
        except BackendError as exc:
            raise StageError(exc.code, f"prefill failed: {exc}" if exc.code is ErrorCode.invalid_request else f"backend failed during prefill ({type(exc).__name__})") from exc
        if prefilled.first_text:
            yield Out(registry.TOKENS, request.id, Chunk(id=request.id, reply_to=request.reply_to, seq=0, text=prefilled.first_text))
        timings = {**message.timings, self.name: clock.ms()}
        if prefilled.finish_reason is not None:  # the first token already ended it
            done = Done(
                id=request.id,
                reply_to=request.reply_to,
                chunks=1 if prefilled.first_text else 0,
                digest=digest([prefilled.first_text]),
                finish_reason=prefilled.finish_reason,
                usage=Usage(prompt_tokens=prefilled.prompt_tokens, completion_tokens=1),
                timings=timings,
                tenant=request.tenant,
                model=request.model,
                created_at=request.created_at,
            )
            yield Out(registry.TOKENS, request.id, done)
            return
        forward = msgspec.structs.replace(message, prefill=to_wire(prefilled, self._worker), timings=timings)
        yield Out(registry.PREFILLED, request.id, forward)
