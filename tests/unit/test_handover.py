"""Handover: a stage's output for a stage of the same process is handled in memory, with the same
errors, dead letters and terminal events as if the broker had carried it (pipeline/handling.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka import TopicPartition

from pipeline.errors import StageError
from pipeline.handling import Handling
from pipeline.sdk import Client
from pipeline.settings import Settings
from pipeline.stage import Out
from pipeline.topology import Topics
from tests.unit import helpers
from tests.unit.fakes import InstantAcks, record_of
from topics import codec, registry
from topics.dlq import DeadLetter
from topics.errors import ErrorCode
from topics.hops import Admitted
from topics.stream import Failed

STREAM = "t.stream"




@dataclass
class Forward:
    """Reads `inputs[0]`, forwards the message with its name added to the timings (or fails as told)."""

    name: str
    topics: Topics
    fail: Exception | None = None
    seen: list[Admitted] = field(default_factory=list)
    input_type: Any = Admitted
    ordered: bool = False

    async def handle(self, message: Admitted) -> AsyncIterator[Out]:
        self.seen.append(message)
        if self.fail is not None:
            raise self.fail
        assert self.topics.forward is not None
        yield Out(self.topics.forward, message.id, Admitted(
            id=message.id, request=message.request, tenant=message.tenant, principal=message.principal,
            admitted_at=message.admitted_at, timings={**message.timings, self.name: 1.0}))


class Named:
    """A stage that is only its name and input topic: enough for `runners_for` to wire handovers."""

    def __init__(self, name: str, inputs: str) -> None:
        self.name, self.topics, self.ordered, self.input_type = name, Topics((inputs,), None, None), False, Admitted


def chain(fail: Exception | None = None) -> tuple[InstantAcks, Forward, Forward, Handling]:
    producer = InstantAcks()
    first = Forward("first", Topics(("t.a",), "t.b", STREAM))
    second = Forward("second", Topics(("t.b",), "t.c", STREAM), fail=fail)
    settings = Settings()
    sender = Handling(first, settings, producer)  # type: ignore[arg-type]
    taker = Handling(second, settings, producer)  # type: ignore[arg-type]
    sender.takers = {"t.b": taker}
    return producer, first, second, sender


def wired_with_generate() -> dict[str, Handling]:
    """Each stage's handling as `runners_for` wires them: the default nodes and a `generate.up` pool."""
    from pipeline.serve import runners_for

    stages = [Named(n.name, n.topics.inputs[0]) for n in helpers.NODES.values()] + [Named("generate.up", "llm.routed.up")]
    runners = runners_for(stages, Settings(), InstantAcks(), "t")  # type: ignore[arg-type]
    return {r.stage.name: r._handling for r in runners}  # type: ignore[misc]


@pytest.mark.asyncio
async def test_a_handed_over_message_never_reaches_the_broker() -> None:
    producer, first, second, sender = chain()
    message = helpers.admitted(helpers.request("r1"), tenant="acme")
    assert await sender.process(record_of(message, "t.a"), None) == "ok"
    assert producer.topics() == ["t.c"]  # nothing on t.b: the second stage took it in hand
    assert second.seen[0].timings == {"ingest": 0.1, "first": 1.0}
    out = codec.decode(producer.sent[0][1], Admitted)
    assert out.timings == {"ingest": 0.1, "first": 1.0, "second": 1.0}


@pytest.mark.asyncio
async def test_without_a_taker_the_output_is_produced() -> None:
    producer, _, second, sender = chain()
    sender.takers = {}
    assert await sender.process(record_of(helpers.admitted(helpers.request("r1")), "t.a"), None) == "ok"
    assert producer.topics() == ["t.b"] and second.seen == []


@pytest.mark.asyncio
async def test_a_taker_at_its_bound_leaves_the_next_message_to_the_broker() -> None:
    producer, _, second, sender = chain()
    taker = sender.takers["t.b"]
    taker.take_limit = 1  # as pipeline.serve bounds generate: its work lasts a whole stream
    release = asyncio.Event()
    forward = second.handle

    async def slow(message: Admitted) -> AsyncIterator[Out]:
        await release.wait()
        async for out in forward(message):
            yield out

    second.handle = slow  # type: ignore[method-assign]
    busy = asyncio.create_task(sender.process(record_of(helpers.admitted(helpers.request("r1")), "t.a"), None))
    while not taker._taking:
        await asyncio.sleep(0)
    second_one = sender.process(record_of(helpers.admitted(helpers.request("r2")), "t.a"), None)
    assert await asyncio.wait_for(second_one, 5.0) == "ok"  # (taken in hand, it would wait for `release`)
    assert producer.topics() == ["t.b"]  # the broker carried the second: the taker was at its bound
    release.set()
    assert await busy == "ok"
    assert producer.topics() == ["t.b", "t.c"] and taker._taking == 0
    assert await sender.process(record_of(helpers.admitted(helpers.request("r3")), "t.a"), None) == "ok"
    assert producer.topics() == ["t.b", "t.c", "t.c"]  # room again: taken in hand


def test_generate_takes_at_most_half_of_max_in_flight_in_hand_and_the_others_without_bound() -> None:
    handlings = wired_with_generate()
    assert handlings["generate.up"].take_limit == Settings().runtime.max_in_flight // 2  # type: ignore[union-attr]
    assert all(h.take_limit is None for name, h in handlings.items() if name != "generate.up")


@pytest.mark.asyncio
async def test_a_refusal_after_a_handover_ends_the_request_with_the_takers_address() -> None:
    producer, _, _, sender = chain(fail=StageError(ErrorCode.rate_limited, "slow down"))
    message = helpers.admitted(helpers.request("r1"), tenant="acme")
    assert await sender.process(record_of(message, "t.a"), None) == "ok"  # the sender's part went well
    assert producer.topics() == [STREAM]
    terminal = codec.decode(producer.sent[0][1], Failed)
    assert (terminal.id, terminal.code, terminal.tenant) == (message.id, ErrorCode.rate_limited, "acme")


@pytest.mark.asyncio
async def test_a_bug_in_the_taker_is_dead_lettered_with_the_handed_over_payload() -> None:
    producer, _, _, sender = chain(fail=ValueError("boom"))
    message = helpers.admitted(helpers.request("r1"), tenant="acme")
    assert await sender.process(record_of(message, "t.a"), None) == "ok"
    assert producer.topics() == [registry.DLQ, STREAM]
    letter = codec.decode(producer.sent[0][1], DeadLetter)
    assert (letter.stage, letter.topic, letter.partition, letter.offset) == ("second", "t.b", -1, -1)
    assert letter.request_id == message.id
    terminal = codec.decode(producer.sent[1][1], Failed)
    assert terminal.code == ErrorCode.internal


@pytest.mark.asyncio
async def test_the_default_wiring_hands_over_to_guard_cache_and_route_only() -> None:
    from pipeline.serve import runners_for

    stages = [Named(n.name, n.topics.inputs[0]) for n in helpers.NODES.values()]
    runners = runners_for(stages, Settings(), InstantAcks(), "t")  # type: ignore[arg-type]
    takers = runners[0]._handling.takers  # type: ignore[union-attr]
    assert sorted(h.stage.name for h in takers.values()) == ["cache", "guard", "route"]
    assert set(takers) == {registry.ADMITTED, registry.SCREENED, registry.GUARDED}


@pytest.mark.asyncio
async def test_a_taker_closes_its_connections_only_after_the_runners_that_hand_it_work_drained() -> None:
    from pipeline.serve import runners_for

    class Closing(Named):
        def __init__(self, name: str, inputs: str) -> None:
            super().__init__(name, inputs)
            self.closed = False

        async def aclose(self) -> None:  # a Closable stage: its Redis clients
            self.closed = True

    stages = [Closing(n.name, n.topics.inputs[0]) for n in helpers.NODES.values()]
    runners = {r.stage.name: r for r in runners_for(stages, Settings(), InstantAcks(), "t")}  # type: ignore[arg-type]
    cache = runners["cache"]
    closing = asyncio.create_task(cache._close_stage())
    for name, runner in runners.items():  # ingest, whose in-flight tasks hand over to guard, cache, route, drains last
        if name not in ("cache", "ingest"):
            runner.drained.set()
    await asyncio.sleep(0.05)
    assert not cache.stage.closed  # type: ignore[attr-defined]
    runners["ingest"].drained.set()
    await asyncio.wait_for(closing, 1.0)
    assert cache.stage.closed  # type: ignore[attr-defined]
    assert runners["ingest"].close_after == ()  # a sender only, never a taker: closes as soon as it drained


def test_emit_takes_from_the_cache_and_the_generate_stages_of_its_process_and_from_no_other() -> None:
    handlings = wired_with_generate()
    for sender in ("cache", "generate.up"):  # a request's whole stream comes from their one message
        assert handlings[sender].takers["llm.checked"].stage.name == "emit"  # type: ignore[union-attr]
    others = [name for name in handlings if name not in ("cache", "generate.up")]
    assert "postguard" in others and any(name.startswith("decode") for name in others)
    for name in others:  # prefill's first chunk and decode's others may be in two processes: the broker orders them
        assert "llm.checked" not in handlings[name].takers, name  # type: ignore[union-attr]


def test_generate_takes_from_route_of_its_process_and_prefill_from_nobody() -> None:
    handlings = wired_with_generate()
    assert handlings["route"].takers["llm.routed.up"].stage.name == "generate.up"  # type: ignore[union-attr]
    split = [name for name in handlings if name.startswith("prefill")]
    assert split, "the default nodes have a split pool"
    for name in split:  # prefill's work goes on to decode through the broker: no gain in taking it in memory
        assert handlings["route"].takers.get(handlings[name].stage.topics.inputs[0]) is None  # type: ignore[union-attr]
    for name in handlings:  # from route only
        if name != "route":
            assert "llm.routed.up" not in handlings[name].takers, name  # type: ignore[union-attr]


def test_emit_alone_hands_replies_to_the_bridge_client_of_its_process() -> None:
    from pipeline.serve import runners_for

    stages = [Named(n.name, n.topics.inputs[0]) for n in helpers.NODES.values()]
    bridge = Client(Settings(), reply_name="bridge")
    runners = runners_for(stages, Settings(), InstantAcks(), "t", bridge)  # type: ignore[arg-type]
    handlings = {r.stage.name: r._handling for r in runners}  # type: ignore[misc]
    assert handlings["emit"].replies is bridge
    assert all(h.replies is None for name, h in handlings.items() if name != "emit")
    assert all(h.replies is None for h in wired_with_generate().values())  # no bridge in the process
    assert bridge._partitions is None  # its requests go by their key: the bridge is in this process only
    runners = runners_for(stages, Settings(), InstantAcks(), "t", bridge, local_requests=True)  # type: ignore[arg-type]
    ingest = next(r for r in runners if r.stage.name == "ingest")
    assert bridge._partitions == ingest.partitions  # a bridge in every process: where this process's ingest reads


class Assigned:
    """A consumer's assignment, as the runner asks it."""

    def __init__(self, *partitions: int) -> None:
        self.held = {TopicPartition("llm.requests", p) for p in partitions}

    def assignment(self) -> set[TopicPartition]:
        return self.held


class Sent:
    """A producer that records the partition each message was sent to (None: the key's)."""

    def __init__(self) -> None:
        self.partitions: list[int | None] = []

    async def send_and_wait(self, topic: str, value: bytes, *, key: bytes, headers: object = None, partition: int | None = None) -> None:
        self.partitions.append(partition)


@pytest.mark.asyncio
async def test_a_bridge_sends_its_requests_to_the_partitions_its_process_s_ingest_holds_in_turn() -> None:
    from pipeline.runner import Runner

    ingest = Runner(Named("ingest", "llm.requests"), Settings(), producer=InstantAcks())  # type: ignore[arg-type]
    client, sent = Client(Settings(), reply_name="bridge"), Sent()
    client._producer = sent  # type: ignore[assignment]
    client.send_requests_to(ingest.partitions)
    await client._produce(client.request(prompt="before it joined"))
    ingest._consumer = Assigned(1, 3)  # type: ignore[assignment]
    for _ in range(4):
        await client._produce(client.request(prompt="hi"))
    ingest._consumer = Assigned()  # a rebalance took them away
    await client._produce(client.request(prompt="meanwhile"))
    assert sent.partitions[0] is None and sent.partitions[-1] is None  # by the key, as without a bridge here
    assert sorted(sent.partitions[1:5]) == [1, 1, 3, 3]  # type: ignore[type-var]
