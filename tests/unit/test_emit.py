"""emit: each chunk once and in order, one terminal event, one usage record, and progress that
survives the worker (a successor with the same store repeats nothing)."""

import asyncio

import msgspec
import pytest

from pipeline.errors import InfraUnavailable, Undeliverable
from pipeline.stages import emit as emit_module
from pipeline.stages.emit import EmitStage
from pipeline.state import MemoryStateStore
from tests.unit.fakes import Clock, run_handler
from tests.unit.helpers import MODEL, SETTINGS, node
from topics import registry
from topics.errors import ErrorCode
from topics.stream import EMPTY_DIGEST, Chunk, Done, Failed, FinishReason, Usage, digest_of, digest_step
from topics.usage import UsageRecord

REPLY = "llm.responses.sdk"
RID = "acme/r1"
EMIT = node("emit")


def emit(store: MemoryStateStore | None = None) -> EmitStage:
    return EmitStage(SETTINGS, EMIT.topics, store)


def chunk(seq: int) -> Chunk:
    return Chunk(id=RID, reply_to=REPLY, seq=seq, text=f"t{seq}", tenant="acme")


def done(chunks: int = 2) -> Done:
    return Done(id=RID, reply_to=REPLY, chunks=chunks, digest=digest_of(f"t{seq}" for seq in range(chunks)), finish_reason=FinishReason.stop, usage=Usage(3, 2),
                tenant="acme", model="m", created_at=1.0, timings={"decode": 5.0})


def failed(code: ErrorCode = ErrorCode.internal) -> Failed:
    return Failed(id=RID, reply_to=REPLY, code=code, message="x", retriable=True, tenant="acme", model="m", created_at=1.0)


async def replies(stage: EmitStage, *messages: object) -> list[object]:
    return [o.value for m in messages for o in await run_handler(stage, m) if o.topic == REPLY]


@pytest.mark.asyncio
async def test_forwards_chunks_then_one_terminal_and_a_usage_record() -> None:
    stage = emit()
    outs = [o for m in (chunk(0), chunk(1), done()) for o in await run_handler(stage, m)]
    assert [o.topic for o in outs] == [REPLY, REPLY, REPLY, registry.USAGE]
    terminal, usage = outs[2].value, outs[3].value
    assert isinstance(terminal, Done) and {"decode", "emit", "total"} <= set(terminal.timings)
    assert terminal.digest == digest_step(digest_step(EMPTY_DIGEST, "t0"), "t1")  # of what the client got
    assert isinstance(usage, UsageRecord) and usage.outcome == "done" and usage.completion_tokens == 2
    assert outs[3].key == "acme"


@pytest.mark.asyncio
async def test_drops_redelivered_chunks_and_terminals() -> None:
    sent = await replies(emit(), chunk(0), chunk(1), chunk(0), chunk(1), done(), chunk(1), done())
    assert [getattr(m, "seq", "end") for m in sent] == [0, 1, "end"]


@pytest.mark.asyncio
async def test_an_early_chunk_waits_for_the_missing_one() -> None:
    sent = await replies(emit(), chunk(0), chunk(2), chunk(1), done(3))
    assert [getattr(m, "seq", "end") for m in sent] == [0, 1, 2, "end"]
    assert isinstance(sent[-1], Done)


@pytest.mark.asyncio
async def test_a_gap_at_the_end_is_an_error_not_a_holey_answer() -> None:
    sent = await replies(emit(), chunk(0), chunk(2), done(3))
    assert [getattr(m, "seq", "end") for m in sent] == [0, "end"]
    assert isinstance(sent[-1], Failed) and sent[-1].code is ErrorCode.stream_incomplete and sent[-1].chunks == 1


@pytest.mark.asyncio
async def test_chunks_cut_otherwise_than_the_writer_sent_them_end_as_an_error_not_an_answer() -> None:
    """Two attempts at one stream whose chunks were cut differently (a retry after a failed send) can
    reach emit mixed under the same seqs: the client then has text the writer did not send. The Done's
    digest chain is the writer's, emit's is what it forwarded; they differ, and the client is told."""
    other = digest_step(digest_step(EMPTY_DIGEST, "t0 t1"), "t2")  # the retry merged t0 and t1 into chunk 0
    mixed = msgspec.structs.replace(done(2), digest=other)
    sent = await replies(emit(), chunk(0), chunk(1), mixed)
    assert isinstance(sent[-1], Failed) and sent[-1].code is ErrorCode.stream_incomplete and sent[-1].chunks == 2
    assert "differ" in sent[-1].message
    assert isinstance((await replies(emit(), chunk(0), chunk(1), done(2)))[-1], Done)  # the same chain: the answer


@pytest.mark.asyncio
async def test_a_successor_repeats_neither_chunks_nor_the_terminal_nor_usage() -> None:
    store = MemoryStateStore()
    first = await replies(emit(store), chunk(0), chunk(1))
    second = emit(store)  # the first worker died; its successor re-reads the partition from an older offset
    outs = [o for m in (chunk(0), chunk(1), chunk(2), done(3)) for o in await run_handler(second, m)]
    assert [getattr(o.value, "seq", "end") for o in outs if o.topic == REPLY] == [2, "end"]
    assert len(first) == 2 and outs[-1].topic == registry.USAGE
    third = emit(store)
    assert [o for m in (chunk(2), done(3)) for o in await run_handler(third, m)] == []


@pytest.mark.asyncio
async def test_an_early_error_counts_the_chunks_emit_saw() -> None:
    stage = emit()
    await run_handler(stage, chunk(0))
    outs = await run_handler(stage, failed())
    assert outs[0].value.chunks == 1 and outs[1].value.outcome == "internal"


@pytest.mark.asyncio
async def test_refuses_to_write_to_an_unconfigured_topic() -> None:
    with pytest.raises(Undeliverable):
        await run_handler(emit(), Chunk(id=RID, reply_to=registry.REQUESTS, seq=0, text="x", tenant="acme"))


@pytest.mark.asyncio
async def test_a_replaced_worker_learns_it_and_leaves_the_message_to_be_retried() -> None:
    store = MemoryStateStore()
    paused, successor = emit(store), emit(store)
    await replies(paused, chunk(0))
    assert [c.seq for c in await replies(successor, chunk(0), chunk(1))] == [1]  # it took the request over
    with pytest.raises(InfraUnavailable):  # resumed: its record is refused when it writes
        await replies(paused, chunk(1))
    with pytest.raises(InfraUnavailable):  # every later message too, until the runner resets the request:
        await replies(paused, chunk(2))  # finishing it quietly would commit a chunk nobody forwarded
    assert [getattr(m, "seq", "end") for m in await replies(successor, chunk(2), done(3))] == [2, "end"]


class CountingStore(MemoryStateStore):
    """Counts the ownership checks: fenced writes of no fields."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    async def write(self, key: str, fields, *, owner: str | None = None) -> bool:  # type: ignore[no-untyped-def]
        self.checks += owner is not None and not fields
        return await super().write(key, fields, owner=owner)


@pytest.mark.asyncio
async def test_a_request_taken_just_now_ends_without_asking_the_store_again() -> None:
    store, clock = CountingStore(), Clock()
    stage = EmitStage(SETTINGS, EMIT.topics, store, clock=clock)
    clock.now += 0.001  # the last chunk and the ending came in one group: the take was a moment ago
    sent = await replies(stage, chunk(0), done(1))
    assert isinstance(sent[-1], Done) and store.checks == 0


@pytest.mark.asyncio
async def test_ownership_confirmed_a_while_ago_is_checked_before_the_terminal_event() -> None:
    store, clock = CountingStore(), Clock()
    paused = EmitStage(SETTINGS, EMIT.topics, store, clock=clock)
    await replies(paused, chunk(0))  # taken, and its position recorded: ownership confirmed at 100.0
    clock.now += 1.0  # paused past its session; the partition went to another worker
    successor = emit(store)
    assert [c.seq for c in await replies(successor, chunk(0), chunk(1))] == [1]
    with pytest.raises(InfraUnavailable):  # the check runs, finds the request taken: no second terminal
        await replies(paused, done(2))
    assert store.checks == 1
    assert [getattr(m, "seq", "end") for m in await replies(successor, done(2))] == ["end"]


@pytest.mark.asyncio
async def test_chunks_held_behind_a_gap_survive_a_reset_of_their_request() -> None:
    stage = emit()
    assert [c.seq for c in await replies(stage, chunk(0), chunk(2))] == [0]  # 2 waits for 1
    await stage.reset(RID)  # a retry of this request's message re-reads the store; chunk 2's message is done
    sent = await replies(stage, chunk(1), done(3))
    assert [getattr(m, "seq", "end") for m in sent] == [1, 2, "end"] and isinstance(sent[-1], Done)


@pytest.mark.asyncio
async def test_chunks_held_behind_a_gap_survive_the_worker() -> None:
    store = MemoryStateStore()
    first = emit(store)
    assert [c.seq for c in await replies(first, chunk(0), chunk(2), chunk(3))] == [0]  # 2 and 3 wait for 1
    successor = emit(store)  # the first died; the messages of 2 and 3 were finished, so never redelivered
    sent = await replies(successor, chunk(1), done(4))
    assert [getattr(m, "seq", "end") for m in sent] == [1, 2, 3, "end"] and isinstance(sent[-1], Done)


@pytest.mark.asyncio
async def test_the_stored_position_never_moves_back_when_acknowledgements_land_out_of_order() -> None:
    store = MemoryStateStore()
    stage = emit(store)
    first = [o async for o in stage.handle(chunk(0))]
    second = [o async for o in stage.handle(chunk(1))]
    later = asyncio.create_task(second[0].acked())  # the later acknowledgement is handled first
    await asyncio.sleep(0)
    assert not later.done()  # its position waits for the one before it
    await first[0].acked()
    await later
    assert (await store.read(RID + "#emit"))["emitted"] == b"2"


@pytest.mark.asyncio
async def test_a_late_acknowledgement_from_before_a_reset_never_takes_the_position_back() -> None:
    """Chaos found it (a Redis restart): the acknowledgements of a request's earlier try still arrive
    after a reset, each recorded through the progress it was made with. One wrote position 37 over 39
    while chunk 38's message was already finished, and the terminal event waited for 38 for good."""
    store = MemoryStateStore()
    stage = emit(store)
    first = [o for m in (chunk(0), chunk(1)) async for o in stage.handle(m)]
    await first[0].acked()  # position 1 recorded; chunk 1's acknowledgement is late
    await stage.reset(RID)  # a message of the request is tried again: progress rebuilt from the store
    again = [o for m in (chunk(1), chunk(2)) async for o in stage.handle(m)]
    for out in again:
        await out.acked()
    assert (await store.read(RID + "#emit"))["emitted"] == b"3"
    await first[1].acked()  # the earlier try's chunk 1 (position 2) arrives now
    assert (await store.read(RID + "#emit"))["emitted"] == b"3"
    sent = await replies(emit(store), done(3))  # a successor ends the request with nothing missing
    assert isinstance(sent[0], Done) and sent[0].chunks == 3


@pytest.mark.asyncio
async def test_a_chunk_is_not_recorded_past_an_earlier_one_whose_produce_failed() -> None:
    """Chaos found it (broker outage): chunk 1's produce fails on the old producer while chunk 2's, sent
    later on a renewed one, goes through. Recording position 3 would make chunk 1's retry look like a
    repeat, and the client would get a Done over a stream with a hole. Chunk 2's record waits instead,
    and gives up (its message is tried again) once chunk 1's retry resets the request."""
    store = MemoryStateStore()
    stage = emit(store)
    await replies(stage, chunk(0))
    [_lost] = [o async for o in stage.handle(chunk(1))]  # its produce fails: no acked
    [c2] = [o async for o in stage.handle(chunk(2))]
    waiting = asyncio.create_task(c2.acked())  # chunk 2 reached the client
    await asyncio.sleep(0)
    assert not waiting.done()
    await stage.reset(RID)  # handling.py, before it retries chunk 1's message
    with pytest.raises(InfraUnavailable):
        await waiting
    assert (await store.read(RID + "#emit"))["emitted"] == b"1"
    assert [c.seq for c in await replies(stage, chunk(1))] == [1]  # chunk 1's retry
    await stage.reset(RID)  # before chunk 2's retry
    assert [c.seq for c in await replies(stage, chunk(2))] == [2]  # again: the client drops the repeat
    sent = await replies(stage, done(3))
    assert isinstance(sent[0], Done) and sent[0].chunks == 3


class FlakyStore(MemoryStateStore):
    """A store whose next `fail` writes raise as Redis does while it restarts."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = 0

    def _failing(self) -> None:
        if self.fail:
            self.fail -= 1
            raise InfraUnavailable("redis state store: ConnectionError")

    async def write(self, key: str, fields, *, owner: str | None = None) -> bool:  # type: ignore[no-untyped-def]
        self._failing()
        return await super().write(key, fields, owner=owner)

    async def advance(self, key: str, field: str, position: int, fields, *, owner: str, always=None) -> bool:  # type: ignore[no-untyped-def]
        self._failing()
        return await super().advance(key, field, position, fields, owner=owner, always=always)


@pytest.mark.asyncio
async def test_a_terminal_the_broker_acknowledged_is_recorded_not_sent_again_when_its_record_failed() -> None:
    """The terminal event reached the reply topic and its record failed (Redis restarting): the retried
    message records it and sends it no second time (nor a second usage record)."""
    store = FlakyStore()
    stage = emit(store)
    for message in (chunk(0), chunk(1)):
        for out in [o async for o in stage.handle(message)]:
            await out.acked()
    [terminal, _usage] = [o async for o in stage.handle(done())]
    terminal.delivered()  # handling.py: the broker acknowledged it
    store.fail = 1
    with pytest.raises(InfraUnavailable):
        await terminal.acked()
    await stage.reset(RID)  # handling.py, before it retries the message
    assert [o async for o in stage.handle(done())] == []
    assert (await store.take(RID + "#emit", "a successor")).get("terminal") == b"1"


@pytest.mark.asyncio
async def test_a_terminal_whose_record_never_ran_is_not_sent_again_either() -> None:
    """The likely path of a repeat the input-guard chaos profile showed (Redis restart): the last
    chunk's record failed, so handling.py never ran the terminal's `acked` (it runs them in order),
    although the broker had both; the retry sent the terminal event a second time. The client drops
    repeats; the topic should not carry them."""
    store = FlakyStore()
    stage = emit(store)
    [c0] = [o async for o in stage.handle(chunk(0))]
    await c0.acked()
    [c1] = [o async for o in stage.handle(chunk(1))]
    [terminal, _usage] = [o async for o in stage.handle(done())]
    terminal.delivered()
    store.fail = 1
    with pytest.raises(InfraUnavailable):
        await c1.acked()  # its record failed: the terminal's `acked` is never called
    await stage.reset(RID)
    [again] = [o async for o in stage.handle(chunk(1))]  # the retried group: chunk 1 again (the client drops it)
    await again.acked()
    assert [o async for o in stage.handle(done())] == []


async def chunk_2_waits_for_the_retry_of_chunk_1(stage: EmitStage) -> None:
    """After chunk 1's message failed and was reset: chunk 2 is held, the terminal event is retried
    (not ended as stream_incomplete), and once chunk 1's retry went out (1 again, which the client
    drops, then 2) the terminal's retry ends the request with all three chunks."""
    assert [o async for o in stage.handle(chunk(2))] == []  # rebuilt at 1 from the store: 2 waits for 1
    with pytest.raises(InfraUnavailable):
        [o async for o in stage.handle(done(3))]
    await stage.reset(RID)
    retried = [o async for o in stage.handle(chunk(1))]
    assert [o.value.seq for o in retried] == [1, 2]
    for out in retried:
        await out.acked()
    await stage.reset(RID)
    sent = await replies(stage, done(3))
    assert isinstance(sent[0], Done) and sent[0].chunks == 3


@pytest.mark.asyncio
async def test_a_terminal_waits_for_a_chunk_whose_message_is_being_retried() -> None:
    """Chaos found it: chunk 1's acknowledged write fails (Redis restarting), so handling.py retries that
    message after `reset`; the request's later messages go on meanwhile, rebuild the progress from the
    store and hold chunk 2 behind the gap. The terminal event must not call chunk 1 lost: it waits."""
    store = FlakyStore()
    stage = emit(store)
    [c0] = [o async for o in stage.handle(chunk(0))]
    await c0.acked()
    [c1] = [o async for o in stage.handle(chunk(1))]
    store.fail = 1
    with pytest.raises(InfraUnavailable):
        await c1.acked()  # chunk 1 reached the client; its position did not reach the store
    await stage.reset(RID)  # handling.py, before it retries chunk 1's message
    await chunk_2_waits_for_the_retry_of_chunk_1(stage)


@pytest.mark.asyncio
async def test_a_terminal_whose_own_try_failed_ends_a_stream_with_a_lost_chunk_and_does_not_wait_for_good() -> None:
    """Chunk 1 never reached emit (lost upstream) and the ending's first try met a Redis blip: the reset
    before its retry marked the request as in retry up to what emit had forwarded, all of it recorded, so
    no write would ever end the doubt: the ending waited, and emit's partition behind it, until the deadline."""
    store = FlakyStore()
    stage = emit(store)
    await replies(stage, chunk(0))
    first = [o async for o in stage.handle(done(2))]
    store.fail = 1
    with pytest.raises(InfraUnavailable):
        await first[0].acked()  # the blip: the ending's record failed
    await stage.reset(RID)  # handling.py, before it tries the ending's message again
    [ending] = [o.value for o in [o async for o in stage.handle(done(2))] if isinstance(o.value, Failed)]
    assert ending.code is ErrorCode.stream_incomplete


@pytest.mark.asyncio
async def test_a_terminal_waits_for_a_chunk_whose_produce_failed() -> None:
    """Chaos found it too (broker outage): chunk 1's produce to the reply topic fails, so its `acked`
    never runs and only handling.py's `reset` says the message is being retried; chunk 2 goes out on
    the renewed producer meanwhile. The terminal event must wait for chunk 1, not call it lost."""
    stage = emit()
    [c0] = [o async for o in stage.handle(chunk(0))]
    await c0.acked()
    [_lost] = [o async for o in stage.handle(chunk(1))]  # its produce fails: no acked
    await stage.reset(RID)  # handling.py, before it retries chunk 1's message
    await chunk_2_waits_for_the_retry_of_chunk_1(stage)


@pytest.mark.asyncio
async def test_a_terminal_waits_for_every_message_in_retry_not_only_the_first() -> None:
    """Chaos found it (Redis restart): chunk 1's position write fails, chunks 2 and 3 (forwarded too)
    give up their records behind it, and all three messages are retried. Chunk 1's retry recording
    position 2 must not end the doubt: the terminal event waits until position 4 is recorded."""
    store = FlakyStore()
    stage = emit(store)
    await replies(stage, chunk(0))
    outs = [o for c in (1, 2, 3) async for o in stage.handle(chunk(c))]
    later = [asyncio.create_task(o.acked()) for o in outs[1:]]
    store.fail = 1
    with pytest.raises(InfraUnavailable):
        await outs[0].acked()
    await stage.reset(RID)  # before chunk 1's retry
    for task in later:
        with pytest.raises(InfraUnavailable):  # their messages are retried too
            await task
    assert [c.seq for c in await replies(stage, chunk(1))] == [1]  # chunk 1's retry: position 2 recorded
    with pytest.raises(InfraUnavailable):  # the terminal's first try: chunks 2 and 3 are still on their way
        await replies(stage, done(4))
    for seq in (2, 3):
        await stage.reset(RID)
        assert [c.seq for c in await replies(stage, chunk(seq))] == [seq]
    await stage.reset(RID)
    sent = await replies(stage, done(4))
    assert isinstance(sent[0], Done) and sent[0].chunks == 4


@pytest.mark.asyncio
async def test_a_gap_with_no_retry_pending_still_ends_as_stream_incomplete() -> None:
    store = FlakyStore()
    stage = emit(store)
    sent = await replies(stage, chunk(0), chunk(2), done(3))
    assert isinstance(sent[-1], Failed) and sent[-1].code == ErrorCode.stream_incomplete


@pytest.mark.asyncio
async def test_a_chunk_overtaken_by_its_terminal_event_is_sent_again_after_it() -> None:
    """The window the terminal event leaves open (it does not wait for the chunks' records): chunk 1's
    produce is still pending on a producer that is then replaced, the terminal event goes out on the new
    one, then chunk 1's produce fails and its message is retried. The retry must go out (the client
    waits for it), although the request is finished; a chunk whose position was recorded must not."""
    store = MemoryStateStore()
    stage = emit(store)
    await replies(stage, chunk(0))
    [_lost] = [o async for o in stage.handle(chunk(1))]  # its produce fails later: no acked
    [c2] = [o async for o in stage.handle(chunk(2))]
    waiting = asyncio.create_task(c2.acked())
    outs = [o for o in await run_handler(stage, done(3)) if o.topic == REPLY]
    assert isinstance(outs[0].value, Done) and outs[0].value.chunks == 3  # nothing missing as far as emit saw
    await stage.reset(RID)  # handling.py, before it retries chunk 1's message
    with pytest.raises(InfraUnavailable):
        await waiting  # chunk 2's record gave up behind chunk 1's: its message is retried too
    assert (await store.read(RID + "#emit"))["terminal"] == b"1"
    assert [c.seq for c in await replies(stage, chunk(1))] == [1]  # after the terminal event
    await stage.reset(RID)
    assert [c.seq for c in await replies(stage, chunk(2))] == [2]
    assert await replies(stage, chunk(0), chunk(1), chunk(2), done(3)) == []  # recorded: repeats are dropped


@pytest.mark.asyncio
async def test_a_request_leaves_memory_once_its_end_is_recorded_and_the_store_answers_for_it() -> None:
    """Finished requests used to stay in memory until 50,000 more had passed (a lock, an event and a
    sequencer each: the process grew by ~1.6 KB a request). Now one leaves once its terminal event and
    every chunk are recorded, and a late redelivery is answered from the store: nothing is sent twice."""
    store = MemoryStateStore()
    stage = emit(store)
    ids = [f"acme/r{i}" for i in range(50)]
    for rid in ids:
        sent = await replies(stage, *(msgspec.structs.replace(m, id=rid) for m in (chunk(0), chunk(1), done())))
        assert [getattr(m, "seq", "end") for m in sent] == [0, 1, "end"]
    assert len(stage._sent) == 0
    late = [msgspec.structs.replace(m, id=ids[7]) for m in (chunk(1), done(), chunk(0))]
    assert await replies(stage, *late) == []  # no chunk repeated, no second terminal event
    outs = [o for m in late for o in await run_handler(stage, m)]
    assert not [o for o in outs if o.topic == registry.USAGE]  # nor a second usage record


@pytest.mark.asyncio
async def test_a_finished_request_with_a_chunk_not_yet_recorded_stays_in_memory() -> None:
    """The terminal event does not wait for the chunks' records: until they are in, the request stays (a
    reset of it then still makes the waiting record give up, as the overtaken-chunk test needs)."""
    stage = emit(MemoryStateStore())
    await replies(stage, chunk(0))
    [_pending] = [o async for o in stage.handle(chunk(1))]  # acknowledged later, if ever
    await run_handler(stage, done(2))
    assert RID in stage._sent


class SlowFirstTake(MemoryStateStore):
    """A store whose next take is answered only after the given delay (a Redis reply that comes late)."""

    def __init__(self) -> None:
        super().__init__()
        self.delays: list[float] = []

    async def take(self, key: str, owner: str) -> dict[str, bytes]:
        fields = await super().take(key, owner)
        if self.delays:
            await asyncio.sleep(self.delays.pop(0))
        return fields


@pytest.mark.asyncio
async def test_two_messages_of_a_request_that_restore_its_progress_at_once_share_it() -> None:
    """After a reset, a retried chunk and the next chunk of the same request each take the request's
    record; the later take must not replace what the earlier one restored and went on with (the chunk
    it forwarded would be forgotten, and the next one held behind it for good)."""
    store = SlowFirstTake()
    stage = emit(store)
    await run_handler(stage, chunk(0))
    await stage.reset(RID)
    store.delays = [0.0, 0.05]  # chunk 1's take answers at once, the retried chunk 0's late
    first, second = await asyncio.gather(run_handler(stage, chunk(1)), run_handler(stage, chunk(0)))
    outs = first + second + await run_handler(stage, chunk(2)) + await run_handler(stage, done(3))
    terminal = [o.value for o in outs if isinstance(o.value, Done | Failed)]
    assert len(terminal) == 1 and isinstance(terminal[0], Done), terminal


def refusal(nonce: str | None, rid: str = "r1") -> Failed:
    """Ingest's refusal of a request under the client's bare id, naming the record it refuses."""
    return Failed(id=rid, reply_to=REPLY, code=ErrorCode.rate_limited, message="slow down", retriable=True, tenant="acme",
                  model="m", created_at=1.0, nonce=nonce)


@pytest.mark.asyncio
async def test_each_refused_record_under_one_bare_id_gets_one_terminal_event() -> None:
    """A client refused under its own id (a 429) that sends the same bytes again, or another tenant's
    request refused under the same client id, is refused again: its terminal event must reach the client,
    not be dropped as a redelivery of the first (it waited until its timeout). A replay of one refused
    record (its group sent back to an old offset) is still dropped, on a successor too."""
    store = MemoryStateStore()
    stage = emit(store)
    outs = [o for m in (refusal("n1"), refusal("n2"), refusal("n1")) for o in await run_handler(stage, m)]
    terminals = [(o.value.nonce, o.key) for o in outs if o.topic == REPLY]  # type: ignore[attr-defined]
    assert terminals == [("n1", "r1"), ("n2", "r1")]  # keyed on the reply topic by the client's id, as before
    assert len([o for o in outs if o.topic == registry.USAGE]) == 2  # one usage record per refusal
    assert await replies(emit(store), refusal("n2")) == []


@pytest.mark.asyncio
async def test_a_refusals_usage_record_names_only_a_configured_model() -> None:
    """Ingest refuses an unknown model after authentication, and its refusal carries the model string the
    client sent (any 256 characters): the usage record named it, and `sluice usage` printed escape
    sequences and a forged row, one new row per string. Unconfigured, it is "other", as in the metrics."""
    forged = "\x1b[2K\rgpt-4o 1 0 0 0.0\nFORGED"
    stage = emit()
    usage: dict[str, str] = {}
    for rid, model in (("r1", forged), ("r2", MODEL)):
        refused = Failed(id=rid, reply_to=REPLY, code=ErrorCode.not_found, message="unknown model", retriable=False,
                         tenant="acme", model=model, created_at=1.0, nonce="n")
        [record] = [o.value for o in await run_handler(stage, refused) if o.topic == registry.USAGE]
        assert isinstance(record, UsageRecord)
        usage[rid] = record.model
    assert usage == {"r1": "other", "r2": MODEL}
    [finished] = [o.value for o in await run_handler(stage, done(0)) if o.topic == registry.USAGE]
    assert isinstance(finished, UsageRecord) and finished.model == "m"  # the model ingest admitted


@pytest.mark.asyncio
async def test_a_finished_requests_held_chunks_read_from_the_store_do_not_stay_in_memory() -> None:
    """A predecessor's held chunks, read with the request's progress, were kept for the next message
    and never taken when that message was a redelivery after the end: one entry per such request, for
    good (only a rebalance cleared them)."""
    store = MemoryStateStore()
    sent = await replies(emit(store), chunk(0), chunk(2), done(3))  # 2 held (and stored) behind the gap
    assert isinstance(sent[-1], Failed) and sent[-1].code is ErrorCode.stream_incomplete
    successor = emit(store)
    assert await replies(successor, done(3)) == []  # a redelivery after the end
    assert RID not in successor._carried


@pytest.mark.asyncio
async def test_chunks_carried_over_resets_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reset carries a request's held chunks to its retry; a retry that dies at its deadline never
    takes them. They are bounded as `_sent` and `_unsure` are (the store keeps them anyway)."""
    monkeypatch.setattr(emit_module, "_CACHED", 3)
    stage = emit()
    for i in range(10):
        rid = f"acme/r{i}"
        assert await replies(stage, msgspec.structs.replace(chunk(1), id=rid)) == []  # held: 0 is missing
        await stage.reset(rid)  # its message is tried again, until its deadline, and never handled
    assert len(stage._carried) == 3
