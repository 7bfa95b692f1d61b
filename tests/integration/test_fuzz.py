"""Hostile records on every input topic of the running pipeline: each one is dead-lettered (a small
record naming its topic, partition and offset), a salvageable request gets an error terminal event,
and the stages keep serving requests afterwards (DESIGN.md, I3)."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from pipeline import kafka
from pipeline.sdk import Client
from pipeline.settings import Settings
from topics import codec

pytestmark = pytest.mark.asyncio(loop_scope="session")

INPUT_TOPICS = frozenset({"llm.requests", "llm.admitted", "llm.guarded", "llm.tokens", "llm.checked", "llm.control"})
INPUT_PREFIXES = ("llm.routed.", "llm.prefilled.")
SDK_REPLIES = "llm.responses.sdk"
DEAD_LETTER_MAX_BYTES = 8 * 1024
WAIT_S = 60.0
BAD_BODY = b'{"kind":"fuzz.v0"}'  # invalid on every topic: the header records test the header, not the body

Headers = list[tuple[str, bytes | None]]


@dataclass(frozen=True)
class Hostile:
    label: str
    value: bytes | None
    headers: Headers | None = None
    salvageable_id: str | None = None  # a request id the runner can read: it must get an error terminal


@dataclass(frozen=True)
class Produced:
    record: Hostile
    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.record.label!r} at {self.topic}:{self.partition}:{self.offset}"

    @property
    def where(self) -> tuple[str, int, int]:
        return (self.topic, self.partition, self.offset)

    @property
    def told(self) -> bool:
        """Whether its request must get an error terminal. Not for `llm.control`: a cancellation that
        cannot be read ends nothing, and its stage reads it outside the request path."""
        return self.record.salvageable_id is not None and self.topic != "llm.control"


def _input_topics(settings: Settings) -> list[str]:
    names = [spec.name for spec in kafka.topic_specs(settings)]
    return [n for n in names if n in INPUT_TOPICS or n.startswith(INPUT_PREFIXES)]


def _hostile_records(settings: Settings, run: str) -> list[Hostile]:
    """The same records for every topic, except the salvageable id, which names its topic's run."""
    valid = codec.encode(Client(settings).request(prompt="hello", max_tokens=4))
    shape = json.loads(valid)
    rng = random.Random(7)
    return [
        Hostile("5,000 nested [", b"[" * 5_000),
        Hostile("100,000 nested [", b"[" * 100_000),
        Hostile("5,000 nested [ in a field", b'{"kind":"fuzz.v0","x":' + b"[" * 5_000 + b"]" * 5_000 + b"}"),
        Hostile("100,000 nested [ in a field", b'{"kind":"fuzz.v0","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        Hostile("kind request.v0", b'{"kind":"request.v0"}'),
        Hostile("kind request.v1", b'{"kind":"request.v1"}'),
        Hostile("kind chunk.v9", b'{"kind":"chunk.v9"}'),
        Hostile("truncated request", valid[: len(valid) // 2]),
        Hostile("empty value", b""),
        Hostile("tombstone", None),
        *(Hostile(f"random bytes {i}", rng.randbytes(rng.randint(0, 4096))) for i in range(20)),
        Hostile("traceparent None", BAD_BODY, [("traceparent", None)]),
        Hostile("traceparent 100 KB", BAD_BODY, [("traceparent", b"x" * 100_000)]),
        Hostile("tracestate binary", BAD_BODY, [("tracestate", b"\xff\xfe")]),
        Hostile("id of 600 KB", json.dumps({**shape, "id": "a" * 600_000}).encode()),
        Hostile("id of 65 chars", json.dumps({**shape, "id": "b" * 65, "reply_to": "llm.responses.bridge"}).encode()),
        Hostile(
            "salvageable request, wrong version",
            json.dumps({"kind": "request.v0", "id": run, "reply_to": SDK_REPLIES, "model": 7}).encode(),
            salvageable_id=run,
        ),
    ]


async def _produce(settings: Settings, topics: list[str]) -> list[Produced]:
    produced = []
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap)
    await producer.start()
    try:
        for n, topic in enumerate(topics):
            for i, record in enumerate(_hostile_records(settings, f"fuzz-{uuid.uuid4().hex[:12]}-{n}")):
                key = f"fuzz-{i}".encode()  # a tombstone needs a key
                sent = await producer.send_and_wait(topic, record.value, key=key, headers=record.headers or [])
                produced.append(Produced(record, sent.topic, sent.partition, sent.offset))
    finally:
        await producer.stop()
    return produced


def _names_request(event_id: object, rid: str) -> bool:
    """A terminal carries the client's id, or the pipeline's `<tenant>/<client id>` (topics.hops)."""
    return isinstance(event_id, str) and (event_id == rid or event_id.endswith("/" + rid))


async def _collect(
    settings: Settings, produced: list[Produced], timeout_s: float
) -> tuple[dict[tuple[str, int, int], int], set[str]]:
    """Dead letters by (topic, partition, offset) -> record size, and the salvaged ids that got an
    error terminal on the SDK's reply topic; reads both topics from the beginning until all are in."""
    wanted = {p.where for p in produced}
    ids = {p.record.salvageable_id for p in produced if p.told and p.record.salvageable_id}
    letters: dict[tuple[str, int, int], int] = {}
    terminals: set[str] = set()
    consumer = AIOKafkaConsumer(
        "llm.dlq", SDK_REPLIES, bootstrap_servers=settings.kafka.bootstrap, group_id=None, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (wanted <= letters.keys() and ids <= terminals):
            batch = await consumer.getmany(timeout_ms=200)
            for records in batch.values():
                for record in records:
                    try:
                        body = msgspec.json.decode(record.value or b"")
                    except msgspec.DecodeError:
                        continue  # not ours to judge here
                    if not isinstance(body, dict):
                        continue
                    if record.topic == "llm.dlq":
                        where = (body.get("topic"), body.get("partition"), body.get("offset"))
                        if where in wanted:
                            size = len(record.value or b"") + len(record.key or b"")
                            letters[where] = max(size, letters.get(where, 0))  # type: ignore[index]
                    elif str(body.get("kind", "")).startswith("error.v"):
                        terminals |= {rid for rid in ids if _names_request(body.get("id"), rid)}
    finally:
        await consumer.stop()
    return letters, terminals


async def test_hostile_records_are_dead_lettered_and_the_stages_keep_running(stack: Settings) -> None:
    topics = _input_topics(stack)
    assert "llm.requests" in topics, topics
    started = time.monotonic()
    produced = await _produce(stack, topics)

    letters, terminals = await _collect(stack, produced, WAIT_S)

    missing = [str(p) for p in produced if p.where not in letters]
    summary = f"{len(missing)} of {len(produced)} records not dead-lettered in {WAIT_S:.0f} s"
    assert not missing, summary + ":\n" + "\n".join(missing)
    large = [f"{p}: {letters[p.where]} bytes" for p in produced if letters[p.where] >= DEAD_LETTER_MAX_BYTES]
    assert not large, "dead letters of 8 KB or more (key and value):\n" + "\n".join(large)
    untold = [str(p) for p in produced if p.told and p.record.salvageable_id not in terminals]
    assert not untold, f"no error terminal on {SDK_REPLIES} for:\n" + "\n".join(untold)

    left = max(10.0, 85.0 - (time.monotonic() - started))
    async with Client(stack) as client:  # every stage still consumes: one request goes end to end
        answer = await asyncio.wait_for(client.complete(prompt="Say hello.", max_tokens=4), timeout=left)
    assert answer.done.chunks >= 1
