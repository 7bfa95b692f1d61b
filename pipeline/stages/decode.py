"""decode: the generation phase. Streams numbered chunks until a stop token, a stop string or
`max_tokens`, then exactly one terminal event; stops within a step when `llm.control` cancels."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing

from pipeline.backends.base import Backend
from pipeline.backends.errors import BackendError, Cancelled
from pipeline.stage import Out, Stopwatch
from pipeline.stages.generation import digest, from_wire, generation_request
from topics import registry
from topics.control import Cancel, CancelReason
from topics.envelope import Envelope
from topics.errors import ErrorCode, retriable
from topics.stream import Chunk, Done, Failed, Usage

_REMEMBER_CANCELLED = 10_000
_CODE = {
    CancelReason.client_gone: ErrorCode.cancelled,
    CancelReason.output_guard: ErrorCode.content_filter,
    CancelReason.deadline: ErrorCode.deadline_exceeded,
}


class DecodeStage:
    name = "decode"
    input_topics = (registry.PREFILLED,)
    input_type = Envelope
    ordered = False
    control_topics = (registry.CONTROL,)
    control_type = Cancel

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        # Cancellations seen, kept a while: one may arrive before its request reaches decode.
        self._cancelled: OrderedDict[str, CancelReason] = OrderedDict()
        self._active: set[str] = set()

    async def on_control(self, message: Cancel) -> None:
        self._cancelled[message.id] = message.reason
        if len(self._cancelled) > _REMEMBER_CANCELLED:
            self._cancelled.popitem(last=False)
        if message.id in self._active:
            await self._backend.cancel(message.id)

    async def handle(self, message: Envelope) -> AsyncIterator[Out]:
        clock = Stopwatch()
        request, prefill = message.request, message.prefill
        assert prefill is not None, "decode reads only envelopes that prefill filled in"
        parts = [prefill.first_text]
        seq = 1 if prefill.first_text else 0
        completion = 1
        deadline = request.created_at + request.deadline_s
        error: tuple[ErrorCode, str] | None = None
        finish = "length"

        def failed(code: ErrorCode, text: str) -> Failed:
            return Failed(
                id=request.id, reply_to=request.reply_to, code=code, message=text, retriable=retriable(code),
                chunks=seq, usage=Usage(prefill.prompt_tokens, completion),
                timings={**message.timings, self.name: clock.ms()},
                tenant=request.tenant, model=request.model, created_at=request.created_at,
            )

        if request.id in self._cancelled:
            yield Out(registry.TOKENS, request.id, failed(_CODE[self._cancelled[request.id]], "cancelled before decode started"))
            return
        self._active.add(request.id)
        try:
            stream = self._backend.decode(generation_request(request), from_wire(prefill))
            async with aclosing(stream):
                async for delta in stream:
                    completion += len(delta.token_ids)
                    if delta.text:
                        parts.append(delta.text)
                        yield Out(registry.TOKENS, request.id, Chunk(id=request.id, reply_to=request.reply_to, seq=seq, text=delta.text))
                        seq += 1
                    if delta.finish_reason is not None:
                        finish = delta.finish_reason
                    elif time.time() > deadline:
                        error = (ErrorCode.deadline_exceeded, "the request's deadline passed during generation")
                        break
        except Cancelled:
            reason = self._cancelled.get(request.id, CancelReason.client_gone)
            error = (_CODE[reason], f"generation stopped: {reason.value}")
        except BackendError as exc:
            error = (exc.code, f"backend failed during decode ({type(exc).__name__})")
        finally:
            self._active.discard(request.id)
        if error is not None:
            yield Out(registry.TOKENS, request.id, failed(*error))
            return
        done = Done(
            id=request.id, reply_to=request.reply_to, chunks=seq, digest=digest(parts), finish_reason=finish,
            usage=Usage(prefill.prompt_tokens, completion), timings={**message.timings, self.name: clock.ms()},
            tenant=request.tenant, model=request.model, created_at=request.created_at,
        )
        yield Out(registry.TOKENS, request.id, done)
