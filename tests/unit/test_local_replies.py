"""Replies produced in this process reach a reader of their topic here once the broker acknowledged
them, and only then (pipeline/local_replies.py, pipeline/handling.py); the copy the client later reads
from the topic is dropped, so the caller sees each chunk once (pipeline/sdk.py)."""

from __future__ import annotations

import asyncio

import pytest

from pipeline import local_replies
from pipeline.handling import Handling
from pipeline.sdk import Client
from pipeline.settings import Settings
from pipeline.stage import Out, address_of
from tests.unit import helpers
from tests.unit.fakes import HeldAcks, Yields, record_of
from tests.unit.helpers import SETTINGS
from topics.stream import Chunk, Done, FinishReason, Usage

REPLIES = "llm.responses.sdk"


def answer(rid: str, *, together: bool) -> list[Out]:
    address = address_of(helpers.admitted(helpers.request(rid)))
    assert address is not None
    chunk = address.chunk(0, "hello")
    done = address.done(chunks=1, digest="d", finish=FinishReason.stop, usage=Usage(1, 1), timings={})
    return [Out(REPLIES, rid, chunk, with_next=together), Out(REPLIES, rid, done)]


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.mark.asyncio
@pytest.mark.parametrize("together", [False, True])
async def test_a_reply_reaches_a_reader_here_only_once_acknowledged(together: bool) -> None:
    got: list[object] = []
    stop = local_replies.listen(REPLIES, got.append)
    try:
        producer = HeldAcks()
        outs = answer("r1", together=together)
        task = asyncio.create_task(Handling(Yields(outs), Settings(), producer).process(record_of(helpers.admitted(helpers.request("r1"))), None))  # type: ignore[arg-type]
        await settle()
        assert got == []  # produced, not yet acknowledged
        producer.pending[0].set_result(None)
        await settle()
        if not together:  # the terminal event goes once the chunk is acknowledged
            assert got == [outs[0].value]
            producer.pending[1].set_result(None)
            await settle()
        assert got == [o.value for o in outs]
        assert await task == "ok"
    finally:
        stop()
    assert local_replies.readers(REPLIES) is None


@pytest.mark.asyncio
async def test_a_refused_produce_hands_nothing_over() -> None:
    got: list[object] = []
    stop = local_replies.listen(REPLIES, got.append)
    try:
        producer = HeldAcks()
        handling = Handling(Yields(answer("r1", together=True)), Settings(), producer)  # type: ignore[arg-type]
        task = asyncio.create_task(handling._send_all(helpers.admitted(helpers.request("r1")), None))
        await settle()
        producer.pending[0].set_exception(ConnectionError("broker away"))
        with pytest.raises(ConnectionError):
            await task
        await settle()
        assert got == []
    finally:
        stop()


class Offline(Client):
    async def _produce(self, request, headers=None) -> None:  # type: ignore[no-untyped-def]
        pass


@pytest.mark.asyncio
async def test_the_copy_read_from_the_topic_after_the_one_handed_over_is_dropped() -> None:
    client = Offline(SETTINGS)
    stream = client.stream(prompt="hi")
    rid = "default/" + stream.id
    chunks = [Chunk(id=rid, reply_to=stream.request.reply_to, seq=i, text=f"t{i}", tenant="default") for i in range(2)]
    done = Done(id=rid, reply_to=stream.request.reply_to, chunks=2, digest="d", finish_reason=FinishReason.stop,
                usage=Usage(1, 2), tenant="default", model="m", created_at=1.0)

    async def arrive() -> None:
        await asyncio.sleep(0)
        for event in (chunks[0], chunks[0], chunks[1], done, chunks[1], done):  # in memory, then the topic's copies
            client._dispatch(event)

    feeder = asyncio.create_task(arrive())
    texts = [chunk.text async for chunk in stream]
    await feeder
    assert texts == ["t0", "t1"] and stream.done == done
    client._dispatch(done)  # after the end: nobody waits for it
