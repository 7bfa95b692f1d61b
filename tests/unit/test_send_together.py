"""Outputs a stage marks `with_next` travel with the next one as one record batch, which the broker
appends whole or not at all, so a terminal event in it does not wait for the chunks before it
(pipeline/handling.py). Where they cannot (another topic, a batch too big), they go one by one and the
terminal event waits for the chunks' acknowledgements, as before."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord

from pipeline.handling import Handling
from pipeline.settings import Settings
from pipeline.stage import Out, address_of
from pipeline.topology import Topics
from tests.unit import helpers
from topics import codec, registry
from topics.hops import Admitted
from topics.stream import Done, FinishReason, StreamEvent, Usage

STREAM = "t.stream"


class Producer:
    """Acknowledges nothing until told: a send's ack resolves when `release()` is called."""

    def __init__(self, fits: bool = True) -> None:
        self.fits = fits
        self.calls: list[tuple[str, list[str]]] = []  # ("one" | "batch", [kinds])
        self.pending: list[asyncio.Future[Any]] = []

    def _ack(self) -> asyncio.Future[Any]:
        ack = asyncio.get_running_loop().create_future()
        self.pending.append(ack)
        return ack

    async def send(self, topic: str, value: bytes, *, key: bytes, headers: list[tuple[str, bytes]]) -> asyncio.Future[Any]:
        self.calls.append(("one", [_kind(value)]))
        return self._ack()

    async def send_together(self, topic: str, key: bytes, items: list[tuple[bytes, list[tuple[str, bytes]]]]) -> asyncio.Future[Any] | None:
        if not self.fits:
            return None
        self.calls.append(("batch", [_kind(value) for value, _ in items]))
        return self._ack()

    def release(self) -> None:
        for ack in self.pending:
            if not ack.done():
                ack.set_result(None)


def _kind(value: bytes) -> str:
    return "done" if isinstance(codec.decode(value, StreamEvent), Done) else "chunk"


@dataclass
class Replay:
    """Yields the outputs it is given."""

    outs: list[Out]
    name: str = "replay"
    topics: Topics = Topics(("t.in",), None, STREAM)
    input_type: Any = Admitted
    ordered: bool = False

    async def handle(self, message: Admitted) -> AsyncIterator[Out]:
        for out in self.outs:
            yield out


def answer(rid: str, recorded: list[str], *, chunks: int = 2, topic_between: str | None = None) -> list[Out]:
    address = address_of(helpers.admitted(helpers.request(rid)))
    assert address is not None

    def note(what: str):  # type: ignore[no-untyped-def]
        async def acked() -> None:
            recorded.append(what)
        return acked

    outs = [Out(STREAM, rid, address.chunk(i, f"w{i}"), acked=note(f"chunk {i}"), with_next=True) for i in range(chunks)]
    if topic_between is not None:
        outs.append(Out(topic_between, rid, address.chunk(9, "elsewhere")))
    done = address.done(chunks=chunks, digest="d", finish=FinishReason.stop, usage=Usage(1, chunks), timings={})
    return [*outs, Out(STREAM, rid, done, acked=note("done"))]


def record() -> ConsumerRecord[bytes, bytes]:
    value = codec.encode(helpers.admitted(helpers.request("r1")))
    return ConsumerRecord("t.in", 0, 7, 0, 0, None, value, None, 0, len(value), [])


async def run(producer: Producer, outs: list[Out]) -> asyncio.Task[str]:
    handling = Handling(Replay(outs), Settings(), producer)  # type: ignore[arg-type]
    task = asyncio.create_task(handling.process(record(), None))
    for _ in range(20):
        await asyncio.sleep(0)
    return task


@pytest.mark.asyncio
async def test_chunks_and_their_terminal_event_go_as_one_batch_without_waiting_for_acks() -> None:
    producer, recorded = Producer(), []
    task = await run(producer, answer("r1", recorded))
    assert producer.calls == [("batch", ["chunk", "chunk", "done"])]  # sent before any acknowledgement
    assert recorded == [] and not task.done()
    producer.release()
    assert await task == "ok"
    assert recorded == ["chunk 0", "chunk 1", "done"]  # each output's `acked`, in order, after the batch's


@pytest.mark.asyncio
async def test_a_group_too_big_for_one_batch_goes_one_by_one_and_the_terminal_waits() -> None:
    producer, recorded = Producer(fits=False), []
    task = await run(producer, answer("r1", recorded))
    assert producer.calls == [("one", ["chunk"]), ("one", ["chunk"])]  # the Done waits for their acks
    producer.release()
    for _ in range(20):
        await asyncio.sleep(0)
    assert producer.calls[-1] == ("one", ["done"])
    producer.release()
    assert await task == "ok" and recorded == ["chunk 0", "chunk 1", "done"]


@pytest.mark.asyncio
async def test_an_output_for_another_topic_in_between_breaks_the_group() -> None:
    producer, recorded = Producer(), []
    task = await run(producer, answer("r1", recorded, chunks=1, topic_between=registry.HEALTH))
    assert producer.calls == [("one", ["chunk"]), ("one", ["chunk"])]
    producer.release()
    for _ in range(20):
        await asyncio.sleep(0)
    assert producer.calls[-1] == ("one", ["done"])
    producer.release()
    assert await task == "ok"


@pytest.mark.asyncio
async def test_an_output_marked_with_next_at_the_end_is_still_sent() -> None:
    producer, recorded = Producer(), []
    outs = answer("r1", recorded)[:-1]  # the stage stopped after the last chunk
    task = await run(producer, outs)
    assert producer.calls == [("batch", ["chunk", "chunk"])]
    producer.release()
    assert await task == "ok" and recorded == ["chunk 0", "chunk 1"]

