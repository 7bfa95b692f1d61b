"""A follower shares the event loop with the stage: replaying a table whose `on_table` never suspends
yields the loop between records, so one large fetch does not stall everything else for a second or more."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord, TopicPartition

from pipeline import following, kafka
from topics import codec
from topics.cache import Purge, TableRecord

RECORDS = 1_500  # about one fetch of cache entries from four partitions (1 MiB each)
APPLY_S = 0.0005  # what applying one entry to the semantic index costs, without suspending


class Consumer:
    """Hands out the whole table in one fetch when asked for all of it, as aiokafka does without max_records."""

    def __init__(self, records: list[ConsumerRecord[bytes, bytes]]) -> None:
        self._records = records
        self.stopped = False

    async def getmany(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[TopicPartition, list[Any]]:
        if not self._records:
            await asyncio.sleep(timeout_ms / 1000)
            return {}
        n = len(self._records) if max_records is None else max_records
        batch, self._records = self._records[:n], self._records[n:]
        return {TopicPartition("llm.cache.entries", 0): batch}

    async def stop(self) -> None:
        self.stopped = True


def _record(offset: int) -> ConsumerRecord[bytes, bytes]:
    value = codec.encode(Purge(tenant=f"t{offset}", model=None, at=0.0))
    return ConsumerRecord("llm.cache.entries", 0, offset, 0, 0, None, value, None, 0, len(value), ())


@pytest.mark.asyncio
async def test_replaying_a_table_keeps_the_event_loop_turning(monkeypatch: pytest.MonkeyPatch) -> None:
    consumer = Consumer([_record(i) for i in range(RECORDS)])
    applied: list[TableRecord] = []
    stop = asyncio.Event()

    async def on_table(record: TableRecord) -> None:
        until = time.perf_counter() + APPLY_S
        while time.perf_counter() < until:  # CPU work that never suspends, like CacheStage.on_table
            pass
        applied.append(record)
        if len(applied) == RECORDS:
            stop.set()

    async def broadcast_consumer(*args: object, **kwargs: object) -> Consumer:
        return consumer

    monkeypatch.setattr(kafka, "broadcast_consumer", broadcast_consumer)
    stage = SimpleNamespace(name="cache", topics=SimpleNamespace(table="llm.cache.entries"), table_type=TableRecord,
                            on_table=on_table)
    handling: Any = SimpleNamespace(stage=stage, settings=None)

    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticks = asyncio.create_task(ticker())
    await asyncio.wait_for(following.table_loop(handling, stop, "test"), 10)
    await ticks
    assert len(applied) == RECORDS and consumer.stopped
    assert max(gaps) < 0.1, f"the event loop stalled {max(gaps):.2f} s while the table was replayed"
