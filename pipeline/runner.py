"""The one loop that owns Kafka for a stage: poll, decode, trace, handle, produce, commit.

Delivery is at least once: a message's offset is committed only after every message its handler
yielded is acknowledged by the broker (idempotent producer, acks=all). Work is bounded: at most
`max_in_flight` messages at once; past that the runner pauses its partitions and keeps polling so the
group does not evict it. A message that cannot be decoded, or whose handler fails, goes to `llm.dlq`
and its request (if one can be named) gets an error terminal event, so nothing ends silently.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import traceback
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord
from opentelemetry import trace

from pipeline import kafka, metrics, tracing
from pipeline.errors import RetriableError, StageError, Undeliverable
from pipeline.offsets import OffsetTracker
from pipeline.settings import Settings
from pipeline.stage import Address, Out, Stage, address_of
from topics import codec, registry
from topics.dlq import DeadLetter
from topics.errors import ErrorCode, retriable
from topics.stream import Failed, RateLimit

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
COMMIT_INTERVAL_S = 0.2


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, runner: Runner) -> None:
        self._runner = runner

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self._runner.commit()
        for tp in revoked:
            self._runner.trackers.pop(tp, None)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        for tp in assigned:
            self._runner.trackers.setdefault(tp, OffsetTracker())


class Runner:
    def __init__(self, stage: Stage, settings: Settings, *, instance: str = "0", grace_s: float = 10.0) -> None:
        self.stage = stage
        self.settings = settings
        self.client_id = f"sluice-{stage.name}-{instance}"
        self.max_in_flight = settings.runtime.max_in_flight
        self.grace_s = grace_s
        self.trackers: dict[TopicPartition, OffsetTracker] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Ordered stages: per partition, the future that resolves once the previous message's outputs
        # are handed to the producer (not acknowledged: the producer keeps a partition's order).
        self._handed_over: dict[TopicPartition, asyncio.Future[None]] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._last_commit = 0.0
        self._committing: asyncio.Task[None] | None = None
        self._fatal: Exception | None = None  # set when a message could be neither handled nor dead-lettered
        self.ready = asyncio.Event()  # set once the consumer has its partitions

    async def run(self, stop: asyncio.Event) -> None:
        self._producer = kafka.producer(self.settings, self.client_id)
        await self._producer.start()
        self._consumer = kafka.group_consumer(self.settings, self.stage.name, (), self.client_id)
        self._consumer.subscribe(list(self.stage.input_topics), listener=_Rebalance(self))
        await self._consumer.start()
        control = asyncio.create_task(self._control_loop(stop)) if hasattr(self.stage, "on_control") else None
        try:
            await self._poll_loop(stop)
        finally:
            await self._drain()
            if control is not None:
                control.cancel()
                await asyncio.gather(control, return_exceptions=True)
            await self._consumer.stop()
            await self._producer.stop()
            if (close := getattr(self.stage, "aclose", None)) is not None:
                await close()  # a stage's own connections (the gateway's Redis client)

    async def _poll_loop(self, stop: asyncio.Event) -> None:
        assert self._consumer is not None
        paused = False
        while not stop.is_set():
            if self._fatal is not None:  # unfinished offsets stay uncommitted: a successor redoes them
                raise self._fatal
            capacity = self.max_in_flight - len(self._tasks)
            if capacity <= 0 and not paused:
                self._consumer.pause(*self._consumer.assignment())
                paused = True
            elif capacity > 0 and paused:
                self._consumer.resume(*self._consumer.assignment())
                paused = False
            batch = await self._consumer.getmany(timeout_ms=50, max_records=max(capacity, 1))
            if self._consumer.assignment():
                self.ready.set()
            for tp, records in batch.items():
                tracker = self.trackers.setdefault(tp, OffsetTracker())
                for record in records:
                    tracker.start(record.offset)
                    self._spawn(tp, record)
            metrics.IN_FLIGHT.labels(self.stage.name).set(len(self._tasks))
            if time.monotonic() - self._last_commit >= COMMIT_INTERVAL_S and (self._committing is None or self._committing.done()):
                # In the background: a commit waits on the group coordinator (milliseconds), polling must not.
                self._last_commit = time.monotonic()
                self._committing = asyncio.create_task(self._commit_quietly())

    def _spawn(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes]) -> None:
        previous = handed_over = None
        if self.stage.ordered:
            previous = self._handed_over.get(tp)
            handed_over = self._handed_over[tp] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._process(tp, record, previous, handed_over))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _commit_quietly(self) -> None:
        """A periodic commit whose failure (a rebalance, a broker restart) costs only redelivery."""
        try:
            await self.commit()
        except KafkaError as exc:
            log.warning("stage=%s commit failed, will retry: %s", self.stage.name, type(exc).__name__)

    async def commit(self) -> None:
        """Commits, per partition, up to the oldest message still in flight."""
        if self._consumer is None:
            return
        offsets = {tp: off for tp, t in self.trackers.items() if (off := t.committable()) is not None}
        if not offsets:
            return
        await self._consumer.commit(offsets)
        for tp, off in offsets.items():
            if (tracker := self.trackers.get(tp)) is not None:  # None if revoked meanwhile
                tracker.mark_committed(off)

    async def _drain(self) -> None:
        """Graceful stop: let in-flight messages finish for `grace_s`, cancel the rest, commit what finished."""
        if self._committing is not None:
            await asyncio.gather(self._committing, return_exceptions=True)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=self.grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        try:
            await self.commit()
        except Exception as exc:  # the group may already be gone; uncommitted work is redelivered
            log.warning("stage=%s final commit failed: %s", self.stage.name, type(exc).__name__)

    async def _process(
        self,
        tp: TopicPartition,
        record: ConsumerRecord[bytes, bytes],
        previous: asyncio.Future[None] | None,
        handed_over: asyncio.Future[None] | None,
    ) -> None:
        if previous is not None:
            await asyncio.shield(previous)
        try:
            await self._process_now(tp, record, handed_over)
        except Exception as exc:  # could not even dead-letter (the broker refused): stop the stage
            log.error("stage=%s cannot produce, stopping: %s", self.stage.name, type(exc).__name__)
            self._fatal = self._fatal or exc
        finally:
            if handed_over is not None and not handed_over.done():
                handed_over.set_result(None)

    async def _process_now(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], handed_over: asyncio.Future[None] | None) -> None:
        started = time.perf_counter()
        ctx = tracing.extract(record.headers)
        with tracing.tracer.start_as_current_span(self.stage.name, context=ctx, kind=trace.SpanKind.CONSUMER) as span:
            span.set_attribute("messaging.destination", record.topic)
            span.set_attribute("messaging.kafka.offset", record.offset)
            span.set_attribute("payload.bytes", len(record.value or b""))
            outcome = await self._handle_record(record, span, handed_over)
            span.set_attribute("outcome", outcome)
        metrics.MESSAGES.labels(self.stage.name, outcome).inc()
        metrics.HANDLE_SECONDS.labels(self.stage.name).observe(time.perf_counter() - started)
        tracker = self.trackers.get(tp)
        if tracker is not None:  # None when the partition was revoked meanwhile: the next owner redoes it
            tracker.finish(record.offset)

    async def _handle_record(self, record: ConsumerRecord[bytes, bytes], span: trace.Span, handed_over: asyncio.Future[None] | None) -> str:
        payload = record.value or b""
        try:
            message = codec.decode(payload, self.stage.input_type)
        except codec.SchemaError as exc:
            rid, reply = codec.salvage_reply(payload)
            address = Address(rid, reply) if rid and reply else None
            await self._dead_letter(record, "SchemaError", str(exc)[:300], address, rid)
            return "invalid"
        address = address_of(message)
        if address is not None:
            span.set_attribute("request.id", address.request_id)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                await self._send_all(message, handed_over)
                return "ok"
            except RetriableError as exc:
                if attempt == MAX_ATTEMPTS:
                    await self._dead_letter(record, type(exc).__name__, exc.message, address, None)
                    return "dead_letter"
                await asyncio.sleep(0.1 * 2**attempt)
            except Undeliverable as exc:
                await self._dead_letter(record, "Undeliverable", str(exc), None, address and address.request_id)
                return "undeliverable"
            except StageError as exc:
                if address is not None:
                    await self._terminal(address, exc.code, exc.message, exc.retry_after_s, exc.rate_limit)
                return exc.code.value
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug or an unreadable message: dead-letter it, tell the client
                where = traceback.extract_tb(exc.__traceback__)[-1]
                detail = f"{type(exc).__name__} at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}"
                log.error("stage=%s request=%s failed: %s", self.stage.name, address and address.request_id, detail)
                await self._dead_letter(record, type(exc).__name__, detail, address, None)
                return "dead_letter"
        return "dead_letter"

    async def _send_all(self, message: Any, handed_over: asyncio.Future[None] | None) -> None:
        """Produces each output as soon as it is yielded (a stream reaches the client token by token),
        then waits for every acknowledgement. The next message of an ordered partition may start once
        this one's outputs are queued in the producer, before they are acknowledged."""
        acks = []
        async for out in self.stage.handle(message):
            acks.append(await self._send(out))
        if handed_over is not None and not handed_over.done():
            handed_over.set_result(None)
        await asyncio.gather(*acks)

    async def _send(self, out: Out) -> asyncio.Future[Any]:
        assert self._producer is not None
        metrics.PRODUCED.labels(self.stage.name, out.topic).inc()
        return await self._producer.send(out.topic, codec.encode(out.value), key=out.key.encode(), headers=tracing.inject())

    async def _terminal(
        self, address: Address, code: ErrorCode, message: str, retry_after_s: float | None = None,
        rate_limit: RateLimit | None = None,
    ) -> None:
        failed = Failed(
            id=address.request_id,
            reply_to=address.reply_to,
            code=code,
            message=message,
            retriable=retriable(code),
            retry_after_s=retry_after_s,
            rate_limit=rate_limit,
            tenant=address.tenant,
            model=address.model,
            created_at=address.created_at,
        )
        topic = getattr(self.stage, "terminal_topic", registry.TOKENS) or address.reply_to
        if topic != registry.TOKENS and topic not in self.settings.reply_topics:
            log.warning("stage=%s request=%s names an unconfigured reply topic", self.stage.name, address.request_id)
            return
        await (await self._send(Out(topic, address.request_id, failed)))

    async def _dead_letter(self, record: ConsumerRecord[bytes, bytes], error_type: str, error: str, address: Address | None, rid: str | None) -> None:
        payload = record.value or b""
        letter = DeadLetter(
            stage=self.stage.name,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            error_type=error_type,
            error=error,
            payload_bytes=len(payload),
            payload_sha256=hashlib.sha256(payload).hexdigest(),
            request_id=address.request_id if address else rid,
            at=time.time(),
        )
        key = letter.request_id or f"{record.topic}:{record.partition}:{record.offset}"
        await (await self._send(Out(registry.DLQ, key, letter)))
        log.warning("stage=%s dead-lettered %s:%d:%d (%s)", self.stage.name, record.topic, record.partition, record.offset, error_type)
        if address is not None:
            await self._terminal(address, ErrorCode.internal, f"the {self.stage.name} stage could not process this request ({error_type}); it is in the dead-letter topic")

    async def _control_loop(self, stop: asyncio.Event) -> None:
        topics = tuple(getattr(self.stage, "control_topics"))
        consumer = await kafka.broadcast_consumer(self.settings, topics, self.client_id + "-control")
        try:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=100)
                for records in batch.values():
                    for record in records:
                        try:
                            message = codec.decode(record.value or b"", getattr(self.stage, "control_type"))
                        except codec.SchemaError as exc:
                            await self._dead_letter(record, "SchemaError", str(exc)[:300], None, None)
                            continue
                        await getattr(self.stage, "on_control")(message)
        finally:
            await consumer.stop()
