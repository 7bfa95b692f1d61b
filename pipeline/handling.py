"""What happens to one record: decode, trace, handle, produce, and every way that can go wrong.

    the payload cannot be read        -> llm.dlq (bounded), and an error terminal event if it names a
                                         request (invalid_request on llm.requests, internal elsewhere)
    the handler refuses (StageError)  -> the request's terminal event with the error's code (and its tenant, if set)
    RetriableError                    -> tried MAX_ATTEMPTS times, then dead-lettered
    Undeliverable                     -> llm.dlq, no terminal event (there is nowhere safe to send it)
    the broker or Redis is away       -> the whole message again with backoff until its deadline, then
                                         deadline_exceeded; never dead-lettered as if it were a bug (the
                                         backoff ends early once another message gets through: `Backoff`)
    an output too big for the broker  -> llm.dlq and an `internal` terminal event: no retry can cure it,
                                         and retrying would hold the partition until the deadline
    anything else (a bug)             -> llm.dlq and an `internal` terminal event

A record's fate is decided here and nothing escapes but cancellation, so no record stops a stage.
The topics a stage hears besides its input (control, table, reports) are followed in `pipeline.following`.

A terminal event built here for a request not yet authenticated (a `Request`, or a record whose id was
salvaged) is under the client's bare id, and names the record it refuses (`Failed.nonce`): emit keeps one
ending per refused record, not per id (`stage.state_id`). Where the stage is emit (`stage.Ending`), a
terminal event sent here straight to the reply topic is told to it (`note_ended`), so it sends no other;
and none is sent here once it has put the request's own on the reply topic (`has_ended`): a bug met after
that (emit stores the answer in the cache after its `Done`) is dead-lettered without a second, contradictory
ending. So that emit knows, a handler that fails after a terminal event went out (not for an outage) waits
for that event's acknowledgement first (`_send_all`).

Handover (`runtime.handover`, on by default): an output for the input topic of a request-part stage
(guard, cache, route: no per-request state in memory, no order to keep) that runs in the same process
is not produced; that stage's handling takes it in hand at once (`Handling.take`), with the same
errors, retries, span and metrics. The topic stays the contract (anything produced to it is still
consumed); only the broker round trip is saved. The sender's record is committed after the whole
chain has sent its outputs, so a crash redoes the chain from the sender's record (every stage of the
request part is idempotent under redelivery already, as at-least-once delivery requires). A generate
stage takes what route sends it, and emit what the cache and a generate stage send it, the same way
(`topology.HANDOVER_FROM`); emit takes a run of messages held for one another at once (`take_group`),
so they still reach the reply topic as one record batch. And emit hands a reply to the bridge of its
process (`Handling.replies`, the bridge's SDK client) when one of the bridge's streams waits for it: the
bridge is that reply's only reader, so the reply topic's crossing is saved as well.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordListTooLargeError
from aiokafka.structs import ConsumerRecord
from opentelemetry import trace

from pipeline import metrics, tracing
from pipeline.acks import acknowledged, after, all_of, on_delivery, quiet, waits
from pipeline.backoff import Backoff
from pipeline.errors import InfraUnavailable, RetriableError, StageError, Undeliverable
from pipeline.handover import Handed, LocalReplies, takes_groups
from pipeline.producing import Producer
from pipeline.settings import Settings
from pipeline.stage import Address, Ending, Out, Resettable, Stage, address_of
from topics import codec, dlq, registry
from topics.errors import ErrorCode
from topics.requests import Request
from topics.stream import Done, Failed

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
INFRA = (KafkaError, InfraUnavailable, ConnectionError, TimeoutError)
TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError)  # KafkaErrors that one message causes, not an outage
FIRST_BACKOFF_S = 0.1  # before a message is tried again after the infrastructure failed it; doubled each time
MAX_BACKOFF_S = 5.0


class Handling:
    def __init__(self, stage: Stage, settings: Settings, producer: Producer) -> None:
        self.stage = stage
        self.settings = settings
        self._producer = producer
        self._reads_requests = registry.REQUESTS in stage.topics.inputs
        # topic -> the handling of a stage in this process that takes its messages in hand instead of
        # the broker carrying them (`runtime.handover`; set by pipeline.serve): no produce, no consume
        self.takers: Mapping[str, Handling] = {}
        # How many messages handed over one by one (`take`) this stage works on at once (None: no bound; set
        # by pipeline.serve for generate, whose work lasts a whole stream); past it they go to the topic.
        self.take_limit: int | None = None
        self._taking = 0
        # The SDK client of this process's bridge, for emit (set by pipeline.serve with `runtime.handover`):
        # a reply one of its streams waits for is delivered to it in memory instead of produced.
        self.replies: LocalReplies | None = None
        self._backoff = Backoff()

    async def process(
        self, record: ConsumerRecord[bytes, bytes], handed_over: asyncio.Future[None] | None,
        before: asyncio.Task[None] | None = None,
    ) -> str:
        """Handles one record to its end; returns the outcome (a metric label). `before`, for ordered
        stages: the previous message's task, which a retry of this one waits for."""
        with tracing.consume_span(record, self.stage.name) as span:
            outcome = await self._handle_record(record, span, handed_over, before)
            span.set_attribute("outcome", outcome)
        return outcome

    async def _handle_record(
        self, record: ConsumerRecord[bytes, bytes], span: trace.Span, handed_over: asyncio.Future[None] | None,
        before: asyncio.Task[None] | None,
    ) -> str:
        payload = record.value or b""
        try:
            message = codec.decode(payload, self.stage.input_type)
        except Exception as exc:  # SchemaError, or anything a hostile payload provokes
            rid, reply = codec.salvage_reply(payload)  # a client's id: a hop's is read from its request
            # The refused record names the refusal only where it is the client's request (llm.requests): a
            # hop re-produced upstream sits at a new offset, and would get a second ending under a new nonce.
            nonce = _nonce(record) if self._reads_requests else None
            address = Address(rid, reply, nonce=nonce) if rid and reply else None
            code = ErrorCode.invalid_request if self._reads_requests else ErrorCode.internal
            detail = str(exc) if isinstance(exc, codec.SchemaError) else type(exc).__name__
            await self.dead_letter(record, "SchemaError", detail, address, rid, code)
            return "invalid"
        return await self._handle_message(message, record, span, handed_over, before)

    async def process_group(
        self, records: list[ConsumerRecord[bytes, bytes]], handed_over: asyncio.Future[None] | None,
        before: asyncio.Task[None] | None,
    ) -> list[str]:
        """Consecutive records of one key for an ordered stage that takes them together and can forget
        what it cached (emit): a request's last chunk and its ending, which the stage before sent as one
        batch, or a cache hit's replay. The outputs of all but the last record are held and go with the
        last one's first outputs (`_send_all`; their trace context is the last record's span), as one
        record batch when they fit, where one by one each produce request would wait for the one before
        (aiokafka sends one at a time per broker): about 0.6 ms more before the terminal event. Nothing
        of the group counts as done until all of it is acknowledged. If anything goes differently (a
        payload that cannot be read, any exception), the stage forgets what it cached of the request and
        the records are handled one by one, as without grouping: the store, written after
        acknowledgements, says what must be sent again. Returns each record's outcome."""
        try:
            messages = [codec.decode(record.value or b"", self.stage.input_type) for record in records]
        except Exception:  # the record that cannot be read is dead-lettered by the one-by-one path
            return await self._one_by_one(records, handed_over, before)
        spans = [functools.partial(tracing.consume_span, record, self.stage.name) for record in records]
        if await self._together(messages, spans, handed_over):
            self._backoff.through()
            return ["ok"] * len(records)
        return await self._one_by_one(records, handed_over, before)

    async def _together(
        self, messages: list[Any], spans: list[Callable[[], AbstractContextManager[trace.Span]]],
        handed_over: asyncio.Future[None] | None,
    ) -> bool:
        """`process_group`'s and `take_group`'s common part: False when the messages must be handled one by
        one instead (the stage has forgotten what it cached of the request by then)."""
        earlier: list[Out] = []
        try:
            for message, span_of in zip(messages[:-1], spans[:-1], strict=True):
                with span_of() as span:
                    earlier += [out async for out in self.stage.handle(message)]
                    span.set_attribute("outcome", "ok")
            with spans[-1]() as span:
                await self._send_all(messages[-1], handed_over, earlier)
                span.set_attribute("outcome", "ok")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            address = address_of(messages[0])
            log.info("stage=%s request=%s handled again message by message (%s: %s)", self.stage.name,
                     address and address.request_id, type(exc).__name__, _reason(exc))
            for message in _one_per_state(messages):  # a group shares a key: refusals under one bare id are
                await self._forget(message)  # each kept apart (`state_id`), and each must be tried afresh
            if isinstance(exc, INFRA):  # as the one-by-one path waits before it tries a message again
                await asyncio.sleep(FIRST_BACKOFF_S)
            return False
        return True

    async def _one_by_one(
        self, records: list[ConsumerRecord[bytes, bytes]], handed_over: asyncio.Future[None] | None,
        before: asyncio.Task[None] | None,
    ) -> list[str]:
        return [await self.process(record, handed_over if record is records[-1] else None, before) for record in records]

    async def take(self, out: Out) -> asyncio.Future[Any]:
        """A message another stage of this process hands over instead of producing it (`runtime.handover`),
        handled here and now as if this stage had consumed it: the same span (a child of the sender's),
        errors, retries and terminal events. Returns an acknowledgement that is already done: the sender
        commits its own record only after this returns, so a crash meanwhile redoes both stages."""
        started = time.perf_counter()
        self._taking += 1
        try:
            with tracing.handover_span(out.topic, self.stage.name) as span:
                outcome = await self._handle_message(out.value, Handed(out), span, None, None)
                span.set_attribute("outcome", outcome)
        except asyncio.CancelledError:
            await self._forget(out.value)
            raise
        except Exception:  # a bug in sluice itself, not in the message (as the runner says of a record)
            log.exception("stage=%s message handed over on %s could not be processed", self.stage.name, out.topic)
            outcome = "bug"
        finally:
            self._taking -= 1
        metrics.MESSAGES.labels(self.stage.name, outcome).inc()
        metrics.HANDLE_SECONDS.labels(self.stage.name).observe(time.perf_counter() - started)
        return acknowledged()

    async def take_group(self, outs: list[Out]) -> asyncio.Future[Any]:
        """Consecutive messages of one request handed over together (to emit: a hit's replay, an
        answer's last chunk and its ending): handled as `process_group` handles a group of records, so
        their outputs leave as one record batch; if anything goes differently, one by one through
        `take`. Returns an acknowledgement that is already done."""
        started = time.perf_counter()
        spans = [functools.partial(tracing.handover_span, out.topic, self.stage.name) for out in outs]
        try:
            together = await self._together([out.value for out in outs], spans, None)
        except asyncio.CancelledError:
            await self._forget(outs[0].value)
            raise
        if not together:
            for out in outs:
                await self.take(out)
            return acknowledged()
        metrics.MESSAGES.labels(self.stage.name, "ok").inc(len(outs))
        metrics.HANDLE_SECONDS.labels(self.stage.name).observe(time.perf_counter() - started)
        return acknowledged()

    def _taker(self, topic: str) -> Handling | None:
        """The stage of this process that takes `topic`'s messages in hand, unless it is at its bound."""
        taker = self.takers.get(topic)
        if taker is not None and taker.take_limit is not None and taker._taking >= taker.take_limit:
            return None
        return taker

    async def _forget(self, message: Any) -> None:
        """A stage that keeps state (emit) forgets what it cached of the message's request: before a group
        is handled again message by message, and when a handover is cancelled midway (the sender's
        partition was taken away: emit's own partitions were not revoked, so the runner would not reset
        it, and the sender's record is handled again, here or elsewhere)."""
        address = address_of(message)
        if isinstance(self.stage, Resettable) and address is not None:
            await self.stage.reset(address.state_id)

    async def _handle_message(
        self, message: Any, record: ConsumerRecord[bytes, bytes] | Handed, span: trace.Span,
        handed_over: asyncio.Future[None] | None, before: asyncio.Task[None] | None,
    ) -> str:
        address = address_of(message)
        if address is not None:
            span.set_attribute("request.id", address.request_id)
            if isinstance(message, Request):  # not authenticated: a refusal is under the client's bare id
                address = replace(address, nonce=_nonce(record))
        attempt, backoff = 0, FIRST_BACKOFF_S
        while True:
            attempt += 1
            try:
                await self._send_all(message, handed_over)
                self._backoff.through()
                return "ok"
            except RetriableError as exc:
                if attempt >= MAX_ATTEMPTS:
                    await self.dead_letter(record, type(exc).__name__, exc.message, address, None, ErrorCode.internal)
                    return "dead_letter"
            except Undeliverable as exc:
                await self.dead_letter(record, "Undeliverable", str(exc), None, address and address.request_id, None)
                return "undeliverable"
            except StageError as exc:
                if address is not None:
                    if exc.tenant is not None:
                        address = replace(address, tenant=exc.tenant)
                    await self.terminal(address, exc.code, exc.message, retry_after_s=exc.retry_after_s, rate_limit=exc.rate_limit)
                return exc.code.value
            except TOO_LARGE as exc:
                await self.dead_letter(record, type(exc).__name__, "an output is larger than the broker accepts", address, None, ErrorCode.internal)
                return "dead_letter"
            except INFRA as exc:
                if address is not None and time.time() > address.deadline:
                    if isinstance(self.stage, Ending) and self.stage.has_ended(address.state_id):
                        return "expired"  # its terminal event is on the reply topic already: not a second one
                    await self.terminal(address, ErrorCode.deadline_exceeded, "the request's deadline passed while the pipeline waited for its broker or store")
                    return "expired"
                log.warning("stage=%s request=%s waits for the infrastructure (%s: %s); retrying in %.1f s",
                            self.stage.name, address and address.request_id, type(exc).__name__, _reason(exc), backoff)
                if before is not None:  # the messages before this one are tried again first, in order
                    await asyncio.wait([before])
                if isinstance(self.stage, Resettable) and address is not None:
                    await self.stage.reset(address.state_id)  # what it cached may not have been sent
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug or an unreadable message: dead-letter it, tell the client
                where = traceback.extract_tb(exc.__traceback__)[-1]
                detail = f"{type(exc).__name__} at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}"
                log.error("stage=%s request=%s failed: %s", self.stage.name, address and address.request_id, detail)
                await self.dead_letter(record, type(exc).__name__, detail, address, None, ErrorCode.internal)
                return "dead_letter"
            await self._backoff.wait(backoff)
            if (task := asyncio.current_task()) is not None and task.cancelling():  # revoked or stopping while it waited
                raise asyncio.CancelledError
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _send_all(self, message: Any, handed_over: asyncio.Future[None] | None, earlier: list[Out] | None = None) -> None:
        """Produces each output as soon as it is yielded (a stream reaches the client token by token),
        a terminal event (and an output marked `after_acks`) only after the outputs before it are
        acknowledged, runs each output's `acked` in order once the broker acknowledged it, then waits
        for all of it. Outputs the stage marks `with_next` are held until the next one comes and go
        with it as one record batch, which needs no wait for its own records: the broker appends a
        batch whole or not at all (a cache hit's chunks and `Done`, an answer's last chunk and its
        terminal event: about a millisecond less per request). A terminal event in a batch still
        waits for the outputs sent before the batch. The next message of an ordered partition may
        start once this one's outputs are queued in the producer, before they are acknowledged.
        `earlier`: outputs of the records before this one in its group (`process_group`), held as if
        marked `with_next`."""
        acks: list[asyncio.Future[Any]] = []
        endings: list[asyncio.Future[Any]] = []  # the acknowledgements of terminal events sent
        last: asyncio.Task[None] | None = None
        held: list[Out] = list(earlier or ())

        async def send(outs: list[Out]) -> None:
            nonlocal last
            if len(outs) > 1 and acks and any(waits(out) for out in outs):
                await all_of(acks)  # a batch with a terminal event waits too (below)
            ack = await self._send_together(outs) if len(outs) > 1 else None
            if ack is not None:
                acks.append(ack)
                if any(isinstance(out.value, Done | Failed) for out in outs):
                    endings.append(ack)
                for out in outs:
                    on_delivery(ack, out)
                    if out.acked is not None:
                        last = asyncio.create_task(after(ack, out.acked, last))
                return
            for out in outs:  # one at a time, as yielded
                if waits(out) and acks:
                    # A terminal event goes out only once every chunk sent before it is acknowledged,
                    # alone or in a batch with the last chunks: after a broker outage, batches that
                    # expired are refused while later ones are accepted (or the producer is renewed), and
                    # a terminal event sent then would overtake the chunks the retry sends again.
                    await all_of(acks)
                ack = await self.send(out)
                acks.append(ack)
                if isinstance(out.value, Done | Failed):
                    endings.append(ack)
                on_delivery(ack, out)
                if out.acked is not None:
                    last = asyncio.create_task(after(ack, out.acked, last))

        try:
            async for out in self.stage.handle(message):
                held.append(out)
                if not out.with_next:
                    outs, held = held, []
                    await send(outs)
            if held:  # the stage ended after an output marked `with_next`
                await send(held)
            if handed_over is not None and not handed_over.done():
                handed_over.set_result(None)
            await all_of(acks)
            if last is not None:
                await last
        except Exception as exc:
            outage = isinstance(exc, INFRA) and not isinstance(exc, TOO_LARGE)
            if endings and isinstance(self.stage, Ending) and not outage:
                # A failure after the request's ending went out: once the broker has it, the stage knows
                # (`has_ended`, through `delivered`), and the runner sends no second one (`terminal`). Not
                # in an outage, where the acknowledgement may take the producer's whole timeout.
                await asyncio.wait(endings)
            raise
        finally:
            for ack in acks:  # on an early exit nobody awaits them: retrieve their errors quietly
                ack.add_done_callback(quiet)
            if last is not None:
                last.add_done_callback(quiet)

    async def _send_together(self, outs: list[Out]) -> asyncio.Future[Any] | None:
        """One record batch for `outs` when they share a topic and key and fit, or one `take_group` when
        the topic is handed over to a stage that takes groups (emit); None, with nothing sent, otherwise
        (they are sent one by one)."""
        first = outs[0]
        if any(o.topic != first.topic or o.key != first.key for o in outs):
            return None
        if self.replies is not None and self.replies.take_reply(first.topic, first.value):
            for out in outs[1:]:  # one request's events: its stream is there for all of them
                self.replies.take_reply(out.topic, out.value)
            return acknowledged()
        if (taker := self._taker(first.topic)) is not None:
            return await taker.take_group(outs) if takes_groups(taker.stage) else None
        items = [(codec.encode(o.value), tracing.publish(o.topic)) for o in outs]
        ack = await self._producer.send_together(first.topic, first.key.encode(), items)
        if ack is not None:
            metrics.PRODUCED.labels(self.stage.name, first.topic).inc(len(outs))
        return ack

    async def send(self, out: Out) -> asyncio.Future[Any]:
        taker = self._taker(out.topic)
        if taker is not None:
            return await taker.take(out)
        if self.replies is not None and self.replies.take_reply(out.topic, out.value):
            return acknowledged()
        metrics.PRODUCED.labels(self.stage.name, out.topic).inc()
        return await self._producer.send(out.topic, codec.encode(out.value), key=out.key.encode(), headers=tracing.publish(out.topic))

    async def _send_surely(self, out: Out) -> None:
        """Produces `out` and waits for its acknowledgement, through a broker outage (with backoff). An
        output larger than the broker accepts is no outage: TOO_LARGE at once (retried, it held the
        partition for ever: a refusal copying a ~1 MB field of a record just under the broker's limit)."""
        backoff = 0.1
        while True:
            try:
                await (await self.send(out))
                return
            except TOO_LARGE:
                raise
            except INFRA as exc:
                log.warning("stage=%s cannot produce to %s (%s); retrying in %.1f s", self.stage.name, out.topic, type(exc).__name__, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def terminal(self, address: Address, code: ErrorCode, message: str, **extra: Any) -> None:
        """The request's error terminal event, into the stream (emit delivers it) or, from emit, its reply
        topic: then emit is told (`Ending.note_ended`), or a later message of the request (decode's
        ending sent again, its own deadline ending) would give the client a second one."""
        topic = self.stage.topics.stream or address.reply_to
        if topic == address.reply_to and topic not in self.settings.reply_topics:
            log.warning("stage=%s request=%s names an unconfigured reply topic", self.stage.name, address.request_id)
            return
        if topic == address.reply_to and isinstance(self.stage, Ending) and self.stage.has_ended(address.state_id):
            log.warning("stage=%s request=%s has its ending already: no %s ending after it", self.stage.name,
                        address.request_id, code.value)
            return
        try:
            await self._send_surely(Out(topic, address.request_id, address.failed(code, message, **extra)))
        except TOO_LARGE:  # a field no schema bounds grew it: the ending still goes, as small as it can be
            log.error("stage=%s request=%s: its error ending is larger than the broker accepts; sending a bare one",
                      self.stage.name, address.request_id)
            bare = replace(address, model="", ticket=None)
            await self._send_surely(Out(topic, address.request_id, bare.failed(code, "the request's ending was too large to send")))
        if topic == address.reply_to and isinstance(self.stage, Ending):
            self.stage.note_ended(address.state_id)

    async def dead_letter(
        self, record: ConsumerRecord[bytes, bytes] | Handed, error_type: str, error: str, address: Address | None,
        rid: str | None, code: ErrorCode | None,
    ) -> None:
        payload = record.value or b""
        letter = dlq.bounded(
            stage=self.stage.name, topic=record.topic, partition=record.partition, offset=record.offset,
            error_type=error_type, error=error, payload_bytes=len(payload),
            payload_sha256=hashlib.sha256(payload).hexdigest(), request_id=address.request_id if address else rid,
            at=time.time(),
        )
        key = letter.request_id or f"{letter.topic}:{record.partition}:{record.offset}"
        await self._send_surely(Out(registry.DLQ, key, letter))  # bounded (dlq.bounded): never TOO_LARGE
        log.warning("stage=%s dead-lettered %s:%d:%d (%s)", self.stage.name, letter.topic, record.partition, record.offset, letter.error_type)
        if address is not None and code is not None:
            text = f"the {self.stage.name} stage could not process this request ({letter.error_type}); it is in the dead-letter topic"
            await self.terminal(address, code, text)


def _one_per_state(messages: Sequence[Any]) -> list[Any]:
    """The first message of each request state (`Address.state_id`) among `messages`, in order."""
    seen: dict[str, Any] = {}
    for message in messages:
        address = address_of(message)
        if address is not None:
            seen.setdefault(address.state_id, message)
    return list(seen.values())


def _nonce(record: ConsumerRecord[bytes, bytes] | Handed) -> str | None:
    """The refused record, for a refusal under a client's bare id (`Failed.nonce`): a digest of its topic,
    partition and offset (no offsets on the reply topic). None for a message handed over in memory, which
    has no offset (no stage hands a request to one that reads requests)."""
    if isinstance(record, Handed):
        return None
    return hashlib.sha256(f"{record.topic}:{record.partition}:{record.offset}".encode()).hexdigest()[:16]


def _reason(exc: BaseException) -> str:
    """What an infrastructure error says, for the log: the stage's own words or the client's (never a
    payload), cut short."""
    return str(exc)[:200] or "-"
