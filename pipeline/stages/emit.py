"""emit: the only writer of reply topics. Forwards each chunk once and in order (held back behind a
gap until it fills), writes exactly one terminal event per request with the stage timings, and one
usage record per finished request.

What it already sent survives it: after the broker acknowledges a chunk, the next expected seq and the
digest chain are recorded in the state store; the terminal event marks the request finished. A
successor (a crash, a rebalance) takes ownership of the request's emit record the first time it meets
it and reads them, so it neither repeats a chunk nor a terminal event beyond the ones in flight at the
crash (which the SDK drops by seq). A worker that finds its record taken (it was paused past its
session and replaced) stops forwarding that request and lets the runner try the message again: the
worker that owns the partition then takes the record back and goes on from what it says. The usage record is claimed in the store before
it is produced, so billing sees it at most once.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import msgspec

from pipeline.errors import InfraUnavailable, Undeliverable
from pipeline.sequencing import Sequencer
from pipeline.settings import Settings
from pipeline.stage import Out, Stopwatch, address_of
from pipeline.state import MemoryStateStore, StateStore
from pipeline.topology import Topics
from topics.errors import ErrorCode
from topics.stream import EMPTY_DIGEST, Chunk, Done, Failed, StreamEvent, digest_step
from topics.usage import UsageRecord

_CACHED = 50_000  # requests whose progress this worker keeps in memory (the store has all of them)


class Meter(Protocol):
    """Told of every terminal event once it is sent: charges tokens and spend (the gateway)."""

    async def finish(self, event: Done | Failed) -> None: ...

    async def aclose(self) -> None: ...


class _Sent:
    """What the client has of one request: in-order position, digest chain, whether it has ended."""

    __slots__ = ("order", "digest", "finished", "fenced")

    def __init__(self, next_seq: int, digest: str, finished: bool) -> None:
        self.order = Sequencer(next_seq)
        self.digest = digest
        self.finished = finished
        self.fenced = False  # another emit worker took this request over


class EmitStage:
    input_type = StreamEvent
    ordered = True  # chunks of one request must leave in the order they arrived

    def __init__(
        self, settings: Settings, topics: Topics, store: StateStore | None = None, meter: Meter | None = None,
        name: str = "emit",
    ) -> None:
        self.name, self.topics = name, topics
        self._replies = settings.reply_topics
        self._store = store if store is not None else MemoryStateStore()
        self._meter = meter
        self._sent: OrderedDict[str, _Sent] = OrderedDict()
        self._carried: dict[str, list[Chunk]] = {}  # chunks held behind a gap when a request was reset
        self._owner = f"{name}:{uuid.uuid4().hex[:12]}"

    async def aclose(self) -> None:
        if self._meter is not None:
            await self._meter.aclose()
        await self._store.aclose()

    async def reset(self, request_id: str | None) -> None:
        """Forget cached progress (one request, or all): the store, written after acks, is the truth."""
        if request_id is None:
            self._sent.clear()
            self._carried.clear()
        elif (sent := self._sent.pop(request_id, None)) is not None and (held := sent.order.held()):
            self._carried[request_id] = held  # their messages may be done: keep them, they are the client's

    async def handle(self, message: StreamEvent) -> AsyncIterator[Out]:
        clock = Stopwatch()
        if message.reply_to not in self._replies:
            raise Undeliverable("reply_to is not a configured reply topic")
        rid = message.id
        sent = await self._progress(rid)
        if sent.finished or sent.fenced:
            return  # a redelivery after the terminal event (the client has it), or another worker's request
        ready = [c for held in self._carried.pop(rid, []) for c in sent.order.accept(held)]
        if isinstance(message, Chunk):
            ready += sent.order.accept(message)
        for chunk in ready:
            sent.digest = digest_step(sent.digest, chunk.text)
            record = {"emitted": b"%d" % (chunk.seq + 1), "digest": sent.digest.encode()}
            yield Out(message.reply_to, rid, chunk, acked=self._write(rid, sent, record))
        if isinstance(message, Chunk):
            return
        if not await self._store.write(_key(rid), {}, owner=self._owner):  # still ours? (a paused worker's is not)
            sent.fenced = True
            raise InfraUnavailable("taken over by another emit worker")
        sent.finished = True
        terminal = self._terminal(message, sent, clock)
        yield Out(message.reply_to, rid, terminal, acked=self._write(rid, sent, {"terminal": b"1"}))
        if await self._store.claim(rid, "usage", b"1"):
            yield Out(self.topics.usage, terminal.tenant or "anonymous", self._usage(terminal))
        if self._meter is not None:
            await self._meter.finish(terminal)

    async def _progress(self, rid: str) -> _Sent:
        sent = self._sent.get(rid)
        if sent is None:
            fields = await self._store.take(_key(rid), self._owner)
            digest = fields.get("digest", EMPTY_DIGEST.encode()).decode()
            sent = self._sent[rid] = _Sent(int(fields.get("emitted", b"0")), digest, "terminal" in fields)
            if len(self._sent) > _CACHED:
                self._sent.popitem(last=False)
        self._sent.move_to_end(rid)
        return sent

    def _terminal(self, message: Done | Failed, sent: _Sent, clock: Stopwatch) -> Done | Failed:
        """The event the client gets: the chunk count and digest of what it received, or, when chunks
        are missing (a gap, or fewer than the stream claims), `stream_incomplete`."""
        now = time.time()
        total = round((now - message.created_at) * 1000.0, 3) if message.created_at else 0.0
        timings = {**message.timings, self.name: clock.ms(), "total": total}
        received = sent.order.next_seq
        if sent.order.gap() or message.chunks > received:
            address = address_of(message)
            assert address is not None
            text = f"chunks {received}..{message.chunks - 1} of this answer were lost; retry the request"
            return address.failed(ErrorCode.stream_incomplete, text, chunks=received, usage=message.usage, timings=timings)
        if isinstance(message, Done):
            return msgspec.structs.replace(message, chunks=received, digest=sent.digest, timings=timings)
        return msgspec.structs.replace(message, chunks=received, timings=timings)

    def _usage(self, message: Done | Failed) -> UsageRecord:
        outcome = "done" if isinstance(message, Done) else message.code.value
        now = time.time()
        total = round((now - message.created_at) * 1000.0, 3) if message.created_at else 0.0
        return UsageRecord(
            id=message.id, tenant=message.tenant, model=message.model, outcome=outcome,
            prompt_tokens=message.usage.prompt_tokens, completion_tokens=message.usage.completion_tokens,
            total_ms=total, timings=message.timings, at=now,
        )

    def _write(self, rid: str, sent: _Sent, fields: dict[str, bytes]) -> Callable[[], Awaitable[None]]:
        async def acked() -> None:
            if not await self._store.write(_key(rid), fields, owner=self._owner):
                sent.fenced = True  # the runner tries the message again, after `reset`: re-read the store
                raise InfraUnavailable("taken over by another emit worker")

        return acked


def _key(rid: str) -> str:
    """emit's record of a request: its own key, so its ownership is independent of decode's."""
    return rid + "#emit"
