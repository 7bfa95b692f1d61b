"""An error ending larger than the broker accepts is no outage: the runner sends a bare one at once. It
retried the send for ever, holding the partition (ingest's, or an ordered stage's for every tenant): a
refusal copies the request's model, and a request just under the broker's limit with a ~1 MB model made
a refusal over it (topics.requests bounds the model now; this is the runner's side)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiokafka.errors import MessageSizeTooLargeError

from pipeline.handling import Handling
from pipeline.stages.ingest import IngestStage
from tests.unit.fakes import HeldAcks, record_of
from tests.unit.helpers import SETTINGS, node, request
from topics import codec, registry
from topics.errors import ErrorCode
from topics.stream import Failed, StreamEvent

LIMIT = 600  # bytes this fake broker takes in one record


class SmallBroker(HeldAcks):
    async def send(self, topic: str, value: bytes, *, key: bytes, headers: list[tuple[str, bytes]]) -> asyncio.Future[Any]:
        if len(value) > LIMIT:
            raise MessageSizeTooLargeError(f"{len(value)} bytes")
        return await super().send(topic, value, key=key, headers=headers)


@pytest.mark.asyncio
async def test_an_ending_over_the_brokers_limit_is_sent_bare_at_once() -> None:
    producer = SmallBroker()
    run = Handling(IngestStage(SETTINGS, node("ingest").topics), SETTINGS, producer)  # type: ignore[arg-type]
    unknown = request("big", model="m" * 250, created_at=time.time())  # refused: no such model, copied into the ending
    task = asyncio.create_task(run.process(record_of(unknown, registry.REQUESTS), None))
    for _ in range(200):
        producer.release()
        if task.done():
            break
        await asyncio.sleep(0.01)
    assert task.done(), "the runner is still retrying a record the broker can never take"
    [(_, [value])] = producer.calls
    ending = codec.decode(value, StreamEvent)
    assert isinstance(ending, Failed) and ending.id == "big" and ending.model == ""
    assert ending.code is ErrorCode.not_found
