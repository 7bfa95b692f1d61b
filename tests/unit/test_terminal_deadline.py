"""A terminal event that waits out an outage is cut off at its request's own deadline, which it carries
(a batch line's 900 s, not a default 300 s), and a stage that has put the request's ending on the reply
topic already (emit) is not made to send a second, contradictory one (pipeline/handling.py): neither past
the deadline nor when a bug after its ending (storing the answer in the cache) dead-letters the message;
nor, once the runner sent that deadline ending itself, does emit send another after it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.exceptions import ResponseError

from pipeline import handling
from pipeline.cache import keys
from pipeline.cache.exact import MemoryExactTier, RedisExactTier
from pipeline.errors import InfraUnavailable
from pipeline.handling import Handling
from pipeline.settings import Settings
from pipeline.stage import Address, Out
from pipeline.stages.emit import EmitStage
from pipeline.state import MemoryStateStore
from pipeline.topology import Topics
from tests.unit.cache.test_exact import Refusing
from tests.unit.fakes import HeldAcks, record_of
from tests.unit.helpers import SETTINGS, node
from topics import codec
from topics.cache import Entry, Ticket
from topics.dlq import DeadLetter
from topics.errors import ErrorCode
from topics.stream import EMPTY_DIGEST, Done, Failed, FinishReason, StreamEvent, Usage
from topics.usage import UsageRecord

REPLY = "llm.responses.sdk"


class RedisAway:
    """Emit's place in the graph (terminal events go to the reply topic) with its store away for good."""

    name = "emit"
    topics = Topics(("llm.checked",), None, None)
    input_type: Any = StreamEvent
    ordered = True

    def __init__(self, ended: bool = False) -> None:
        self.ended = ended
        self.tries = 0

    async def handle(self, message: StreamEvent) -> AsyncIterator[Out]:
        self.tries += 1
        raise InfraUnavailable("redis state store: ConnectionError")
        yield  # an async generator, as stages are

    def has_ended(self, state_id: str) -> bool:
        return self.ended

    def note_ended(self, state_id: str) -> None:
        self.ended = True


def done(age_s: float, deadline_s: float) -> Done:
    address = Address("default/r1", REPLY, "default", "m", time.time() - age_s, deadline_s)
    return address.done(chunks=0, digest="", finish=FinishReason.stop, usage=Usage(), timings={})


def sent_terminals(producer: HeldAcks) -> list[object]:
    return [codec.decode(value, StreamEvent) for _, values in producer.calls for value in values]


@pytest.mark.asyncio
async def test_a_terminal_carries_its_requests_deadline() -> None:
    assert codec.decode(codec.encode(done(0, 900.0)), StreamEvent).deadline_s == 900.0  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_a_batch_lines_ending_is_not_cut_off_at_300_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handling, "FIRST_BACKOFF_S", 0.01)
    stage, producer = RedisAway(), HeldAcks()
    run = Handling(stage, Settings(), producer)  # type: ignore[arg-type]
    task = asyncio.create_task(run.process(record_of(done(age_s=400, deadline_s=900), "llm.checked"), None))
    await asyncio.sleep(0.5)
    assert stage.tries > 1 and not task.done() and sent_terminals(producer) == []  # still waiting the outage out
    task.cancel()


@pytest.mark.asyncio
@pytest.mark.parametrize(("ended", "expected"), [(False, 1), (True, 0)])
async def test_past_its_deadline_a_request_gets_a_deadline_ending_only_if_it_has_none(ended: bool, expected: int) -> None:
    stage, producer = RedisAway(ended), HeldAcks()
    run = Handling(stage, Settings(), producer)  # type: ignore[arg-type]
    task = asyncio.create_task(run.process(record_of(done(age_s=1000, deadline_s=900), "llm.checked"), None))
    while not task.done():
        producer.release()
        await asyncio.sleep(0.01)
    assert await task == "expired"
    terminals = sent_terminals(producer)
    assert len(terminals) == expected
    assert all(isinstance(t, Failed) and t.code.value == "deadline_exceeded" for t in terminals)


class StoreAway(MemoryStateStore):
    """Redis away (`away`), then back."""

    away = True

    async def take(self, key: str, owner: str) -> dict[str, bytes]:
        if self.away:
            raise InfraUnavailable("redis state store: ConnectionError")
        return await super().take(key, owner)


async def handled(run: Handling, producer: HeldAcks, message: Done | Failed, offset: int) -> str:
    task = asyncio.create_task(run.process(record_of(message, "llm.checked", offset=offset), None))
    while not task.done():
        producer.release()
        await asyncio.sleep(0.01)
    return await task


@pytest.mark.asyncio
@pytest.mark.parametrize("back", [False, True])
async def test_after_the_runner_ended_a_request_at_its_deadline_emit_sends_no_second_ending(back: bool) -> None:
    """Decode's Done reaches emit past the deadline while Redis is away: the runner sends
    `deadline_exceeded` straight to the reply topic. Then a later ending of the same request (decode's
    Done sent again, or its own deadline ending) arrives, with Redis still away or back: emit must know
    the request has its ending (it was told: `Ending.note_ended`), and only record it."""
    store, producer = StoreAway(), HeldAcks()
    stage = EmitStage(SETTINGS, node("emit").topics, store)
    run = Handling(stage, SETTINGS, producer)
    ending = done(age_s=1000, deadline_s=900)
    assert await handled(run, producer, ending, 1) == "expired"
    store.away = not back
    address = Address("default/r1", REPLY, "default", "m", ending.created_at, 900.0)
    late = address.failed(ErrorCode.deadline_exceeded, "decode's own deadline ending")
    assert await handled(run, producer, late, 2) == ("ok" if back else "expired")
    sent = [codec.decode(value, StreamEvent | UsageRecord) for _, values in producer.calls for value in values]
    terminals = [t for t in sent if isinstance(t, Done | Failed)]  # and, Redis back, the usage record
    assert len(terminals) == 1 and isinstance(terminals[0], Failed) and terminals[0].code is ErrorCode.deadline_exceeded
    if back:  # recorded once the store answered: a successor drops a redelivery too
        assert "terminal" in await store.read("default/r1#emit")


class BrokenTier(MemoryExactTier):
    """An exact tier with a bug: storing raises."""

    async def put(self, entry: Entry) -> None:
        raise RuntimeError("a bug")


def answered(age_s: float = 0.0) -> Done:
    """An empty answer emit may store (its ticket is in its tenant and model's scope)."""
    address = Address("default/r1", REPLY, "default", "m", time.time() - age_s, 300.0,
                      Ticket(keys.scope("default", "m") + "0" * 64, "c", 60.0))
    return address.done(chunks=0, digest=EMPTY_DIGEST, finish=FinishReason.stop, usage=Usage(), timings={})


@pytest.mark.asyncio
@pytest.mark.parametrize(("tier", "outcome"), [
    (BrokenTier(), "dead_letter"), (RedisExactTier(Refusing(ResponseError("READONLY"))), "ok"),  # type: ignore[arg-type]
])
async def test_a_failure_after_emits_done_gives_the_client_no_second_ending(tier: object, outcome: str) -> None:
    """Review found it (session 47): Redis refused the cache's SET (READONLY after a failover) after emit had
    sent the Done and the usage record; the runner dead-lettered the message and sent `Failed(internal)`
    after the Done. A refusal is a miss now (the exact tier); a bug there still goes to the dead-letter
    topic, without a second ending."""
    stage, producer = EmitStage(SETTINGS, node("emit").topics, answers=tier), HeldAcks()  # type: ignore[arg-type]
    run = Handling(stage, SETTINGS, producer)
    task = asyncio.create_task(run.process(record_of(answered(), "llm.checked"), None))
    while not task.done():
        producer.release()
        await asyncio.sleep(0.01)
    assert await task == outcome
    sent = [codec.decode(value, StreamEvent | UsageRecord | DeadLetter)
            for _, values in producer.calls for value in values]
    assert [type(m) for m in sent if isinstance(m, Done | Failed)] == [Done]
    assert sum(isinstance(m, DeadLetter) for m in sent) == (outcome == "dead_letter")
