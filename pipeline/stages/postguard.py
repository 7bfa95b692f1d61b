"""postguard: checks the answer as it streams, holding back only the newest `holdback_tokens` chunks,
so nothing flagged reaches the client. Output PII is redacted by policy (pattern recognisers; `block`
entities end the stream); toxicity and the regex blocklist end it. Ending a stream is the kill
switch: postguard releases the text before the flagged span, publishes `Cancel(output_guard)` on
`llm.control` (decode stops within a step), drops any chunk still arriving, and turns decode's
terminal event into a `content_filter` error carrying decode's usage and timings.

Chunks are renumbered (redaction and cuts change them), and the terminal event carries the count and
digest of what was released. State is per request, in memory: a successor that meets a stream midway
(its predecessor died holding chunks back) cannot know what was lost, so it ends that request with a
retriable `internal` error rather than a stream with a hole.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import msgspec

from pipeline.guard.config import GuardSettings
from pipeline.guard.errors import Reason
from pipeline.guard.stream_check import OutputGuard, StreamState
from pipeline.stage import Out
from topics import registry
from topics.control import Cancel, CancelReason
from topics.errors import ErrorCode, retriable
from topics.stream import Chunk, Done, Failed, StreamEvent

_REMEMBER = 100_000  # finished requests kept to drop late events, oldest forgotten first


@dataclass
class _Stream:
    check: StreamState
    next_in: int = 0  # the input chunk expected next
    next_out: int = 0  # the seq of the next released chunk
    digest: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    spent_s: float = 0.0  # time spent in this stage on the request, over all its chunks
    killed: Reason | None = None  # set when the kill switch fired; decode's terminal event is awaited


class PostguardStage:
    name = "postguard"
    input_topics = (registry.TOKENS,)
    input_type = StreamEvent
    ordered = True  # a request's chunks are checked in order

    def __init__(self, settings: GuardSettings, guard: OutputGuard) -> None:
        self._settings = settings
        self._guard = guard
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        self._finished: OrderedDict[str, None] = OrderedDict()

    async def handle(self, message: StreamEvent) -> AsyncIterator[Out]:
        started = time.perf_counter()
        if message.id in self._finished:
            return  # decode's own ending after the kill switch, or a redelivery
        outs = list(self._handle(message, started))
        for out in outs:
            yield out

    def _handle(self, message: StreamEvent, started: float) -> Iterator[Out]:
        rid = message.id
        stream = self._streams.get(rid)
        if stream is None:
            if isinstance(message, Chunk) and message.seq > 0:
                self._finish(rid)
                text = "the output guard lost this stream's state (a worker restarted); retry the request"
                yield Out(registry.CHECKED, rid, Failed(id=rid, reply_to=message.reply_to, code=ErrorCode.internal, message=text, retriable=True))
                return
            stream = self._streams[rid] = _Stream(StreamState(self._settings.policy("default")))
            if len(self._streams) > _REMEMBER:
                self._streams.popitem(last=False)
        if stream.killed is not None:  # after the kill switch: drop chunks, turn decode's ending into ours
            if not isinstance(message, Chunk):
                yield Out(registry.CHECKED, rid, self._ended(message, stream, stream.killed, started))
            return
        if isinstance(message, Chunk):
            if message.seq < stream.next_in:
                return  # a redelivered chunk
            stream.next_in = message.seq + 1
            step = self._guard.push(stream.check, message.text)
        else:
            step = self._guard.finish(stream.check)
        if step.release:
            stream.digest.update(step.release.encode())
            yield Out(registry.CHECKED, rid, Chunk(id=rid, reply_to=message.reply_to, seq=stream.next_out, text=step.release))
            stream.next_out += 1
        if step.violation is not None and isinstance(message, Chunk):
            # The kill switch: decode stops within a step and sends its terminal event, which becomes
            # the content_filter error (with decode's usage and timings) when it arrives here.
            stream.killed = step.violation
            stream.spent_s += time.perf_counter() - started
            yield Out(registry.CONTROL, rid, Cancel(id=rid, reason=CancelReason.output_guard, at=time.time()))
        elif not isinstance(message, Chunk):
            yield Out(registry.CHECKED, rid, self._ended(message, stream, step.violation, started))
        else:
            stream.spent_s += time.perf_counter() - started

    def _ended(self, message: Done | Failed, stream: _Stream, violation: Reason | None, started: float) -> Done | Failed:
        """The request's one terminal event, with what this stage released and the time it spent."""
        self._finish(message.id)
        ms = round((stream.spent_s + time.perf_counter() - started) * 1000.0, 3)
        timings = {**message.timings, self.name: ms}
        if violation is not None:
            code = ErrorCode.content_filter
            return Failed(
                id=message.id, reply_to=message.reply_to, code=code, message=f"{violation}: the output guard stopped this answer",
                retriable=retriable(code), chunks=stream.next_out, usage=message.usage, timings=timings,
                tenant=message.tenant, model=message.model, created_at=message.created_at,
            )
        if isinstance(message, Done):
            return msgspec.structs.replace(message, chunks=stream.next_out, digest=stream.digest.hexdigest(), timings=timings)
        return msgspec.structs.replace(message, chunks=stream.next_out, timings=timings)

    def _finish(self, rid: str) -> None:
        self._streams.pop(rid, None)
        self._finished[rid] = None
        if len(self._finished) > _REMEMBER:
            self._finished.popitem(last=False)
