"""Consecutive records of one key, for an ordered stage that takes them together and can forget what it
cached (emit), are handled together: a request's last chunk and its ending leave in one record batch
instead of one produce request after the other (pipeline/runner.py `_groups`, pipeline/handling.py
`process_group`). Anything unusual and the group is handled record by record, as without grouping. What
the cache or a generate stage hands to emit in the same process (a hit's replay, an answer's last chunk
and its ending) is taken the same way (`Handling.take_group`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord

from pipeline.errors import InfraUnavailable
from pipeline.handling import Handling
from pipeline.runner import GROUP_MAX, Runner
from pipeline.sdk import Client, Stream
from pipeline.settings import Settings
from pipeline.stage import Out
from pipeline.stages.emit import EmitStage
from pipeline.stages.generate import GenerateStage
from pipeline.stages.postguard import PostguardStage
from pipeline.stages.route import RouteStage
from pipeline.state import MemoryStateStore
from pipeline.topology import Topics
from tests.unit import helpers
from tests.unit.fakes import HeldAcks, ScriptedBackend, Yields, record_of
from tests.unit.helpers import SETTINGS, node
from topics import codec
from topics.hops import Admitted
from topics.stream import Chunk, Done, FinishReason, StreamEvent, Usage, digest_of

REPLY = "llm.responses.sdk"
USAGE = node("emit").topics.usage
RID = "acme/r1"


def chunk(seq: int, rid: str = RID) -> Chunk:
    return Chunk(id=rid, reply_to=REPLY, seq=seq, text=f"t{seq}", tenant="acme")


def done(chunks: int, rid: str = RID) -> Done:
    return Done(id=rid, reply_to=REPLY, chunks=chunks, digest=digest_of(f"t{seq}" for seq in range(chunks)), finish_reason=FinishReason.stop, usage=Usage(3, chunks),
                tenant="acme", model="m", created_at=1.0, timings={"decode": 5.0})


def record(message: Any, offset: int, value: bytes | None = None) -> ConsumerRecord[bytes, bytes]:
    return record_of(message, "llm.checked", offset=offset, key=message.id.encode(), value=value)


def replies(producer: HeldAcks) -> list[tuple[str, list[str]]]:
    """Per send to the reply topic: how it went and what it held (chunk seqs, "end"). A send to any other
    topic is left out, whatever it holds (`sent_to` lists every send's topic)."""
    shown = []
    for how, topic, values in producer.produced:
        if topic == REPLY:
            events = [codec.decode(v, StreamEvent) for v in values]
            shown.append((how, [str(e.seq) if isinstance(e, Chunk) else "end" for e in events]))
    return shown


def sent_to(producer: HeldAcks) -> list[str]:
    """The topic of each send, in order."""
    return [topic for _, topic, _ in producer.produced]


class Flaky(EmitStage):
    """emit, whose handling of its first ending fails once as if Redis had gone away; counts resets."""

    def __init__(self, store: MemoryStateStore) -> None:
        super().__init__(SETTINGS, node("emit").topics, store)
        self.failed = False
        self.resets: list[str | None] = []

    async def reset(self, request_id: str | None) -> None:
        self.resets.append(request_id)
        await super().reset(request_id)

    async def handle(self, message: Any):  # type: ignore[no-untyped-def]
        if isinstance(message, Done) and not self.failed:
            self.failed = True
            raise InfraUnavailable("redis went away")
        async for out in super().handle(message):
            yield out


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


async def acknowledged(task: asyncio.Task[list[str]], producer: HeldAcks) -> list[str]:
    """The task's outcomes, the broker acknowledging every send as it comes (within 5 s)."""
    for _ in range(500):
        producer.release()
        if task.done():
            return task.result()
        await asyncio.sleep(0.01)
    raise AssertionError("the group did not finish")


@pytest.mark.asyncio
async def test_the_last_chunk_and_the_ending_leave_in_one_batch_before_any_ack() -> None:
    producer, store = HeldAcks(), MemoryStateStore()
    handling = Handling(EmitStage(SETTINGS, node("emit").topics, store), Settings(), producer)  # type: ignore[arg-type]
    handed_over = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(handling.process_group([record(chunk(0), 5), record(done(1), 6)], handed_over, None))
    await settle()
    assert replies(producer) == [("batch", ["0", "end"])]  # one produce request for both, none acknowledged yet
    assert handed_over.done() and not task.done()  # the partition's next message may start; the group is not done
    producer.release()
    await settle()
    producer.release()  # the usage record, produced after the terminal event
    assert await task == ["ok", "ok"]
    stored = await store.read(RID + "#emit")
    assert stored.get("terminal") == b"1" and stored.get("emitted") == b"1"  # recorded after the acknowledgement


class Counted(MemoryStateStore):
    """A memory store that lists its writes: (call, key, fields written in any case or with a position)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[str, str, set[str]]] = []

    async def write(self, key: str, fields, *, owner: str | None = None) -> bool:  # type: ignore[no-untyped-def]
        self.writes.append(("write", key, set(fields)))
        return await super().write(key, fields, owner=owner)

    async def advance(self, key: str, field: str, position: int, fields, *, owner: str, always=None) -> bool:  # type: ignore[no-untyped-def]
        self.writes.append(("advance", key, {field, *fields, *(always or {})}))
        return await super().advance(key, field, position, fields, owner=owner, always=always)


@pytest.mark.asyncio
async def test_the_last_chunk_and_the_ending_acknowledged_together_are_recorded_in_one_call() -> None:
    producer, store = HeldAcks(), Counted()
    handling = Handling(EmitStage(SETTINGS, node("emit").topics, store), Settings(), producer)  # type: ignore[arg-type]
    assert await acknowledged(asyncio.create_task(handling.process_group([record(chunk(0), 5), record(done(1), 6)], None, None)),
                              producer) == ["ok", "ok"]
    assert store.writes == [("advance", RID + "#emit", {"emitted", "digest", "terminal"})]
    assert (await store.read(RID + "#emit")).get("terminal") == b"1"


@pytest.mark.asyncio
async def test_a_generate_stage_records_its_last_chunk_with_its_ending_in_one_call() -> None:
    producer, store = HeldAcks(), Counted()
    words = ["Hello", " there", "."]
    message = helpers.routed(helpers.request("r1"))
    sender = generate_emit(producer, store, ScriptedBackend(words))
    assert await acknowledged(asyncio.create_task(sender.process(record_of(message, "llm.routed.local"), None)), producer) == "ok"
    generated = [(call, fields) for call, key, fields in store.writes if key == message.id]
    assert generated == [("advance", {"next_seq", "progress"})] * 2 + [("advance", {"next_seq", "progress", "finished"})]
    assert [call for call, key, _ in store.writes if key == message.id + "#emit"] == ["advance"] * 3  # the last with "terminal"
    stored = await store.read(message.id)
    assert stored["next_seq"] == b"3" and stored.get("finished")


@pytest.mark.asyncio
async def test_a_failure_in_the_group_resets_the_request_and_handles_it_record_by_record() -> None:
    producer, store = HeldAcks(), MemoryStateStore()
    stage = Flaky(store)
    handling = Handling(stage, Settings(), producer)  # type: ignore[arg-type]
    task = asyncio.create_task(handling.process_group([record(chunk(0), 5), record(done(1), 6)], None, None))
    assert await acknowledged(task, producer) == ["ok", "ok"]
    assert stage.resets == [RID]  # what emit cached was not sent: it starts over from the store
    assert replies(producer) == [("one", ["0"]), ("one", ["end"])]  # the chunk once, then the ending, one by one


@pytest.mark.asyncio
async def test_a_record_that_cannot_be_read_sends_the_group_one_by_one() -> None:
    producer = HeldAcks()
    handling = Handling(EmitStage(SETTINGS, node("emit").topics, MemoryStateStore()), Settings(), producer)  # type: ignore[arg-type]
    group = [record(chunk(0), 5), record(chunk(1), 6, value=b"{not json"), record(done(1), 7)]
    outcomes = await acknowledged(asyncio.create_task(handling.process_group(group, None, None)), producer)
    assert outcomes[1] == "invalid" and outcomes[0] == "ok"  # dead-lettered; the others handled as usual
    assert replies(producer)[0] == ("one", ["0"])


def runner(stage: Any) -> Runner:
    return Runner(stage, Settings())


def offsets(stage: Any, records: list[ConsumerRecord[bytes, bytes]]) -> list[list[int]]:
    return [[r.offset for r in group] for group in runner(stage)._groups(records)]


def test_only_consecutive_records_of_one_key_are_grouped_and_only_for_a_stage_that_groups() -> None:
    records = [record(chunk(0, "a"), 1), record(done(1, "a"), 2), record(chunk(0, "b"), 3), record(chunk(1, "a"), 4)]
    assert offsets(EmitStage(SETTINGS, node("emit").topics, MemoryStateStore()), records) == [[1, 2], [3], [4]]
    one_by_one = [[1], [2], [3], [4]]
    postguard = PostguardStage(SETTINGS.guard, None, node("postguard").topics)  # type: ignore[arg-type]
    assert offsets(postguard, records) == one_by_one  # ordered and resettable, but it does not group
    ordered = Yields([])
    ordered.ordered = True
    assert offsets(ordered, records) == one_by_one  # ordered, but neither `groups` nor `Resettable`


def test_a_group_has_at_most_group_max_records() -> None:
    records = [record(chunk(i), i) for i in range(GROUP_MAX + 3)]
    assert [len(g) for g in offsets(EmitStage(SETTINGS, node("emit").topics, MemoryStateStore()), records)] == [GROUP_MAX, 3]


def hit_replay(chunks: int) -> list[Out]:
    """A cache hit's replay as the cache yields it: its chunks, each held for the next, then its ending."""
    outs = [Out("llm.checked", RID, chunk(seq), with_next=True) for seq in range(chunks)]
    return [*outs, Out("llm.checked", RID, done(chunks))]


def cache_handing_to(emit: EmitStage, producer: HeldAcks) -> Handling:
    sender = Handling(Yields(hit_replay(2)), Settings(), producer)  # type: ignore[arg-type]
    sender.takers = {"llm.checked": Handling(emit, Settings(), producer)}  # type: ignore[arg-type]
    return sender


@pytest.mark.asyncio
async def test_a_hit_handed_to_emit_reaches_the_reply_topic_as_one_batch_and_never_llm_checked() -> None:
    producer, store = HeldAcks(), MemoryStateStore()
    sender = cache_handing_to(EmitStage(SETTINGS, node("emit").topics, store), producer)
    task = asyncio.create_task(sender.process(record_of(helpers.admitted(helpers.request("r1")), "t.in"), None))
    assert await acknowledged(task, producer) == "ok"
    assert replies(producer) == [("batch", ["0", "1", "end"])]  # one produce request, to the reply topic only
    assert sent_to(producer) == [REPLY, USAGE]  # and the usage record: nothing went to llm.checked
    stored = await store.read(RID + "#emit")
    assert stored.get("terminal") == b"1" and stored.get("emitted") == b"2"


@pytest.mark.asyncio
async def test_a_failure_in_a_handed_over_hit_sends_it_message_by_message_with_one_ending() -> None:
    producer, store = HeldAcks(), MemoryStateStore()
    emit = Flaky(store)
    sender = cache_handing_to(emit, producer)
    task = asyncio.create_task(sender.process(record_of(helpers.admitted(helpers.request("r1")), "t.in"), None))
    assert await acknowledged(task, producer) == "ok"
    assert emit.resets == [RID]
    assert replies(producer) == [("one", ["0"]), ("one", ["1"]), ("one", ["end"])]
    assert sent_to(producer) == [REPLY] * 3 + [USAGE]  # handled again by emit, still never sent to llm.checked


@pytest.mark.asyncio
async def test_a_handed_over_hit_cancelled_midway_leaves_emit_nothing_cached_of_it() -> None:
    producer, store = HeldAcks(), MemoryStateStore()
    emit = Flaky(store)
    emit.failed = True  # it does not fail: only its resets are counted
    sender = cache_handing_to(emit, producer)
    task = asyncio.create_task(sender.process(record_of(helpers.admitted(helpers.request("r1")), "t.in"), None))
    await settle()
    assert replies(producer) == [("batch", ["0", "1", "end"])] and not task.done()  # waiting for the broker
    task.cancel()  # the sender's partition was taken away: its record is handled again, here or elsewhere
    with pytest.raises(asyncio.CancelledError):
        await task
    assert emit.resets == [RID]  # emit's own partitions were not revoked: the handover forgets for it


@pytest.mark.asyncio
async def test_a_generate_stage_hands_its_whole_stream_to_emit_which_answers_each_chunk_once() -> None:
    producer, store = HeldAcks(), MemoryStateStore()
    words = ["Hello", " there", ",", " friend", "."]
    sender = generate_emit(producer, store, ScriptedBackend(words))
    message = helpers.routed(helpers.request("r1"))
    assert await acknowledged(asyncio.create_task(sender.process(record_of(message, "llm.routed.local"), None)), producer) == "ok"
    # Every chunk once and one ending, all on the reply topic: none was produced to llm.checked (no emit
    # consumes it here), and the last chunk left with the ending.
    assert [seq for _, seqs in replies(producer) for seq in seqs] == [str(i) for i in range(len(words))] + ["end"]
    assert replies(producer)[-1] == ("batch", [str(len(words) - 1), "end"])
    assert [topic for topic in sent_to(producer) if topic != REPLY] == [USAGE]
    assert (await store.read(message.id)).get("finished") and (await store.read(message.id + "#emit")).get("terminal") == b"1"


def generate_emit(producer: HeldAcks, store: MemoryStateStore, backend: ScriptedBackend) -> Handling:
    """A generate stage whose stream emit of the same process takes in memory: generate's handling."""
    generate = GenerateStage(backend, Topics(("llm.routed.local",), None, "llm.checked"), store,
                             name="generate.local", chunk_window_s=0.0)
    sender = Handling(generate, Settings(), producer)  # type: ignore[arg-type]
    emit = EmitStage(SETTINGS, node("emit").topics, store)
    sender.takers = {"llm.checked": Handling(emit, Settings(), producer)}  # type: ignore[arg-type]
    return sender


def route_generate_emit(producer: HeldAcks, store: MemoryStateStore, backend: ScriptedBackend) -> Handling:
    """route, generate and emit of one process, wired as `pipeline.serve` wires them: route's handling."""
    route = Handling(RouteStage(SETTINGS, node("route").topics), Settings(), producer)  # type: ignore[arg-type]
    route.takers = {"llm.routed.local": generate_emit(producer, store, backend)}
    return route


@pytest.mark.asyncio
async def test_route_hands_a_request_to_generate_whose_stream_reaches_only_the_reply_topic() -> None:
    producer, store = HeldAcks(), MemoryStateStore()
    words = ["Hello", " there", "."]
    route = route_generate_emit(producer, store, ScriptedBackend(words))
    message = helpers.admitted(helpers.request("r1"))
    assert await acknowledged(asyncio.create_task(route.process(record_of(message, "llm.guarded"), None)), producer) == "ok"
    assert [seq for _, seqs in replies(producer) for seq in seqs] == ["0", "1", "2", "end"]
    assert [topic for topic in sent_to(producer) if topic != REPLY] == [USAGE]  # no llm.routed, no llm.checked
    assert (await store.read(message.id + "#emit")).get("terminal") == b"1"


@pytest.mark.asyncio
async def test_a_route_handover_cancelled_midway_is_finished_once_by_the_redelivered_record() -> None:
    producer, store = HeldAcks(), MemoryStateStore()
    words = [f" w{i}" for i in range(8)]  # the request's max_tokens
    message = helpers.admitted(helpers.request("r1"))
    first = asyncio.create_task(route_generate_emit(producer, store, ScriptedBackend(words, step_s=0.01))
                                .process(record_of(message, "llm.guarded"), None))
    async with asyncio.timeout(5):  # fails, not hangs, when no reply reaches the reply topic
        while len(replies(producer)) < 4:  # the stream is under way, its chunks acknowledged as they come
            producer.release()
            await asyncio.sleep(0.005)
    first.cancel()  # ingest's partition was taken away: the chain is redone from its record
    with pytest.raises(asyncio.CancelledError):
        await first
    # Redelivered, here a new process's chain (its own generate worker), over the same store.
    again_route = route_generate_emit(producer, store, ScriptedBackend(words))
    again = asyncio.create_task(again_route.process(record_of(message, "llm.guarded"), None))
    assert await acknowledged(again, producer) == "ok"
    sent = [seq for _, seqs in replies(producer) for seq in seqs]
    assert list(dict.fromkeys(sent)) == [str(i) for i in range(len(words))] + ["end"]  # each chunk, in order
    assert sent.count("end") == 1, sent  # a chunk in flight at the cancel may come twice: clients keep the first


def bridge_client() -> tuple[Client, str, Stream]:
    """The SDK client of a bridge in emit's process, not started (nothing here reaches a broker), with a
    stream waiting for one request; that request's id as the pipeline names it; and the stream, which
    the client holds only weakly (a stream its caller dropped is forgotten)."""
    client = Client(Settings(), reply_name="sdk")
    request = client.request(prompt="hi")
    stream = client.stream(request)
    return client, f"acme/{request.id}", stream


async def emitted_beside(client: Client, rid: str) -> tuple[HeldAcks, MemoryStateStore]:
    """A request's last chunk and its ending through emit, whose process runs the bridge of `client`."""
    producer, store = HeldAcks(), MemoryStateStore()
    handling = Handling(EmitStage(SETTINGS, node("emit").topics, store), Settings(), producer)  # type: ignore[arg-type]
    handling.replies = client
    task = asyncio.create_task(handling.process_group([record(chunk(0, rid), 5), record(done(1, rid), 6)], None, None))
    assert await acknowledged(task, producer) == ["ok", "ok"]
    return producer, store


@pytest.mark.asyncio
async def test_a_reply_one_of_this_process_s_streams_waits_for_is_delivered_in_memory_not_produced() -> None:
    client, rid, stream = bridge_client()
    producer, store = await emitted_beside(client, rid)
    assert replies(producer) == [] and sent_to(producer) == [USAGE]  # only the usage record, to its topic
    assert client._streams[rid.split("/")[1]] is stream._state
    assert [type(e).__name__ for e in stream._events] == ["Chunk", "Done"]
    stored = await store.read(rid + "#emit")
    assert stored.get("terminal") == b"1" and stored.get("emitted") == b"1"  # recorded as after a broker's ack


@pytest.mark.asyncio
async def test_a_reply_no_stream_of_this_process_waits_for_is_produced() -> None:
    client, _, _stream = bridge_client()
    producer, _ = await emitted_beside(client, RID)
    assert replies(producer) == [("batch", ["0", "end"])]  # another client's request: through the topic
    other = Client(Settings(), reply_name="other")  # a stream for this request, but another reply topic
    stream = other.stream(other.request(prompt="hi"))
    assert not other.take_reply(REPLY, chunk(0, f"acme/{stream.id}")) and not stream._events


class Stubborn:
    """A stage whose message outlives a revoke: it ignores the cancellation until `release` is set (as
    a wait that swallows a cancellation, or a cleanup stuck on a hung store, would)."""

    name = "stubborn"
    topics = Topics(("t.in",), None, "t.stream")
    input_type = Admitted
    ordered = False

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def handle(self, message: Admitted) -> Any:
        while not self.release.is_set():
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                continue  # swallowed
        for out in ():
            yield out


@pytest.mark.asyncio
async def test_a_message_that_outlives_its_revoke_does_not_finish_into_the_next_assignment(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokafka import TopicPartition

    from pipeline import runner as runner_module
    from pipeline.offsets import OffsetTracker

    monkeypatch.setattr(runner_module, "REVOKE_WAIT_S", 0.05)
    stage, tp = Stubborn(), TopicPartition("t.in", 0)
    run = Runner(stage, Settings())
    handling = Handling(stage, Settings(), HeldAcks())  # type: ignore[arg-type]
    message = record_of(helpers.admitted(helpers.request("stubborn")), offset=5)
    run.trackers[tp] = OffsetTracker()
    run.trackers[tp].start(5)
    run._spawn(tp, [message], handling)
    await asyncio.sleep(0.01)
    await run.revoke({tp})  # it waited REVOKE_WAIT_S; the task still runs
    again = run.trackers[tp] = OffsetTracker()  # the partition is this worker's again, offset 5 redelivered
    again.start(5)
    stage.release.set()
    await asyncio.sleep(0.05)  # the stale task ends
    assert again.committable() == 5  # not 6: the redelivered copy is still in flight
