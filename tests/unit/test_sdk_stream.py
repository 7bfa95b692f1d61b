"""The SDK's stream without a broker: events are handed to `Stream._deliver` as the reply reader does,
and the stream is read as a caller would (chunks once and in order, then the terminal event)."""

from __future__ import annotations

import asyncio

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
    assert silent._waiter is None  # nothing left waiting
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
