"""emit: the only writer of reply topics. Forwards chunks in order without duplicates, writes exactly
one terminal event per request with the stage timings, and one usage record per finished request."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec

from pipeline.errors import Undeliverable
from pipeline.settings import Settings
from pipeline.stage import Out, Stopwatch
from topics import registry
from topics.stream import Chunk, Done, Failed, StreamEvent
from topics.usage import UsageRecord

_REMEMBER = 100_000  # requests whose progress emit keeps, oldest forgotten first


class Meter(Protocol):
    """Told of every terminal event once it is sent: charges tokens and spend (the gateway)."""

    async def finish(self, event: Done | Failed) -> None: ...

    async def aclose(self) -> None: ...


class EmitStage:
    name = "emit"
    input_topics = (registry.CHECKED,)  # what postguard released
    input_type = StreamEvent
    ordered = True  # chunks of one request must leave in the order they arrived
    terminal_topic = None  # the runner's own error events go straight to the reply topic

    def __init__(self, settings: Settings, meter: Meter | None = None) -> None:
        self._replies = settings.reply_topics
        self._meter = meter
        self._next_seq: OrderedDict[str, int] = OrderedDict()
        self._finished: OrderedDict[str, None] = OrderedDict()

    async def aclose(self) -> None:
        if self._meter is not None:
            await self._meter.aclose()

    async def handle(self, message: StreamEvent) -> AsyncIterator[Out]:
        clock = Stopwatch()
        if message.reply_to not in self._replies:
            raise Undeliverable("reply_to is not a configured reply topic")
        rid = message.id
        if rid in self._finished:
            return  # a redelivery after the terminal event: the client already has it
        if isinstance(message, Chunk):
            expected = self._next_seq.get(rid, 0)
            if message.seq < expected:
                return  # a redelivered chunk
            self._remember(self._next_seq, rid, message.seq + 1)
            yield Out(message.reply_to, rid, message)
            return
        counted = self._next_seq.pop(rid, 0)
        self._remember(self._finished, rid, None)
        now = time.time()
        total = round((now - message.created_at) * 1000.0, 3) if message.created_at else 0.0
        timings = {**message.timings, self.name: clock.ms(), "total": total}
        terminal = msgspec.structs.replace(message, chunks=max(message.chunks, counted), timings=timings)
        yield Out(message.reply_to, rid, terminal)
        outcome = "done" if isinstance(message, Done) else message.code.value
        usage = UsageRecord(
            id=rid, tenant=message.tenant, model=message.model, outcome=outcome,
            prompt_tokens=message.usage.prompt_tokens, completion_tokens=message.usage.completion_tokens,
            total_ms=total, timings=timings, at=now,
        )
        yield Out(registry.USAGE, message.tenant, usage)
        if self._meter is not None:
            await self._meter.finish(message)

    @staticmethod
    def _remember(table: OrderedDict[str, object], key: str, value: object) -> None:
        table[key] = value
        table.move_to_end(key)
        if len(table) > _REMEMBER:
            table.popitem(last=False)
