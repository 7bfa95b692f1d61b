"""Refusals under a client's bare id, from ingest's record to the reply topic: each refused record gets
exactly one terminal event, however many records share the id (pipeline/handling.py stamps the record
on the refusal, postguard passes it on, emit keeps one ending per record)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError

from pipeline.guard.config import GuardSettings
from pipeline.guard.stream_check import Step
from pipeline.handling import Handling
from pipeline.stages.emit import EmitStage
from pipeline.stages.ingest import IngestStage
from pipeline.stages.postguard import PostguardStage
from pipeline.state import MemoryStateStore
from tests.unit.fakes import HeldAcks, record_of, run_handler
from tests.unit.gateway.helpers import rig
from tests.unit.helpers import SETTINGS, node, request
from topics import codec, registry
from topics.errors import ErrorCode
from topics.requests import ChatMessage
from topics.stream import Failed, StreamEvent

pytestmark = pytest.mark.asyncio
AUTH = replace(SETTINGS, gateway=replace(SETTINGS.gateway, auth_required=True))


class PassGuard:
    """An output guard that flags nothing (a refusal has no text to check)."""

    def watch(self, model: str) -> None:
        return None

    def push(self, state: Any, text: str) -> Step:
        return Step(text)

    def finish(self, state: Any) -> Step:
        return Step("")


class Producer(HeldAcks):
    """Records the topic of each message it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, bytes]] = []

    async def send(self, topic: str, value: bytes, *, key: bytes, headers: list[tuple[str, bytes]]) -> asyncio.Future[Any]:
        self.sent.append((topic, value))
        return await super().send(topic, value, key=key, headers=headers)


class Pipeline:
    """Ingest through the runner's handling, then postguard (the guarded profile) or not, then emit."""

    def __init__(self, guarded: bool) -> None:
        self.rig = rig()
        self.producer = Producer()
        self.ingest = Handling(IngestStage(AUTH, node("ingest").topics, self.rig.gateway), AUTH, self.producer)
        postguard = PostguardStage(GuardSettings(), PassGuard(), node("postguard").topics)  # type: ignore[arg-type]
        self.postguard = postguard if guarded else None
        self.emit = EmitStage(SETTINGS, node("emit").topics, MemoryStateStore())

    async def replies(self, offset: int, message: object, value: bytes | None = None) -> list[Failed]:
        """What the client gets for the record of `message` at `offset` of llm.requests."""
        self.producer.sent.clear()
        record = record_of(message, registry.REQUESTS, offset=offset, value=value)
        task = asyncio.create_task(self.ingest.process(record, None))
        while not task.done():
            self.producer.release()
            await asyncio.sleep(0.01)
        events = [codec.decode(v, StreamEvent) for topic, v in self.producer.sent if topic == registry.TOKENS]
        if self.postguard is not None:
            events = [o.value for e in events for o in await run_handler(self.postguard, e)]
        return [o.value for e in events for o in await run_handler(self.emit, e) if o.topic == e.reply_to]  # type: ignore[misc]


@pytest.mark.parametrize("guarded", [True, False])
async def test_a_request_refused_again_under_the_same_id_gets_its_terminal_event(guarded: bool) -> None:
    """A 429 says "send it again later": the same bytes sent again under the same id were refused again,
    and the refusal was dropped as a redelivery of the first, by postguard and by emit."""
    pipeline = Pipeline(guarded)
    key, _ = await pipeline.rig.keys.create("acme", rpm=1)
    await pipeline.replies(0, request("warm", api_key=key))  # the minute's one request
    refused = request("x", api_key=key)
    other = request("x", api_key=key, messages=(ChatMessage(role="user", content="other"),))
    first, again, changed = [await pipeline.replies(offset, r) for offset, r in ((1, refused), (2, refused), (3, other))]
    for got in (first, again, changed):
        assert [(f.id, f.code.value) for f in got] == [("x", "rate_limited")]
    assert len({f.nonce for f in first + again + changed}) == 3
    assert await pipeline.replies(1, refused) == []  # the first record again (an offset reset): no second ending


@pytest.mark.parametrize("guarded", [True, False])
async def test_a_stranger_refused_under_a_client_id_does_not_swallow_that_clients_refusal(guarded: bool) -> None:
    pipeline = Pipeline(guarded)
    key, _ = await pipeline.rig.keys.create("acme", rpm=1)
    await pipeline.replies(0, request("warm", api_key=key))
    stranger = await pipeline.replies(1, request("y", api_key=key[:-4] + "AAAA"))
    acme = await pipeline.replies(2, request("y", api_key=key))
    assert [f.code.value for f in stranger + acme] == ["unauthorized", "rate_limited"]


async def test_unreadable_records_naming_one_id_each_get_their_terminal_event() -> None:
    """The runner's own refusal of a record it cannot read names the id it salvaged, a client's bare id."""
    pipeline = Pipeline(guarded=True)
    value = b'{"kind": "request.v2", "id": "z", "reply_to": "llm.responses.sdk", "model": 5}'
    first = await pipeline.replies(1, None, value)
    second = await pipeline.replies(2, None, value)
    assert [(f.id, f.code.value) for f in first + second] == [("z", "invalid_request")] * 2
    assert await pipeline.replies(1, None, value) == []


class FirstAckRefused(HeldAcks):
    """The broker refuses the first record it is given (an outage), then takes everything."""

    def __init__(self) -> None:
        super().__init__()
        self.sends = 0

    async def send(self, topic: str, value: bytes, *, key: bytes, headers: list[tuple[str, bytes]]) -> asyncio.Future[Any]:
        ack = await super().send(topic, value, key=key, headers=headers)
        self.sends += 1
        if self.sends == 1:
            ack.set_exception(KafkaConnectionError("broker away"))
        return ack


async def test_a_group_of_refusals_under_one_id_that_fails_gives_each_record_its_ending() -> None:
    """Records of one key are handled as a group; refusals under one bare id share the key but not their
    state. A failed group was reset for its first message only, and the second, marked finished in
    memory, was then dropped on its own try: its client got nothing."""
    def refused(nonce: str) -> Failed:
        return Failed(id="x", reply_to=registry.reply_topic("sdk"), code=ErrorCode.rate_limited, message="slow down",
                      retriable=True, tenant="", model="m", created_at=1.0, nonce=nonce)

    producer = FirstAckRefused()
    run = Handling(EmitStage(SETTINGS, node("emit").topics, MemoryStateStore()), SETTINGS, producer)  # type: ignore[arg-type]
    group = [record_of(refused(n), "llm.checked", offset=o, key=b"x") for n, o in (("a", 5), ("b", 6))]
    task = asyncio.create_task(run.process_group(group, None, None))
    for _ in range(500):
        producer.release()
        if task.done():
            break
        await asyncio.sleep(0.01)
    assert task.result() == ["ok", "ok"]
    sent = [v for _, values in producer.calls for v in values if b'"kind":"usage' not in v]  # endings, not usage records
    assert {codec.decode(v, StreamEvent).nonce for v in sent} == {"a", "b"}  # type: ignore[union-attr]
