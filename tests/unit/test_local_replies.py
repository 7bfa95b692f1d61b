"""Replies produced in this process reach a reader of their topic here once the broker acknowledged
them, and only then (pipeline/local_replies.py, pipeline/handling.py); the copy the client later reads
from the topic is dropped, so the caller sees each chunk once (pipeline/sdk.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord

from pipeline import local_replies
from pipeline.handling import Handling
from pipeline.sdk import Client
from pipeline.settings import Settings
from pipeline.stage import Out, address_of
from pipeline.topology import Topics
from tests.unit import helpers
from tests.unit.helpers import SETTINGS
from topics import codec
from topics.hops import Admitted
from topics.stream import Chunk, Done, FinishReason, Usage

REPLIES = "llm.responses.sdk"


class Producer:
    def __init__(self) -> None:
        self.pending: list[asyncio.Future[Any]] = []

    def _ack(self) -> asyncio.Future[Any]:
        ack = asyncio.get_running_loop().create_future()
        self.pending.append(ack)
        return ack

    async def send(self, topic: str, value: bytes, *, key: bytes, headers: list[tuple[str, bytes]]) -> asyncio.Future[Any]:
        return self._ack()

    async def send_together(self, topic: str, key: bytes, items: list[tuple[bytes, list[tuple[str, bytes]]]]) -> asyncio.Future[Any]:
        return self._ack()


@dataclass
class Emits:
    outs: list[Out]
    name: str = "emit"
    topics: Topics = Topics(("t.in",), None, None)
    input_type: Any = Admitted
    ordered: bool = True

    async def handle(self, message: Admitted) -> AsyncIterator[Out]:
        for out in self.outs:
            yield out


def answer(rid: str, *, together: bool) -> list[Out]:
    address = address_of(helpers.admitted(helpers.request(rid)))
    assert address is not None
    chunk = address.chunk(0, "hello")
    done = address.done(chunks=1, digest="d", finish=FinishReason.stop, usage=Usage(1, 1), timings={})
    return [Out(REPLIES, rid, chunk, with_next=together), Out(REPLIES, rid, done)]


def record() -> ConsumerRecord[bytes, bytes]:
    value = codec.encode(helpers.admitted(helpers.request("r1")))
    return ConsumerRecord("t.in", 0, 7, 0, 0, None, value, None, 0, len(value), [])


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.mark.asyncio
@pytest.mark.parametrize("together", [False, True])
async def test_a_reply_reaches_a_reader_here_only_once_acknowledged(together: bool) -> None:
    got: list[object] = []
    stop = local_replies.listen(REPLIES, got.append)
    try:
        producer = Producer()
        outs = answer("r1", together=together)
        task = asyncio.create_task(Handling(Emits(outs), Settings(), producer).process(record(), None))  # type: ignore[arg-type]
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
        producer = Producer()
        handling = Handling(Emits(answer("r1", together=True)), Settings(), producer)  # type: ignore[arg-type]
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
