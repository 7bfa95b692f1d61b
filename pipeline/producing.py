"""The runner's producer, renewed when it can no longer deliver.

aiokafka's idempotent producer cannot recover from a broker outage longer than `request_timeout_ms`:
its batches expired, its sequence numbers moved on, and from then on the broker refuses every batch
with `OutOfOrderSequenceNumber` (or the sender stops for good and sends wait forever). Seen in the chaos
suite: every stage looping on that error minutes after the broker was back. `Producer` watches every
send's outcome and, once a batch failed at all (aiokafka numbers a batch as it leaves the accumulator,
even to fail it for want of a leader after the 30 s, so the broker would refuse the next one), or the
sender has stopped, replaces the client with a fresh one (a new producer id) before the next send, so a stage
recovers from an outage of any length. The old client stops in the background: aiokafka's stop waits for
its pending batches to be delivered or to expire (30 s), and the send that renewed it waited that long.
The messages that were in flight are retried by the runner (their offsets were never committed).
A stopped `Producer` is not renewed: a send after `stop()` raises `ProducerClosed` (not retriable), where
it started a client that nobody would stop (an SDK stream's late cancellation did).

Records of the `lingering` topics (the stages' processes pass `registry.LINGERING`: records no request
waits for) go through a second `Producer` that waits `kafka.lingering_ms` to batch them, so a usage
record is not a produce request of its own. Their stage still waits for the acknowledgement before its
offset is committed; no answer waits for them.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    InvalidProducerEpoch,
    KafkaError,
    OutOfOrderSequenceNumber,
    ProducerClosed,
    UnknownProducerId,
)

from pipeline import kafka, metrics
from pipeline.settings import Settings

log = logging.getLogger(__name__)
POISONED = (OutOfOrderSequenceNumber, UnknownProducerId, InvalidProducerEpoch)  # this producer id is done


class Producer:
    def __init__(
        self, settings: Settings, client_id: str, *, lingering: frozenset[str] = frozenset(), linger_ms: int | None = None,
    ) -> None:
        self._settings = settings
        self._client_id = client_id
        self._linger_ms = settings.kafka.linger_ms if linger_ms is None else linger_ms
        self._client: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()
        self._poisoned = False
        self._stopped = False  # stop() was called: a send raises ProducerClosed rather than start a client no one stops
        self.renewals = 0
        self._retiring: set[asyncio.Task[None]] = set()  # replaced clients, stopping
        self._lingering = lingering
        lingers = bool(lingering) and settings.kafka.lingering_ms > self._linger_ms
        self._batching = Producer(settings, f"{client_id}-lingering", linger_ms=settings.kafka.lingering_ms) if lingers else None

    def _new(self) -> AIOKafkaProducer:
        return kafka.producer(self._settings, self._client_id, self._linger_ms)

    async def start(self, stop: asyncio.Event) -> None:
        self._client = await kafka.started(self._new, stop, self._client_id)
        if self._batching is not None:
            try:
                await self._batching.start(stop)
            except BaseException:
                await self._client.stop()
                raise

    async def stop(self) -> None:
        self._stopped = True
        if self._batching is not None:
            await self._batching.stop()
        if self._client is not None:
            await self._client.stop()
        if self._retiring:
            await asyncio.gather(*self._retiring)

    async def send(
        self, topic: str, value: bytes, *, key: bytes, headers: list[tuple[str, bytes]], partition: int | None = None,
    ) -> asyncio.Future[Any]:
        """Queues one message (on the key's partition unless one is named); the returned future resolves
        when the broker acknowledged it."""
        if self._batching is not None and topic in self._lingering:
            return await self._batching.send(topic, value, key=key, headers=headers, partition=partition)
        client = await self._usable()
        ack = await client.send(topic, value, key=key, headers=headers, partition=partition)
        ack.add_done_callback(partial(self._watch, client))
        return ack

    async def send_together(
        self, topic: str, key: bytes, items: list[tuple[bytes, list[tuple[str, bytes]]]]
    ) -> asyncio.Future[Any] | None:
        """Queues several messages with one key as one record batch on the key's partition (the one `send`
        picks): the broker appends all of them or none, so a later one cannot overtake an earlier one that
        failed. None, with nothing queued, when they do not fit in one batch (`max_batch_size`)."""
        if self._batching is not None and topic in self._lingering:
            return await self._batching.send_together(topic, key, items)
        client = await self._usable()
        batch = client.create_batch()
        for value, headers in items:
            if batch.append(key=key, value=value, timestamp=None, headers=headers) is None:
                return None
        await client.client._wait_on_metadata(topic)  # as `send` does; aiokafka is pinned below 0.15
        partition = client._partition(topic, None, None, None, key, None)  # by the key alone, as `send` does
        ack = await client.send_batch(batch, topic, partition=partition)
        ack.add_done_callback(partial(self._watch, client))
        return ack

    async def send_and_wait(
        self, topic: str, value: bytes, *, key: bytes, headers: list[tuple[str, bytes]] | None = None, partition: int | None = None,
    ) -> None:
        """Sends one message and waits for the broker's acknowledgement."""
        await (await self.send(topic, value, key=key, headers=headers or [], partition=partition))

    def _watch(self, client: AIOKafkaProducer, ack: asyncio.Future[Any]) -> None:
        """Marks the client for renewal once a batch of it failed; an outcome of a client already
        replaced says nothing about the new one."""
        if client is self._client and not ack.cancelled() and isinstance(ack.exception(), KafkaError):
            self._poisoned = True

    async def _usable(self) -> AIOKafkaProducer:
        """The client to send with, renewed first if it can no longer deliver (a stopped one cannot either)."""
        if self._stopped:
            raise ProducerClosed(f"producer {self._client_id} was stopped")
        if self._unusable():
            await self._renew()
        assert self._client is not None
        return self._client

    def _unusable(self) -> bool:
        sender = getattr(self._client, "_sender", None)
        task = getattr(sender, "sender_task", None)
        return self._poisoned or (task is not None and task.done())

    async def _renew(self) -> None:
        async with self._lock:
            if self._stopped:
                raise ProducerClosed(f"producer {self._client_id} was stopped")
            if not self._unusable():
                return  # another task renewed it meanwhile
            old = self._client
            self.renewals += 1
            metrics.PRODUCER_RENEWALS.inc()
            log.warning("producer %s stopped delivering; starting a new one (renewal %d)", self._client_id, self.renewals)
            self._client = await kafka.started(self._new, asyncio.Event(), self._client_id)
            self._poisoned = False  # only now: a renewal cancelled half way leaves the old client marked
            if old is not None:
                # Stopping flushes: it waits until the old client's batches are delivered or expire
                # (`request_timeout_ms`, 30 s, in an outage). The send that renewed goes on meanwhile.
                retiring = asyncio.create_task(_retire(old))
                self._retiring.add(retiring)
                retiring.add_done_callback(self._retiring.discard)


async def _retire(client: AIOKafkaProducer) -> None:
    try:
        await client.stop()
    except Exception as exc:  # the dead client's own failure is not ours to handle
        log.info("stopping the old producer failed: %s", type(exc).__name__)
