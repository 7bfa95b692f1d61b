"""The Python SDK for services that use Kafka directly; the bridge is built on it.

    async with Client(settings) as client:
        stream = client.stream(messages=[{"role": "user", "content": "hi"}])
        async for chunk in stream:
            print(chunk.text, end="")
        print(stream.done.usage)

        answer = await client.complete(prompt="Say hello")

One `Client` produces to `llm.requests` and reads its reply topic from the moment it starts; events are
fanned out to the waiting request by the client's id (the pipeline namespaces it as `<tenant>/<id>`;
the first namespaced id seen for a request is the only one accepted after it). Redelivered chunks are
dropped by sequence number and early ones held until the gap fills, so each caller sees 0..n-1 once
and in order, then exactly one terminal event. A `Done` that arrives before some of its chunks waits
for them up to `LATE_CHUNKS_S` (a chunk whose produce failed in a broker outage is sent again after the
terminal event that overtook it); a stream still missing chunks then, or a `Failed` with a gap open,
ends with `stream_incomplete` rather than a text with a hole. A request the broker did not take (an
outage past the producer's 30 s, or a producer id it refused after one) is sent again, the same bytes,
until its deadline: ingest takes the same bytes again as a redelivery. A sluice API key is never sent: each
request is signed with a pair derived from it (pipeline/gateway/principal.py, docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError, KafkaTimeoutError

from pipeline import kafka
from pipeline.gateway.keys import well_formed
from pipeline.gateway.principal import sign_with_key
from pipeline.observability.watch import RequestWatch
from pipeline.producing import POISONED, Producer
from pipeline.sequencing import Sequencer
from pipeline.settings import Settings
from pipeline.stage import Address, address_of
from topics import codec, registry
from topics.control import Cancel, CancelReason
from topics.errors import ErrorCode
from topics.hops import client_id_of
from topics.requests import ChatMessage, Request
from topics.stream import Chunk, Done, Failed, StreamEvent, Terminal

log = logging.getLogger(__name__)
GRACE_S = 10.0  # how long past its deadline a request may take before the client gives up
LATE_CHUNKS_S = 45.0  # how long a Done waits for chunks it counts but that have not arrived: past the
# producer's request timeout (30 s), by which a produce that failed has been retried (pipeline/handling.py)
RESEND_AFTER_S = 1.0  # the pause before a request the broker did not take is sent again
CANCEL_WAIT_S = 5.0  # how long a stream's cleanup waits for the broker to take its cancellation


class RequestFailed(Exception):
    """The pipeline ended the request with an error terminal event."""

    def __init__(self, failed: Failed) -> None:
        super().__init__(f"{failed.code.value}: {failed.message}")
        self.failed = failed
        self.code: ErrorCode = failed.code


@dataclass(frozen=True)
class Completion:
    text: str
    done: Done


class Stream:
    """The chunks of one request, in order, once each. `done` is set when iteration ends normally.

    `aclose()` (or leaving `async with stream`) stops it early and tells the pipeline to cancel the
    request. Another task may call it while one reads (a stop button): the reader's `async for` then
    ends as if the answer had, with `done` still None. A stream its caller drops unfinished (a `break`,
    no `aclose`) is freed at once, and asyncio's finalizer for its iterator cancels it the same way."""

    def __init__(self, client: Client, request: Request) -> None:
        self._client = client
        self.request = request
        # The iterator holds this and never the stream: a stream<->iterator cycle kept a dropped stream,
        # and the generation it asked for, alive until a full collection of the garbage collector.
        self._state = state = _State(request)
        self._events = state.events  # delivered, not yet taken by the iterator
        self._deliver = state.deliver  # how the reply reader hands this stream an event
        self._chunks = _iterate(client, state)
        state.chunks = weakref.ref(self._chunks)
    @property
    def done(self) -> Done | None:
        return self._state.done

    @property
    def pipeline_id(self) -> str | None:
        """`<tenant>/<id>`, once the pipeline has answered."""
        return self._state.pipeline_id

    def __aiter__(self) -> AsyncGenerator[Chunk, None]:
        return self._chunks

    async def aclose(self) -> None:
        """Stops early: the pipeline is told to cancel the request (decode stops within a step); returns
        once the broker took the cancellation (at most `CANCEL_WAIT_S`). While another task waits inside
        the iterator, that reader is woken and its loop ends (closing the iterator under it would raise)."""
        await _close(self._client, self._state)

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def id(self) -> str:
        return self.request.id


class _State:
    """What a `Stream` and its iterator (`_iterate`) share."""

    __slots__ = ("request", "events", "waiter", "done", "pipeline_id", "closing", "owed", "stopped", "abandoned",
                 "chunks", "__weakref__")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.events: deque[StreamEvent] = deque()  # delivered, not yet taken by the iterator
        self.waiter: asyncio.Future[None] | None = None  # set while the iterator waits for the next event
        self.done: Done | None = None
        self.pipeline_id: str | None = None  # `<tenant>/<id>`, once the pipeline has answered
        self.closing = False  # `aclose()` (or `Client.stop()`) was called: the iterator stops at its next step
        self.owed = False  # it stopped for `closing` before the request settled: `aclose()` sends the cancel
        self.stopped: asyncio.Future[None] | None = None  # `aclose()` waits on it for another task's iterator
        self.abandoned = False  # `aclose()` stopped waiting for that iterator (CANCEL_WAIT_S): it cancels itself
        self.chunks: weakref.ref[AsyncGenerator[Chunk, None]] | None = None  # the iterator, not kept alive by this

    def deliver(self, event: StreamEvent) -> None:
        if "/" in event.id:  # namespaced by ingest: the first one seen is this request's
            if self.pipeline_id is None:
                self.pipeline_id = event.id
            elif event.id != self.pipeline_id:
                return
        self.events.append(event)
        if self.waiter is not None and not self.waiter.done():  # `wake`, inline: once per event
            self.waiter.set_result(None)

    def wake(self) -> None:
        if self.waiter is not None:
            _wake(self.waiter)

    async def next(self, timeout: float) -> StreamEvent | None:
        """The next event delivered, or None when `timeout` seconds pass first or the stream is closing.
        One future and one timer for a wait, none when an event is already here: `asyncio.wait_for(
        queue.get())` made a task, a future and a timer for every event (about 8 µs of CPU each,
        `bridge`'s two per answer)."""
        if not self.events and not self.closing:
            loop = asyncio.get_running_loop()
            waiter = self.waiter = loop.create_future()
            timer = loop.call_later(timeout, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self.waiter = None
        return self.events.popleft() if self.events and not self.closing else None


async def _close(client: Client, state: _State) -> None:
    """`Stream.aclose()`, from the state the client keeps (`Client.stop()` closes streams whose `Stream`
    object the caller no longer holds: `async for chunk in client.stream(...)` holds only the iterator)."""
    state.closing = True
    chunks = state.chunks() if state.chunks is not None else None
    if chunks is not None and chunks.ag_running:
        if state.stopped is None:
            state.stopped = asyncio.get_running_loop().create_future()
        state.wake()
        try:
            async with asyncio.timeout(CANCEL_WAIT_S):
                await asyncio.shield(state.stopped)  # the reader's iterator has run its cleanup
        except TimeoutError:  # the reader is still handing its request to the broker (an outage): it sends
            state.abandoned = True  # the cancellation itself once it stops, as no `aclose()` waits for it now
            client._forget(state.request.id)
            return
    elif chunks is not None:
        await chunks.aclose()
    client._forget(state.request.id)  # also when it was never iterated
    if state.owed:
        state.owed = False
        await _cancel(client, state)


async def _iterate(client: Client, state: _State) -> AsyncGenerator[Chunk, None]:
    """A `Stream`'s chunks (its docstring and the module's say what the caller gets)."""
    request = state.request
    order = Sequencer()
    deadline = time.monotonic() + request.deadline_s + GRACE_S
    settled = False  # nothing to cancel: its terminal event came, or the broker never took it
    watch = RequestWatch(request, client.settings.models)  # the trace's root span; TTFT and ITL
    ended: Done | None = None  # a Done that came before some of its chunks
    try:
        try:
            await client._produce(request, watch.headers())
        except KafkaError:
            settled = True  # a cancel would wait out the same outage, for a request never taken
            raise
        while not state.closing:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                if ended is not None:
                    raise RequestFailed(_incomplete(ended, order.next_seq))
                raise TimeoutError(f"no terminal event for request {request.id}")
            if (event := await state.next(timeout)) is None:
                continue
            if isinstance(event, Chunk):
                if ended is not None and event.seq >= ended.chunks:
                    continue  # past the end its Done counts: a stray, not a late chunk
                try:
                    ready = order.accept(event)
                except OverflowError as exc:  # more held behind a gap than the sequencer keeps
                    raise RequestFailed(_overflowed(event, request, order.next_seq, exc)) from None
                for chunk in ready:
                    watch.chunk()
                    yield chunk
                if ended is None or ended.chunks > order.next_seq:
                    continue
                event = ended  # the last late chunk came
            elif ended is not None:
                continue  # the terminal event again
            settled = True
            if isinstance(event, Done):
                order.drop_from(event.chunks)  # held strays past the end it counts would hold it for nothing
                if event.chunks > order.next_seq:
                    ended = event
                    deadline = min(deadline, time.monotonic() + LATE_CHUNKS_S)
                    continue
            watch.finish(event)
            state.done = _ending(event, order)
            return
    finally:
        watch.finish(None)
        client._forget(request.id)
        if not settled:  # the caller stopped early: let decode stop too (not waiting out an outage for it)
            if state.closing and not state.abandoned:
                state.owed = True  # `aclose()` sends it: awaiting here, another task's `anext` would find this running
            else:
                await _cancel(client, state)
        if state.stopped is not None and not state.stopped.done():
            state.stopped.set_result(None)


def _ending(event: Done | Failed, order: Sequencer) -> Done:
    """The Done of a stream whose terminal event came with no chunk it counts missing; else the failure."""
    if isinstance(event, Done) and event.chunks < order.next_seq:
        text = f"{order.next_seq} chunks arrived, more than the {event.chunks} this answer counts"
        raise RequestFailed(_incomplete(event, order.next_seq, text))
    if order.gap():
        raise RequestFailed(_incomplete(event, order.next_seq))
    if isinstance(event, Failed):
        raise RequestFailed(event)
    return event


async def _cancel(client: Client, state: _State) -> None:
    """Tells the pipeline to stop a request its caller left, waiting at most `CANCEL_WAIT_S` for the broker."""
    try:
        async with asyncio.timeout(CANCEL_WAIT_S):  # not wait_for: on 3.11 it can swallow a cancel
            await client.cancel(state.pipeline_id or state.request.id)
    except (TimeoutError, KafkaError) as exc:
        log.warning("the cancellation of request %s was not sent (%s)", state.request.id, type(exc).__name__)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _outage(exc: KafkaError) -> bool:
    """A send failure that sending again can cure: the broker away or moving leaders (retriable), the
    batch expired waiting for it, or the producer id refused after it (the producer renews itself)."""
    return exc.retriable or isinstance(exc, (KafkaTimeoutError, *POISONED))


def _incomplete(event: Done | Failed, received: int, text: str | None = None) -> Failed:
    address = address_of(event)
    assert address is not None
    text = text or f"only chunks 0..{received - 1} of this answer arrived"
    return address.failed(ErrorCode.stream_incomplete, text, chunks=received, usage=event.usage, timings=event.timings)


def _overflowed(chunk: Chunk, request: Request, received: int, exc: OverflowError) -> Failed:
    """The failure of a stream that held more chunks behind a gap than `Sequencer` keeps (MAX_HELD)."""
    address = Address(chunk.id, chunk.reply_to, chunk.tenant, request.model, request.created_at, request.deadline_s)
    text = f"only chunks 0..{received - 1} of this answer arrived in order ({exc})"
    return address.failed(ErrorCode.stream_incomplete, text, chunks=received)


class Client:
    def __init__(self, settings: Settings, *, reply_name: str = "sdk", model: str | None = None, client_id: str | None = None) -> None:
        self.settings = settings
        self.reply_topic = registry.reply_topic(reply_name)
        self.model = model or settings.models[0]
        self._client_id = client_id or f"sluice-sdk-{uuid.uuid4().hex[:8]}"
        # Weak: a stream its caller dropped unfinished (a `break` out of `async for`, no `aclose`) is
        # freed at once (no cycle holds it: `_State`), and asyncio's finalizer for its iterator runs the
        # cleanup (forget, cancel), so neither it nor the generation it asked for outlives the caller's interest.
        self._streams: weakref.WeakValueDictionary[str, _State] = weakref.WeakValueDictionary()
        self._producer: Producer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: asyncio.Task[None] | None = None
        self._partitions: Callable[[], Sequence[int]] | None = None
        self._turn = 0

    def send_requests_to(self, partitions: Callable[[], Sequence[int]]) -> None:
        """Requests go to the partitions of `llm.requests` that `partitions()` gives at the time (in turn),
        the ones the ingest of this process reads, so that with every stage here the answer comes back in
        memory (`take_reply`); by their key, as otherwise, while it gives none (a rebalance)."""
        self._partitions = partitions

    async def start(self) -> None:
        producer = Producer(self.settings, self._client_id)  # renewed if a long broker outage kills it
        fail_fast = asyncio.Event()
        fail_fast.set()  # no broker at start: say so at once
        await producer.start(fail_fast)
        self._producer = producer
        try:
            self._consumer = await kafka.broadcast_consumer(self.settings, (self.reply_topic,), self._client_id + "-replies")
        except BaseException:
            await self._producer.stop()
            raise
        self._reader = asyncio.create_task(self._read())

    async def stop(self) -> None:
        """Ends every open stream first, as `Stream.aclose()` does (a reader's loop ends; the cancellations
        go out while the producer still works, at most `CANCEL_WAIT_S`), then stops reading and producing."""
        closing = [asyncio.create_task(_close(self, state)) for state in list(self._streams.values())]
        if closing:
            _, late = await asyncio.wait(closing, timeout=CANCEL_WAIT_S)
            for task in late:  # a reader still waiting for the broker to take its request
                task.cancel()
            for outcome in await asyncio.gather(*closing, return_exceptions=True):
                if isinstance(outcome, Exception):
                    log.warning("closing a stream at stop failed: %r", outcome)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()
        if self._producer is not None:
            await self._producer.stop()

    async def __aenter__(self) -> Client:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def request(
        self,
        *,
        messages: Iterable[Mapping[str, str] | ChatMessage] = (),
        prompt: str | None = None,
        model: str | None = None,
        tenant: str = "default",
        api_key: str | None = None,
        deadline_s: float = 300.0,
        no_cache: bool = False,
        no_store: bool = False,
        task: str | None = None,
        priority: str = "interactive",  # or "batch": the engine's lower lane (what `sluice batch` sends)
        stream: bool = True,  # False: the answer travels in as few chunks as the backend allows
        **sampling: object,
    ) -> Request:
        """A validated request (msgspec.ValidationError names the bad field) with a fresh id. `no_cache`:
        never answered from the cache; `no_store`: its answer is not stored in it; `task` (code,
        summarization, ...): what routing rules may match on. A sluice `api_key` never goes to Kafka: the
        request carries the key's hash and a signature with the key's own pair instead (sign_with_key);
        anything else given as `api_key` (a JWT) is sent for ingest to check."""
        fields = {
            "id": uuid.uuid4().hex,
            "reply_to": self.reply_topic,
            "model": model or self.model,
            "created_at": time.time(),
            "messages": [msgspec.to_builtins(m) if isinstance(m, ChatMessage) else dict(m) for m in messages],
            "prompt": prompt,
            "sampling": sampling,
            "deadline_s": deadline_s,
            "api_key": api_key,
            "tenant": tenant,
            "no_cache": no_cache,
            "no_store": no_store,
            "task": task,
            "priority": priority,
            "stream": stream,
        }
        request = msgspec.convert(fields, Request)
        return sign_with_key(api_key, request) if api_key is not None and well_formed(api_key) else request

    def stream(self, request: Request | None = None, **kwargs: object) -> Stream:
        """A stream for `request` (or one built from kwargs as in `request()`); produced when iterated."""
        request = request or self.request(**kwargs)  # type: ignore[arg-type]
        stream = Stream(self, request)
        self._streams[request.id] = stream._state  # held by the iterator while it runs, not by the Stream
        return stream

    async def complete(self, request: Request | None = None, **kwargs: object) -> Completion:
        """The whole answer (built from kwargs, a non-streaming request)."""
        stream = self.stream(request or self.request(**{"stream": False, **kwargs}))  # type: ignore[arg-type]
        text = "".join([chunk.text async for chunk in stream])
        if stream.done is None:  # closed meanwhile: `Client.stop()`
            raise RuntimeError(f"request {stream.id} was closed before its answer ended")
        return Completion(text, stream.done)

    async def cancel(self, request_id: str, reason: CancelReason = CancelReason.client_gone) -> None:
        assert self._producer is not None, "start() the client first"
        cancel = Cancel(id=request_id, reason=reason, at=time.time())
        await self._producer.send_and_wait(registry.CONTROL, codec.encode(cancel), key=request_id.encode())

    async def _produce(self, request: Request, headers: list[tuple[str, bytes]] | None = None) -> None:
        """Sends `request` and waits for the broker to take it, sending it again after a failure that an
        outage explains until the request's deadline; the last failure is raised after that."""
        assert self._producer is not None, "start() the client first"
        value = codec.encode(request)
        deadline = request.created_at + request.deadline_s
        here = self._partitions() if self._partitions is not None else ()
        partition = here[self._turn % len(here)] if here else None  # a copy sent again goes where the first went
        self._turn += 1
        while True:
            try:
                left = deadline - time.time()
                if left <= 0:  # nothing handed to the producer once the deadline has passed
                    raise TimeoutError
                # bounded: a producer being renewed in an outage waits for the broker with no end of its own;
                # not wait_for: on 3.11 it can swallow a cancel
                async with asyncio.timeout(left):
                    await self._producer.send_and_wait(registry.REQUESTS, value, key=request.id.encode(),
                                                       headers=headers, partition=partition)
                return
            except TimeoutError:
                raise KafkaTimeoutError(f"request {request.id} was not taken by the broker within its deadline") from None
            except KafkaError as exc:
                if not _outage(exc) or time.time() + RESEND_AFTER_S >= deadline:
                    raise
                log.warning("the broker did not take request %s (%s); sending it again", request.id, type(exc).__name__)
            await asyncio.sleep(RESEND_AFTER_S)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def take_reply(self, topic: str, event: StreamEvent) -> bool:
        """An event that emit, running in this process, would produce to `topic`: delivered here in
        memory when `topic` is this client's reply topic and one of its streams waits for the event's
        request (True); otherwise nothing is done and emit produces it (False). That stream is the
        event's only reader (other clients of a shared reply topic drop what is not theirs), so no one
        misses it, and one broker crossing less is on the answer's way. A stream that ended meanwhile
        leaves the event to the topic, where no one reads it, as before."""
        if topic != self.reply_topic or (state := self._streams.get(client_id_of(event.id))) is None:
            return False
        state.deliver(event)
        return True

    async def _read(self) -> None:
        assert self._consumer is not None
        while True:
            try:
                batch = await self._consumer.getmany(timeout_ms=100)
            except KafkaError as exc:  # the broker is away: keep reading once it is back
                log.warning("reading %s failed, retrying: %s", self.reply_topic, type(exc).__name__)
                await asyncio.sleep(1.0)
                continue
            for records in batch.values():
                for record in records:
                    try:
                        event = codec.decode(record.value or b"", StreamEvent)
                    except codec.SchemaError as exc:  # emit wrote it, so this is a version skew: say so
                        log.error("unreadable event on %s: %s", self.reply_topic, exc)
                        continue
                    state = self._streams.get(client_id_of(event.id))
                    if state is not None:
                        state.deliver(event)


__all__ = ["Client", "Completion", "RequestFailed", "Stream", "Terminal"]
