"""The topics a stage hears besides its input, one task each (the runner starts those the stage has):
its control topic (cancellations, from now on), its table (a compacted topic, from its start) and the
reports it produces once a second. Each outlives the broker going away; a record that cannot be read
is dead-lettered through the stage's `Handling`.

A follower shares the event loop with the stage's own work, and an `on_table` need not suspend (the cache
stage's does not): so a fetch is bounded (`MAX_RECORDS`) and the loop is yielded every `YIELD_EVERY`
records applied. Otherwise replaying a table at start runs a whole fetch (about 1 MiB per partition) in one
loop step: over a second for four partitions of cache entries, past the Kafka session timeout at a dozen."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka.structs import ConsumerRecord

from pipeline import kafka
from pipeline.acks import quiet
from pipeline.handling import INFRA, MAX_BACKOFF_S, Handling
from topics import codec
from topics.control import Cancel

log = logging.getLogger(__name__)

MAX_RECORDS = 200  # records one fetch of a follower returns at most
YIELD_EVERY = 32  # records applied between two yields of the event loop


async def control_loop(handling: Handling, stop: asyncio.Event, client_id: str) -> None:
    """Every message on the stage's control topic, from now on, to its `on_control`; survives anything."""
    stage = handling.stage
    await _follow(handling, stop, client_id + "-control", stage.topics.control, Cancel, getattr(stage, "on_control"))


async def table_loop(handling: Handling, stop: asyncio.Event, client_id: str) -> None:
    """Every record of the stage's table (a compacted topic), from its start, to its `on_table`; after a
    lost connection the table is read again from its start (applying a record twice is harmless)."""
    stage = handling.stage
    topic = stage.topics.table
    assert topic is not None
    await _follow(handling, stop, client_id + "-table", topic, getattr(stage, "table_type"), getattr(stage, "on_table"),
                  from_start=True)


async def report_loop(handling: Handling, stop: asyncio.Event, every_s: float = 1.0) -> None:
    """What the stage reports (`Reporting.report`), produced once a second; a failed produce is dropped
    (the next report replaces it)."""
    report = getattr(handling.stage, "report")
    while not stop.is_set():
        try:
            async with asyncio.timeout(every_s):  # not wait_for: on 3.11 it can swallow a cancel
                await stop.wait()
        except TimeoutError:
            pass
        for out in report():
            try:
                (await handling.send(out)).add_done_callback(quiet)
            except INFRA as exc:
                log.debug("stage=%s report not sent (%s)", handling.stage.name, type(exc).__name__)


async def _follow(
    handling: Handling, stop: asyncio.Event, client_id: str, topic: str, kind: Any,
    apply: Callable[[Any], Awaitable[None]], *, from_start: bool = False,
) -> None:
    backoff = 0.5
    while not stop.is_set():
        try:
            consumer = await kafka.broadcast_consumer(handling.settings, (topic,), client_id, from_start=from_start)
        except (LookupError, *INFRA) as exc:
            log.warning("stage=%s %s unavailable (%s); retrying", handling.stage.name, topic, type(exc).__name__)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            continue
        try:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=100, max_records=MAX_RECORDS)
                applied = 0
                for records in batch.values():
                    for record in records:
                        await _apply(handling, record, kind, apply, from_start)
                        applied += 1
                        if applied % YIELD_EVERY == 0:
                            await asyncio.sleep(0)  # let the stage's own work run between records
        except INFRA as exc:
            log.warning("stage=%s consumer of %s failed (%s); reconnecting", handling.stage.name, topic, type(exc).__name__)
        finally:
            await consumer.stop()


async def _apply(
    handling: Handling, record: ConsumerRecord[bytes, bytes], kind: Any, apply: Callable[[Any], Awaitable[None]],
    table: bool,
) -> None:
    if record.value is None and table:
        return  # a compacted table's tombstone: its key was deleted
    try:
        message = codec.decode(record.value, kind)
    except Exception as exc:
        detail = str(exc) if isinstance(exc, codec.SchemaError) else type(exc).__name__
        await handling.dead_letter(record, "SchemaError", detail, None, None, None)
        return
    try:
        await apply(message)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.warning("stage=%s record of %s failed: %s", handling.stage.name, record.topic, type(exc).__name__)
