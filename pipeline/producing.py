"""The runner's producer, renewed when it can no longer deliver.

aiokafka's idempotent producer stops its sender for good on `OutOfOrderSequenceNumber`, which is what
a broker outage longer than `request_timeout_ms` leads to (batches expired, sequence numbers moved on):
every later send would wait forever. `Producer.send` checks the sender before each send and, when it
has stopped, replaces the client with a fresh one (a new producer id), so a stage recovers from an
outage of any length instead of looping on the error. The messages that were in flight are retried by
the runner (their offsets were never committed).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiokafka import AIOKafkaProducer

from pipeline import kafka
from pipeline.settings import Settings

log = logging.getLogger(__name__)


class Producer:
    def __init__(self, settings: Settings, client_id: str) -> None:
        self._settings = settings
        self._client_id = client_id
        self._client: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()
        self.renewals = 0

    async def start(self, stop: asyncio.Event) -> None:
        self._client = await kafka.started(lambda: kafka.producer(self._settings, self._client_id), stop, self._client_id)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.stop()

    async def send(self, topic: str, value: bytes, *, key: bytes, headers: list[tuple[str, bytes]]) -> asyncio.Future[Any]:
        """Queues one message; the returned future resolves when the broker acknowledged it."""
        if self._stopped_for_good():
            await self._renew()
        assert self._client is not None
        return await self._client.send(topic, value, key=key, headers=headers)

    def _stopped_for_good(self) -> bool:
        sender = getattr(self._client, "_sender", None)
        task = getattr(sender, "sender_task", None)
        return task is not None and task.done()

    async def _renew(self) -> None:
        async with self._lock:
            if not self._stopped_for_good():
                return  # another task renewed it meanwhile
            old = self._client
            self.renewals += 1
            log.warning("producer %s stopped delivering; starting a new one (renewal %d)", self._client_id, self.renewals)
            self._client = await kafka.started(lambda: kafka.producer(self._settings, self._client_id), asyncio.Event(), self._client_id)
            if old is not None:
                try:
                    await old.stop()
                except Exception as exc:  # the dead client's own failure is not ours to handle
                    log.info("stopping the old producer failed: %s", type(exc).__name__)
