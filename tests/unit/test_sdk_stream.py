"""The SDK's stream without a broker: events are handed to `Stream._deliver` as the reply reader does,
and the stream is read as a caller would (chunks once and in order, then the terminal event)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from pipeline import sdk
from pipeline.sdk import Client, RequestFailed, Stream
from tests.unit.helpers import SETTINGS
from topics.errors import ErrorCode
from topics.stream import Chunk, Done, FinishReason, StreamEvent, Usage


class Offline(Client):
    async def _produce(self, request, headers=None) -> None:  # type: ignore[no-untyped-def]
        pass  # the request went out; what comes back is delivered by the test

    async def cancel(self, request_id, reason=None) -> None:  # type: ignore[no-untyped-def]
        self.cancelled = request_id


def events(stream: Stream, chunks: int) -> tuple[list[Chunk], Done]:
    rid = "default/" + stream.id
    made = [Chunk(id=rid, reply_to=stream.request.reply_to, seq=i, text=f"t{i}", tenant="default") for i in range(chunks)]
    done = Done(id=rid, reply_to=stream.request.reply_to, chunks=chunks, digest="d", finish_reason=FinishReason.stop,
                usage=Usage(1, chunks), tenant="default", model="m", created_at=1.0)
    return made, done


async def read(stream: Stream, *scripted: tuple[float, StreamEvent]) -> list[str]:
    """The texts the caller gets while `scripted` events arrive, each after its delay."""

    async def deliver() -> None:
        for delay, event in scripted:
            await asyncio.sleep(delay)
            stream._deliver(event)

    feeder = asyncio.create_task(deliver())
    try:
        return [chunk.text async for chunk in stream]
    finally:
        feeder.cancel()


@pytest.mark.asyncio
async def test_a_done_that_overtook_a_chunk_waits_for_it() -> None:
    """A chunk whose produce failed in a broker outage is sent again after the terminal event that
    overtook it (pipeline/stages/emit.py): the caller still gets every chunk once, in order, then Done."""
    stream = Offline(SETTINGS).stream(prompt="hi")
    (c0, c1, c2), done = events(stream, 3)
    texts = await read(stream, (0, c0), (0, c2), (0, done), (0.05, c1), (0, c2), (0, done))
    assert texts == ["t0", "t1", "t2"] and stream.done == done


@pytest.mark.asyncio
async def test_chunks_that_never_come_end_the_stream_incomplete(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sdk, "LATE_CHUNKS_S", 0.1)
    stream = Offline(SETTINGS).stream(prompt="hi")
    (c0, _c1, c2), done = events(stream, 3)
    with pytest.raises(RequestFailed) as failed:
        await read(stream, (0, c0), (0, c2), (0, done))
    assert failed.value.code is ErrorCode.stream_incomplete and failed.value.failed.chunks == 1
    assert stream.done is None


@pytest.mark.asyncio
async def test_events_already_delivered_are_taken_at_once_and_silence_ends_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream waits for the next event with one future and a timer; what arrived before it asked is
    taken without waiting, and a request that hears nothing ends at its deadline (plus `GRACE_S`)."""
    monkeypatch.setattr(sdk, "GRACE_S", 0.0)
    stream = Offline(SETTINGS).stream(prompt="hi", deadline_s=0.2)
    made, done = events(stream, 2)
    for event in (*made, done):
        stream._deliver(event)
    assert [chunk.text async for chunk in stream] == ["t0", "t1"] and stream.done == done
    silent = Offline(SETTINGS).stream(prompt="hi", deadline_s=0.2)
    started = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError):
        await read(silent)
    assert 0.15 < asyncio.get_running_loop().time() - started < 2.0
    assert silent._state.waiter is None  # nothing left waiting
    assert silent._client.cancelled == silent.id  # and the pipeline is told to stop


@pytest.mark.asyncio
async def test_a_stream_dropped_unfinished_is_forgotten_and_cancelled() -> None:
    import gc

    client = Offline(SETTINGS)
    client.cancelled = None
    stream = client.stream(prompt="hi")
    rid = stream.id
    (c0, c1), _ = events(stream, 2)
    stream._deliver(c0)
    stream._deliver(c1)
    async for _chunk in stream:
        break  # no aclose(): the caller just leaves
    del stream, _chunk
    for _ in range(5):
        gc.collect()
        await asyncio.sleep(0.01)  # asyncio's finalizer runs the generator's cleanup on the loop
    assert rid not in client._streams and client.cancelled == "default/" + rid  # by the pipeline's id


@pytest.mark.asyncio
async def test_a_request_the_broker_cannot_take_fails_by_its_deadline_not_after_the_outage() -> None:
    class Hung:
        async def send_and_wait(self, *args: object, **kwargs: object) -> None:
            await asyncio.sleep(3600)  # a producer renewing itself until the broker is back

    client = Client(SETTINGS)
    client._producer = Hung()  # type: ignore[assignment]
    request = client.request(prompt="hi", deadline_s=0.3)
    with pytest.raises(sdk.KafkaTimeoutError):
        await asyncio.wait_for(client.complete(request), 3.0)


@pytest.mark.asyncio
async def test_a_stream_dropped_unfinished_is_cancelled_without_waiting_for_the_collector() -> None:
    """Its iterator held the stream (a cycle): nothing was sent until a full collection, which can be
    minutes away, and decode generated to `max_tokens` meanwhile."""
    import gc

    client = Offline(SETTINGS)
    client.cancelled = None
    stream = client.stream(prompt="hi")
    rid = stream.id
    (c0, c1), _ = events(stream, 2)
    stream._deliver(c0)
    stream._deliver(c1)
    gc.disable()
    try:
        async for _chunk in stream:
            break
        del stream, _chunk
        for _ in range(5):
            await asyncio.sleep(0.01)  # asyncio's finalizer runs the iterator's cleanup on the loop
    finally:
        gc.enable()
    assert rid not in client._streams and client.cancelled == "default/" + rid


@pytest.mark.asyncio
async def test_aclose_from_another_task_ends_the_reader_and_cancels() -> None:
    """A stop button while a task reads: the iterator is running in the reader, so closing it raised
    `RuntimeError: aclose(): asynchronous generator is already running` and sent nothing."""
    client = Offline(SETTINGS)
    client.cancelled = None
    stream = client.stream(prompt="hi")
    (c0, _c1), _ = events(stream, 2)
    stream._deliver(c0)
    got: list[str] = []

    async def reader() -> None:
        async for chunk in stream:
            got.append(chunk.text)

    reading = asyncio.create_task(reader())
    await asyncio.sleep(0.01)  # the reader took chunk 0 and waits inside the iterator for more
    await asyncio.wait_for(stream.aclose(), 1.0)
    await asyncio.wait_for(reading, 1.0)  # its loop just ends
    assert got == ["t0"] and stream.done is None
    assert client.cancelled == "default/" + stream.id and stream.id not in client._streams


@pytest.mark.asyncio
async def test_aclose_from_another_task_between_chunks_ends_the_reader_cleanly() -> None:
    """The reader busy with a chunk (its iterator suspended at its yield): closed from elsewhere while
    the broker takes its time with the cancellation, the reader's next step ends its loop, not
    `anext(): asynchronous generator is already running` (the iterator's cleanup was still awaiting)."""
    busy, closed = asyncio.Event(), asyncio.Event()

    class SlowCancel(Offline):
        async def cancel(self, request_id, reason=None) -> None:  # type: ignore[no-untyped-def]
            closed.set()  # the reader goes on meanwhile
            await asyncio.sleep(0.02)
            self.cancelled = request_id

    client = SlowCancel(SETTINGS)
    client.cancelled = None
    stream = client.stream(prompt="hi")
    (c0, c1), _ = events(stream, 2)
    stream._deliver(c0)
    stream._deliver(c1)
    got: list[str] = []

    async def reader() -> None:
        async for chunk in stream:
            got.append(chunk.text)
            busy.set()
            await closed.wait()

    reading = asyncio.create_task(reader())
    await busy.wait()
    await asyncio.wait_for(stream.aclose(), 1.0)
    await asyncio.wait_for(reading, 1.0)
    assert got == ["t0"] and client.cancelled == "default/" + stream.id


@pytest.mark.asyncio
async def test_stop_ends_the_streams_being_read_and_cancels_them_before_the_producer_stops() -> None:
    """They waited to their deadline (plus `GRACE_S`), and their late cancellation renewed the stopped
    producer: a client nobody stopped."""
    order: list[str] = []

    class Recording(Offline):
        async def cancel(self, request_id, reason=None) -> None:  # type: ignore[no-untyped-def]
            order.append("cancel " + request_id)

    class StoppingProducer:
        async def stop(self) -> None:
            order.append("producer stopped")

    client = Recording(SETTINGS)
    client._producer = StoppingProducer()  # type: ignore[assignment]
    stream = client.stream(prompt="hi", deadline_s=60)
    (c0, _c1), _ = events(stream, 2)
    stream._deliver(c0)
    reading = asyncio.create_task(read(stream))
    await asyncio.sleep(0.01)
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(client.stop(), 2.0)
    assert await asyncio.wait_for(reading, 1.0) == ["t0"]
    assert asyncio.get_running_loop().time() - started < 1.0
    assert order == ["cancel default/" + stream.id, "producer stopped"]


@pytest.mark.asyncio
async def test_more_chunks_held_than_the_sequencer_keeps_is_a_request_failure() -> None:
    """The sequencer's OverflowError escaped as itself: the bridge ended the SSE body with no error
    event, and callers catching RequestFailed missed it."""
    client = Offline(SETTINGS)
    client.cancelled = None
    stream = client.stream(prompt="hi")
    rid = "default/" + stream.id
    for seq in (0, *range(2, 4100)):
        stream._deliver(Chunk(id=rid, reply_to=stream.request.reply_to, seq=seq, text="t", tenant="default"))
    got: list[str] = []
    with pytest.raises(RequestFailed) as failed:
        async for chunk in stream:
            got.append(chunk.text)
    assert got == ["t"] and failed.value.code is ErrorCode.stream_incomplete and failed.value.failed.chunks == 1
    assert failed.value.failed.id == rid and failed.value.failed.model == stream.request.model
    assert client.cancelled == rid  # decode is told to stop


@pytest.mark.asyncio
async def test_a_done_that_counts_fewer_chunks_than_arrived_is_incomplete() -> None:
    stream = Offline(SETTINGS).stream(prompt="hi")
    made, done = events(stream, 4)
    short = msgspec.structs.replace(done, chunks=2)
    with pytest.raises(RequestFailed) as failed:
        await read(stream, *((0, c) for c in made), (0, short))
    assert failed.value.code is ErrorCode.stream_incomplete and failed.value.failed.chunks == 4 and stream.done is None


@pytest.mark.asyncio
async def test_a_held_chunk_past_the_end_done_counts_does_not_hold_a_whole_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stray with seq >= Done.chunks turned a complete answer into `stream_incomplete` after the
    `LATE_CHUNKS_S` wait; also one that arrives while a late chunk is awaited."""
    monkeypatch.setattr(sdk, "LATE_CHUNKS_S", 0.5)
    stream = Offline(SETTINGS).stream(prompt="hi")
    (c0, c1, c2, _c3, stray), _ = events(stream, 5)
    _, done = events(stream, 3)
    started = asyncio.get_running_loop().time()
    texts = await read(stream, (0, c0), (0, stray), (0, c1), (0, c2), (0, done))  # 4 held behind 3 at the Done
    assert texts == ["t0", "t1", "t2"] and stream.done == done
    late = Offline(SETTINGS).stream(prompt="hi")
    (c0, c1, c2, stray, stray2), _ = events(late, 5)
    _, done = events(late, 3)
    texts = await read(late, (0, c0), (0, stray2), (0, c2), (0, done), (0, stray), (0.01, c1))
    assert texts == ["t0", "t1", "t2"] and late.done == done
    assert asyncio.get_running_loop().time() - started < 0.4  # neither waited for the late chunks' limit


@pytest.mark.asyncio
async def test_a_stream_iterated_without_holding_it_still_gets_its_events() -> None:
    """`async for chunk in client.stream(...)` holds only the iterator. Once the iterator no longer held
    the stream (so that a stream left with `break` is freed at once), the client's weak table lost the
    stream as soon as iteration began, the reader found no one for the request's events, and the loop
    waited to its deadline (a fresh-clone CI run, session 47). The table holds what the iterator holds."""
    import gc

    client = Offline(SETTINGS)
    template = client.stream(prompt="hi")
    (c0, c1), done = events(template, 2)
    await template.aclose()

    async def answer() -> list[bool]:
        await asyncio.sleep(0.01)  # the loop below is waiting for its first event
        gc.collect()  # whatever only the dropped Stream held is gone by now
        return [client.take_reply(client.reply_topic, event) for event in (c0, c1, done)]

    feeder = asyncio.create_task(answer())
    async with asyncio.timeout(5):
        texts = [chunk.text async for chunk in client.stream(template.request)]
    assert await feeder == [True, True, True] and texts == ["t0", "t1"]


@pytest.mark.asyncio
async def test_aclose_waits_at_most_cancel_wait_s_for_a_reader_still_handing_its_request_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reader inside its produce (a slow broker, an outage) cannot be woken: `aclose()` waited for the
    produce, up to the request's deadline. It now gives up after CANCEL_WAIT_S, and the reader sends the
    cancellation itself once its produce returns."""
    monkeypatch.setattr(sdk, "CANCEL_WAIT_S", 0.05)
    handed = asyncio.Event()

    class SlowBroker(Offline):
        async def _produce(self, request, headers=None) -> None:  # type: ignore[no-untyped-def]
            await handed.wait()

    client = SlowBroker(SETTINGS)
    client.cancelled = None
    stream = client.stream(prompt="hi")
    reader = asyncio.create_task(anext(aiter(stream), None))
    await asyncio.sleep(0.01)  # the reader is in its produce
    loop = asyncio.get_running_loop()
    started = loop.time()
    await stream.aclose()
    assert loop.time() - started < 1.0 and client.cancelled is None
    handed.set()  # the broker takes the request: the reader sees it is closing and cancels it
    assert await asyncio.wait_for(reader, 1.0) is None
    assert client.cancelled == stream.id
