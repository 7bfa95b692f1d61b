"""A request end to end through the real broker and model: streaming, concurrency, dead letters,
cancellation."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaProducer

from pipeline import kafka
from pipeline.sdk import Client, RequestFailed
from pipeline.settings import Settings
from topics import codec, registry
from topics.dlq import DeadLetter
from topics.errors import ErrorCode
from topics.stream import EMPTY_DIGEST, Chunk, Done, Failed, StreamEvent, digest_step

pytestmark = pytest.mark.asyncio(loop_scope="session")


def digest(texts: list[str]) -> str:
    value = EMPTY_DIGEST
    for text in texts:
        value = digest_step(value, text)
    return value

HELLO = [{"role": "user", "content": "Say hello in five words."}]


async def test_one_request_streams_numbered_chunks_to_one_done(stack: Settings) -> None:
    async with Client(stack) as client:
        stream = client.stream(messages=HELLO, max_tokens=12)
        chunks = [chunk async for chunk in stream]
    done = stream.done
    assert done is not None and chunks
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert done.chunks == len(chunks) and done.digest == digest([c.text for c in chunks])
    assert 0 < done.usage.completion_tokens <= 12 and done.usage.prompt_tokens > 5
    assert {"ingest", "route", "prefill.local", "decode.local", "emit", "total"} <= set(done.timings)
    assert done.id == f"default/{stream.id}" and done.tenant == "default"


async def test_twenty_concurrent_requests_all_finish_without_gaps(stack: Settings) -> None:
    async with Client(stack) as client:

        async def one(i: int) -> tuple[list[Chunk], Done]:
            stream = client.stream(messages=[{"role": "user", "content": f"Name a colour ({i})."}], max_tokens=6)
            chunks = [c async for c in stream]
            assert stream.done is not None
            return chunks, stream.done

        results = await asyncio.gather(*(one(i) for i in range(20)))
    for chunks, done in results:
        assert [c.seq for c in chunks] == list(range(done.chunks))
        assert done.digest == digest([c.text for c in chunks])


async def test_a_refused_request_gets_a_terminal_error(stack: Settings) -> None:
    async with Client(stack) as client:
        with pytest.raises(RequestFailed) as caught:
            await client.complete(messages=HELLO, max_tokens=stack.limits.max_tokens_cap + 1)
    assert caught.value.code is ErrorCode.invalid_request


async def _read_until(consumer, wanted, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = await consumer.getmany(timeout_ms=200)
        for records in batch.values():
            for record in records:
                found = wanted(record)
                if found is not None:
                    return found
    raise AssertionError("the expected record did not arrive")


async def test_a_malformed_message_is_dead_lettered_and_its_request_gets_an_error(stack: Settings) -> None:
    rid = uuid.uuid4().hex
    dlq = await kafka.broadcast_consumer(stack, (registry.DLQ,), "test-dlq")
    replies = await kafka.broadcast_consumer(stack, ("llm.responses.sdk",), "test-replies")
    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka.bootstrap)
    await producer.start()
    body = b'{"kind":"request.v2","id":"%s","reply_to":"llm.responses.sdk","model":7}' % rid.encode()
    try:
        await producer.send_and_wait(registry.REQUESTS, body, key=rid.encode())
    finally:
        await producer.stop()
    terminal = await _read_until(replies, lambda r: codec.decode(r.value, StreamEvent) if r.key == rid.encode() else None)
    letter = await _read_until(dlq, lambda r: codec.decode(r.value, DeadLetter) if r.key == rid.encode() else None)
    await dlq.stop()
    await replies.stop()
    assert isinstance(terminal, Failed) and terminal.code is ErrorCode.invalid_request and terminal.id == rid
    assert letter.stage == "ingest" and letter.topic == registry.REQUESTS and letter.error_type == "SchemaError"
    assert "$.model" in letter.error and letter.payload_bytes == len(body)


async def test_abandoning_a_stream_cancels_decode(stack: Settings) -> None:
    watch = await kafka.broadcast_consumer(stack, ("llm.responses.sdk",), "test-watch")
    async with Client(stack) as client:
        async with client.stream(messages=[{"role": "user", "content": "Write a long story about a dragon."}], max_tokens=400) as stream:
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
        rid = f"default/{stream.id}"
    terminal = await _read_until(
        watch,
        lambda r: e if r.key == rid.encode() and not isinstance(e := codec.decode(r.value, StreamEvent), Chunk) else None,
    )
    await watch.stop()
    assert isinstance(terminal, Failed) and terminal.code is ErrorCode.cancelled
    assert terminal.usage.completion_tokens < 100
