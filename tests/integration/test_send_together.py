"""`Producer.send_together` against the real broker: the messages land as one record batch on the
partition `send` picks for their key, in order, next to each other (pipeline/producing.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from pipeline import kafka
from pipeline.producing import Producer
from pipeline.settings import Settings

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_group_lands_whole_on_its_keys_partition_in_order(settings: Settings) -> None:
    topic = f"test.together.{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=6, replication_factor=1)])
    finally:
        await admin.close()
    consumer = await kafka.broadcast_consumer(settings, (topic,), "test-together")
    producer = Producer(settings, "test-together")
    await producer.start(asyncio.Event())
    keys = [f"default/{uuid.uuid4().hex}".encode() for _ in range(12)]
    try:
        for key in keys:
            alone = await (await producer.send(topic, b"alone", key=key, headers=[]))
            together = await producer.send_together(topic, key, [(b"one", []), (b"two", [("h", b"1")]), (b"three", [])])
            assert together is not None
            await together
            assert alone.partition is not None
        too_big = await producer.send_together(topic, keys[0], [(b"x" * 20_000, []), (b"y" * 20_000, [])])
        assert too_big is None  # over aiokafka's batch size: nothing queued, the caller sends one by one
        seen: dict[bytes, list[tuple[int, int, bytes]]] = defaultdict(list)
        while sum(len(v) for v in seen.values()) < 4 * len(keys):
            for tp, records in (await consumer.getmany(timeout_ms=5000)).items():
                for r in records:
                    assert r.key is not None and r.value is not None
                    seen[r.key].append((tp.partition, r.offset, r.value))
    finally:
        await producer.stop()
        await consumer.stop()
    for key in keys:
        got = seen[key]
        assert [value for _, _, value in got] == [b"alone", b"one", b"two", b"three"]
        assert len({partition for partition, _, _ in got}) == 1  # the partition `send` picked for the key
        offsets = [offset for _, offset, _ in got[1:]]
        assert offsets == list(range(offsets[0], offsets[0] + 3))  # next to each other: one batch
