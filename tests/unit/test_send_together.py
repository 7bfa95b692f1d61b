"""Outputs a stage marks `with_next` travel with the next one as one record batch, which the broker
appends whole or not at all, so a terminal event in it does not wait for the chunks in it
(pipeline/handling.py), only for chunks sent before the batch. Where they cannot (another topic, a batch too big), they go one by one and the
terminal event waits for the chunks' acknowledgements, as before."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError

from pipeline.errors import InfraUnavailable
from pipeline.handling import Handling
from pipeline.settings import Settings
from pipeline.stage import Out, address_of
from tests.unit import helpers
from tests.unit.fakes import HeldAcks, Yields, record_of
from topics import codec, registry
from topics.errors import ErrorCode
from topics.stream import Done, Failed, FinishReason, StreamEvent, Usage

STREAM = "t.stream"


def kinds(producer: HeldAcks) -> list[tuple[str, list[str]]]:
    return [(how, ["done" if isinstance(codec.decode(v, StreamEvent), Done) else "chunk" for v in values]) for how, values in producer.calls]


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


async def run(producer: HeldAcks, outs: list[Out]) -> asyncio.Task[str]:
    handling = Handling(Yields(outs), Settings(), producer)  # type: ignore[arg-type]
    task = asyncio.create_task(handling.process(record_of(helpers.admitted(helpers.request("r1"))), None))
    for _ in range(20):
        await asyncio.sleep(0)
    return task


@pytest.mark.asyncio
async def test_chunks_and_their_terminal_event_go_as_one_batch_without_waiting_for_acks() -> None:
    producer, recorded = HeldAcks(), []
    task = await run(producer, answer("r1", recorded))
    assert kinds(producer) == [("batch", ["chunk", "chunk", "done"])]  # sent before any acknowledgement
    assert recorded == [] and not task.done()
    producer.release()
    assert await task == "ok"
    assert recorded == ["chunk 0", "chunk 1", "done"]  # each output's `acked`, in order, after the batch's


@pytest.mark.asyncio
async def test_a_batch_with_a_terminal_event_waits_for_the_chunks_sent_before_it() -> None:
    """A stream's chunks go one by one as they come; its last chunk and terminal event go as one batch only
    once those are acknowledged. After a broker outage the producer is renewed, and a batch sent on the new
    one overtook chunks still unacknowledged on the old (the full chaos profile, session 31: emit got a
    `Done` of 125 chunks with 112..124 missing, and ended the stream `stream_incomplete`)."""
    producer, recorded = HeldAcks(), []
    outs = answer("r1", recorded)
    outs[0] = dataclasses.replace(outs[0], with_next=False)  # sent alone, as a stream's earlier chunks are
    task = await run(producer, outs)
    assert kinds(producer) == [("one", ["chunk"])]  # the batch waits for its acknowledgement
    producer.release()
    for _ in range(20):
        await asyncio.sleep(0)
    assert kinds(producer)[-1] == ("batch", ["chunk", "done"])
    producer.release()
    assert await task == "ok" and recorded == ["chunk 0", "chunk 1", "done"]


@pytest.mark.asyncio
async def test_a_group_too_big_for_one_batch_goes_one_by_one_and_the_terminal_waits() -> None:
    producer, recorded = HeldAcks(fits=False), []
    task = await run(producer, answer("r1", recorded))
    assert kinds(producer) == [("one", ["chunk"]), ("one", ["chunk"])]  # the Done waits for their acks
    producer.release()
    for _ in range(20):
        await asyncio.sleep(0)
    assert kinds(producer)[-1] == ("one", ["done"])
    producer.release()
    assert await task == "ok" and recorded == ["chunk 0", "chunk 1", "done"]


@pytest.mark.asyncio
async def test_an_output_for_another_topic_in_between_breaks_the_group() -> None:
    producer, recorded = HeldAcks(), []
    task = await run(producer, answer("r1", recorded, chunks=1, topic_between=registry.HEALTH))
    assert kinds(producer) == [("one", ["chunk"]), ("one", ["chunk"])]
    producer.release()
    for _ in range(20):
        await asyncio.sleep(0)
    assert kinds(producer)[-1] == ("one", ["done"])
    producer.release()
    assert await task == "ok"


@pytest.mark.asyncio
async def test_an_output_marked_after_acks_waits_for_the_outputs_before_it() -> None:
    """Prefill's hand-off to decode goes only once its chunk 0 is on the topic: decode's chunk 1 overtook a
    chunk 0 whose produce was retried across a broker restart (session 39's CI, output-guard profile)."""
    producer = HeldAcks()
    address = address_of(helpers.admitted(helpers.request("r1")))
    assert address is not None
    outs = [Out(STREAM, "r1", address.chunk(0, "w0")), Out("t.handoff", "r1", address.chunk(1, "w1"), after_acks=True)]
    task = await run(producer, outs)
    assert kinds(producer) == [("one", ["chunk"])]  # the hand-off waits for chunk 0's acknowledgement
    producer.release()
    for _ in range(20):
        await asyncio.sleep(0)
    assert kinds(producer) == [("one", ["chunk"]), ("one", ["chunk"])]
    producer.release()
    assert await task == "ok"


@pytest.mark.asyncio
async def test_an_output_marked_with_next_at_the_end_is_still_sent() -> None:
    producer, recorded = HeldAcks(), []
    outs = answer("r1", recorded)[:-1]  # the stage stopped after the last chunk
    task = await run(producer, outs)
    assert kinds(producer) == [("batch", ["chunk", "chunk"])]
    producer.release()
    assert await task == "ok" and recorded == ["chunk 0", "chunk 1"]



@pytest.mark.asyncio
async def test_delivered_is_called_once_acknowledged_even_when_an_acked_before_it_failed() -> None:
    """`acked` callbacks run in order and a failed one skips the rest, but what reached the topic is a
    fact a stage may need (emit: a terminal event already there is not sent again on the retry)."""
    producer, recorded, delivered = HeldAcks(), [], []
    outs = answer("r1", recorded)

    async def fails() -> None:
        raise InfraUnavailable("redis state store: ConnectionError")

    outs[0] = dataclasses.replace(outs[0], acked=fails)
    outs[-1] = dataclasses.replace(outs[-1], delivered=lambda: delivered.append("done"))
    task = await run(producer, outs)
    assert delivered == []  # not before the acknowledgement
    producer.release()
    for _ in range(20):
        await asyncio.sleep(0)
    assert delivered == ["done"] and "done" not in recorded
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.asyncio
async def test_refused_is_called_when_the_broker_fails_to_take_an_output() -> None:
    producer, refused, delivered = HeldAcks(), [], []
    address = address_of(helpers.admitted(helpers.request("r1")))
    assert address is not None
    outs = [Out(STREAM, "r1", address.chunk(i, f"w{i}"), refused=lambda i=i: refused.append(i),
                delivered=lambda i=i: delivered.append(i)) for i in range(2)]
    task = await run(producer, outs)
    producer.pending[0].set_exception(KafkaTimeoutError())  # its batch expired in an outage
    producer.pending[1].set_result(None)
    for _ in range(20):
        await asyncio.sleep(0)
    assert (refused, delivered) == ([0], [1])
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class TooLarge(HeldAcks):
    """A producer that refuses one topic's messages as larger than the broker accepts."""

    def __init__(self, topic: str) -> None:
        super().__init__(fits=False)
        self.topic = topic
        self.topics: list[str] = []

    async def send(self, topic: str, value: bytes, *, key: bytes, headers: list[tuple[str, bytes]]) -> asyncio.Future[Any]:
        self.topics.append(topic)
        self.calls.append(("one", [value]))
        if topic == self.topic:
            raise MessageSizeTooLargeError()
        ack = self._ack()
        ack.set_result(None)
        return ack


@pytest.mark.asyncio
async def test_an_output_too_large_for_the_broker_ends_the_request_at_once() -> None:
    """No retry cures it: the record is dead-lettered and the request ends `internal`, instead of the
    message being tried until the request's deadline with its partition held."""
    producer = TooLarge("t.big")
    address = address_of(helpers.admitted(helpers.request("r1")))
    assert address is not None
    outs = [Out("t.big", "r1", address.chunk(0, "x"))]
    task = await run(producer, outs)
    assert await asyncio.wait_for(task, 1.0) == "dead_letter"
    assert producer.topics == ["t.big", registry.DLQ, STREAM]
    failed = codec.decode(producer.calls[-1][1][0], StreamEvent)
    assert isinstance(failed, Failed) and failed.code is ErrorCode.internal
