"""prefill and decode over a scripted backend: numbering, terminal events, cancellation, and a stream
that survives its decode worker (resume from the state store, fencing of a replaced worker, in decode
and in the generate stage that reroutes)."""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import msgspec
import pytest

from pipeline.backends.base import Delta
from pipeline.backends.errors import ModelError
from pipeline.errors import InfraUnavailable
from pipeline.settings import BackendSettings
from pipeline.stage import Out
from pipeline.stages.decode import DecodeStage
from pipeline.stages.generate import GenerateStage
from pipeline.stages.generation import generation_request
from pipeline.stages.prefill import PrefillStage
from pipeline.state import MemoryStateStore
from tests.unit.fakes import ScriptedBackend, run_handler
from tests.unit.helpers import MODEL, node, request, routed
from topics import codec, registry
from topics.cache import Ticket
from topics.control import Cancel, CancelReason
from topics.errors import ErrorCode
from topics.hops import Prefilled, Route
from topics.requests import Priority, Sampling
from topics.stream import EMPTY_DIGEST, Chunk, Done, Failed, FinishReason, StreamEvent, digest_step

WORDS = ["Hello", " there", ",", " friend", "."]
PREFILL, DECODE = node("prefill"), node("decode")


def chain(texts: list[str]) -> str:
    digest = EMPTY_DIGEST
    for text in texts:
        digest = digest_step(digest, text)
    return digest


def decode_stage(backend: ScriptedBackend, store: MemoryStateStore | None = None, window_s: float = 0.0) -> DecodeStage:
    """A chunk per token unless `window_s` (the numbering and resume tests count tokens as chunks)."""
    return DecodeStage(backend, DECODE.topics, store if store is not None else MemoryStateStore(), name=DECODE.name,
                       chunk_window_s=window_s)


async def prefilled(backend: ScriptedBackend, **overrides: object) -> Prefilled:
    outs = await run_handler(PrefillStage(backend, PREFILL.topics, name=PREFILL.name), routed(request(**overrides)))
    [handed] = [o.value for o in outs if o.topic == PREFILL.topics.forward]
    assert isinstance(handed, Prefilled)
    return handed


async def prefill_then_decode(backend: ScriptedBackend, **overrides: object) -> list[object]:
    outs = await run_handler(PrefillStage(backend, PREFILL.topics, name=PREFILL.name), routed(request(**overrides)))
    events = [o.value for o in outs if o.topic == PREFILL.topics.stream]
    for handed in [o.value for o in outs if o.topic == PREFILL.topics.forward]:
        events += [o.value for o in await run_handler(decode_stage(backend), handed)]
    return events


@pytest.mark.asyncio
async def test_prefill_sends_the_first_token_and_a_handle() -> None:
    outs = await run_handler(PrefillStage(ScriptedBackend(WORDS), PREFILL.topics), routed(request()))
    assert [o.topic for o in outs] == ["llm.tokens", "llm.prefilled.local"]
    assert outs[0].value == Chunk(id="default/r1", reply_to="llm.responses.sdk", seq=0, text="Hello", tenant="default", token_ids=(0,), model=MODEL)
    handed = outs[1].value
    assert isinstance(handed, Prefilled) and handed.prefill.handle == "h-default/r1" and "prefill" in handed.timings
    assert outs[1].after_acks  # decode's chunks, which it starts, never land before chunk 0


@pytest.mark.asyncio
async def test_chunks_are_numbered_without_gaps_and_end_in_one_done() -> None:
    events = await prefill_then_decode(ScriptedBackend(WORDS))
    chunks, terminal = events[:-1], events[-1]
    assert [c.seq for c in chunks] == list(range(len(WORDS)))  # type: ignore[attr-defined]
    assert all(c.tenant == "default" and c.token_ids for c in chunks)  # type: ignore[attr-defined]
    assert isinstance(terminal, Done)
    assert terminal.chunks == len(WORDS) and terminal.finish_reason is FinishReason.stop
    assert terminal.digest == chain(WORDS)
    assert terminal.usage.completion_tokens == len(WORDS)
    assert set(terminal.timings) >= {"ingest", "prefill.local", "decode.local"}


@pytest.mark.asyncio
async def test_the_last_chunk_travels_with_the_done_and_the_others_alone() -> None:
    """The last chunk is marked to go in one record batch with the terminal event (pipeline/handling.py)."""
    backend = ScriptedBackend(WORDS)
    outs = await run_handler(decode_stage(backend), await prefilled(backend))
    assert [type(o.value) for o in outs] == [Chunk] * (len(WORDS) - 1) + [Done]
    assert [o.with_next for o in outs] == [False] * (len(WORDS) - 2) + [True, False]
    assert len({o.topic for o in outs}) == 1
    first_only = await run_handler(PrefillStage(backend, PREFILL.topics), routed(request(sampling=Sampling(max_tokens=1))))
    assert [(type(o.value), o.with_next) for o in first_only] == [(Chunk, True), (Done, False)]
    handed_on = await run_handler(PrefillStage(backend, PREFILL.topics), routed(request()))
    assert not any(o.with_next for o in handed_on)  # the first token of a longer answer goes at once


@pytest.mark.asyncio
async def test_max_tokens_ends_with_length() -> None:
    events = await prefill_then_decode(ScriptedBackend(WORDS), sampling=Sampling(max_tokens=3))
    assert isinstance(events[-1], Done)
    assert events[-1].finish_reason is FinishReason.length and events[-1].usage.completion_tokens == 3


@pytest.mark.asyncio
async def test_a_first_token_that_ends_the_request_skips_decode() -> None:
    outs = await run_handler(PrefillStage(ScriptedBackend(WORDS), PREFILL.topics), routed(request(sampling=Sampling(max_tokens=1))))
    assert [type(o.value) for o in outs] == [Chunk, Done]


async def decoding() -> tuple[ScriptedBackend, MemoryStateStore, Prefilled, AsyncIterator[Out]]:
    """A first decode worker's stream of WORDS, not yet read, with the store it records progress in."""
    backend, store = ScriptedBackend(WORDS), MemoryStateStore()
    handed = await prefilled(backend)
    return backend, store, handed, decode_stage(backend, store).handle(handed)


async def killed_then_resumed(
    backend: ScriptedBackend, store: MemoryStateStore, handed: Prefilled, stream: AsyncIterator[Out]
) -> list[object]:
    """The first worker is killed here; what a successor with the same store sends."""
    await stream.aclose()
    return [o.value for o in await run_handler(decode_stage(backend, store), handed)]


@pytest.mark.asyncio
async def test_a_takeover_resumes_after_the_last_acknowledged_chunk() -> None:
    """Worker A dies after three chunks were acknowledged; B continues from there: no chunk twice."""
    backend, store, handed, stream = await decoding()
    for _ in range(2):  # chunks 1 and 2, acknowledged
        out = await anext(stream)
        assert out.acked is not None
        await out.acked()
    rest = await killed_then_resumed(backend, store, handed, stream)
    assert [c.seq for c in rest[:-1]] == [3, 4]  # type: ignore[attr-defined]
    assert "".join(c.text for c in rest[:-1]) == " friend."  # type: ignore[attr-defined]
    assert isinstance(rest[-1], Done) and rest[-1].chunks == 5 and rest[-1].digest == chain(WORDS)
    assert rest[-1].usage.completion_tokens == len(WORDS)


@pytest.mark.asyncio
async def test_a_late_acknowledgement_never_takes_the_recorded_progress_back() -> None:
    """Chunk 2's acknowledgement is recorded before chunk 1's; the successor still resumes after chunk 2."""
    backend, store, handed, stream = await decoding()
    one, two = await anext(stream), await anext(stream)
    assert one.acked is not None and two.acked is not None
    await two.acked()
    await one.acked()  # late: it must not record the stream as one chunk shorter
    rest = await killed_then_resumed(backend, store, handed, stream)
    assert [c.seq for c in rest[:-1]] == [3, 4]  # type: ignore[attr-defined]
    assert isinstance(rest[-1], Done) and rest[-1].chunks == 5 and rest[-1].digest == chain(WORDS)


@pytest.mark.asyncio
async def test_a_replaced_worker_stops_and_leaves_the_message_to_be_retried() -> None:
    backend, store = ScriptedBackend(WORDS * 4, step_s=0.001), MemoryStateStore()
    handed = await prefilled(backend, sampling=Sampling(max_tokens=20))
    paused = decode_stage(backend, store)
    stream = paused.handle(handed)
    out = await anext(stream)
    await store.take(handed.id, "decode.local:successor")  # the successor took over
    assert out.acked is not None
    await out.acked()  # the paused worker learns it is fenced when it records progress
    with pytest.raises(InfraUnavailable):  # not committed as done: the partition's owner finishes it
        [o.value async for o in stream]


@pytest.mark.asyncio
async def test_a_replaced_worker_whose_backend_then_fails_sends_no_error_ending() -> None:
    class Breaks(ScriptedBackend):
        async def decode(self, request, prefilled):  # type: ignore[no-untyped-def,override]
            yield Delta(" there", (1,))
            raise ModelError("the upstream dropped the stream during the pause")

    backend, store = Breaks(WORDS), MemoryStateStore()
    handed = await prefilled(backend, sampling=Sampling(max_tokens=20))
    stream = decode_stage(backend, store).handle(handed)
    await anext(stream)  # its chunk is on its way; the worker is paused before its acknowledgement
    await store.take(handed.id, "decode.local:successor")  # the successor took over and serves the stream
    with pytest.raises(InfraUnavailable):  # not `Failed(backend_error)` beside the successor's answer
        [o.value async for o in stream]


@pytest.mark.asyncio
async def test_a_finished_request_is_not_generated_again() -> None:
    backend, store = ScriptedBackend(WORDS), MemoryStateStore()
    handed = await prefilled(backend)
    first = await run_handler(decode_stage(backend, store), handed)
    steps = dict(backend.steps)
    again = await run_handler(decode_stage(backend, store), handed)  # a redelivery: the same ending, nothing generated
    assert [o.value for o in again] == [first[-1].value] and backend.steps == steps


@pytest.mark.asyncio
async def test_a_cancellation_stops_decode_within_a_step() -> None:
    backend = ScriptedBackend(WORDS * 20, step_s=0.01)
    stage = decode_stage(backend)
    handed = await prefilled(backend, sampling=Sampling(max_tokens=100))
    events: list[object] = []

    async def consume() -> None:
        async for out in stage.handle(handed):
            events.append(out.value)

    task = asyncio.create_task(consume())
    while len(events) < 3:  # decode is under way
        await asyncio.sleep(0.001)
    await stage.on_control(Cancel(id="r1", reason=CancelReason.client_gone, at=time.time()))  # by the client's id
    steps_at_cancel = backend.steps["default/r1"]
    await task
    assert isinstance(events[-1], Failed) and events[-1].code is ErrorCode.cancelled
    assert events[-1].chunks == len(events) - 1 + 1  # the prefill chunk plus decode's
    assert backend.steps["default/r1"] == steps_at_cancel  # the step in flight was the last: exactly one
    assert len(events) - 1 <= steps_at_cancel  # and no chunk came of it
    assert sum(isinstance(e, Failed | Done) for e in events) == 1


@pytest.mark.asyncio
async def test_a_cancellation_stops_decode_even_when_the_store_cannot_record_it() -> None:
    class Away(MemoryStateStore):
        async def amend(self, *args: object, **kwargs: object) -> bool:
            raise InfraUnavailable("redis is restarting")

    backend = ScriptedBackend(WORDS * 20, step_s=0.01)
    stage = decode_stage(backend)
    handed = await prefilled(backend, sampling=Sampling(max_tokens=100))
    started = asyncio.Event()

    async def consume() -> list[object]:
        events = []
        async for out in stage.handle(handed):
            events.append(out.value)
            started.set()
        return events

    task = asyncio.create_task(consume())
    await started.wait()
    store, stage._store = stage._store, Away()  # the cancellation's record fails; the request must stop all the same
    with pytest.raises(InfraUnavailable):
        await stage.on_control(Cancel(id="default/r1", reason=CancelReason.output_guard, at=time.time()))
    assert "default/r1" in backend.cancelled
    stage._store = store
    events = await asyncio.wait_for(task, 2.0)
    assert isinstance(events[-1], Failed) and events[-1].code is ErrorCode.content_filter


@pytest.mark.asyncio
async def test_a_cancellation_that_arrives_before_decode_is_honoured() -> None:
    backend = ScriptedBackend(WORDS)
    stage = decode_stage(backend)
    handed = await prefilled(backend)
    await stage.on_control(Cancel(id="default/r1", reason=CancelReason.output_guard, at=time.time()))
    [out] = await run_handler(stage, handed)
    assert isinstance(out.value, Failed) and out.value.code is ErrorCode.content_filter
    assert "default/r1" not in backend.steps


@pytest.mark.asyncio
async def test_a_cancellation_stops_a_long_prefill_and_ends_the_request_there() -> None:
    backend = ScriptedBackend(WORDS, step_s=0.01, prefill_steps=1000)  # a long prompt: ten seconds of steps
    stage = PrefillStage(backend, PREFILL.topics, name=PREFILL.name)
    task = asyncio.create_task(run_handler(stage, routed(request())))
    while not backend.prefilled:
        await asyncio.sleep(0.001)
    await stage.on_control(Cancel(id="r1", reason=CancelReason.client_gone, at=time.time()))  # by the client's id
    [out] = await asyncio.wait_for(task, 1.0)  # within a step, not after the prefill
    assert out.topic == PREFILL.topics.stream and isinstance(out.value, Failed) and out.value.code is ErrorCode.cancelled
    assert backend.cancelled == {"default/r1"}


@pytest.mark.asyncio
async def test_a_request_cancelled_before_it_reaches_prefill_is_never_prefilled() -> None:
    backend = ScriptedBackend(WORDS)
    stage = PrefillStage(backend, PREFILL.topics, name=PREFILL.name)
    await stage.on_control(Cancel(id="default/r1", reason=CancelReason.deadline, at=time.time()))
    [out] = await run_handler(stage, routed(request()))
    assert isinstance(out.value, Failed) and out.value.code is ErrorCode.deadline_exceeded
    assert backend.prefilled == []
    [other] = [o for o in await run_handler(stage, routed(request("r2"))) if o.topic == PREFILL.topics.forward]  # others go on
    assert isinstance(other.value, Prefilled)


def test_an_unseeded_request_samples_reproducibly_by_its_id() -> None:
    first, again, other = (generation_request(request("a"), "t/a"), generation_request(request("a"), "t/a"),
                           generation_request(request("b"), "t/b"))
    assert first.seed is not None and first.seed == again.seed != other.seed
    assert generation_request(request("a", sampling=Sampling(seed=7)), "t/a").seed == 7


def test_priority_reaches_the_backend() -> None:
    assert generation_request(request("a", priority=Priority.batch), "t/a").priority == "batch"


@pytest.mark.asyncio
async def test_a_second_message_for_a_stream_this_worker_runs_is_left_to_the_running_one() -> None:
    backend, store = ScriptedBackend(WORDS, step_s=0.01), MemoryStateStore()
    handed = await prefilled(backend)  # prefill ran twice (its worker died before committing)
    stage = decode_stage(backend, store)
    running = asyncio.create_task(run_handler(stage, handed))
    await asyncio.sleep(0.015)
    assert await run_handler(stage, handed) == []
    outs = await running
    assert [getattr(o.value, "seq", "end") for o in outs] == [1, 2, 3, 4, "end"]


@pytest.mark.asyncio
async def test_a_stream_waits_for_the_broker_instead_of_running_far_ahead_of_it() -> None:
    from pipeline.stages.decode import AHEAD

    backend = ScriptedBackend([f"w{i} " for i in range(AHEAD * 3)])
    handed = await prefilled(backend, sampling=Sampling(max_tokens=AHEAD * 3))
    stream = decode_stage(backend).handle(handed)
    unacked = [await anext(stream) for _ in range(AHEAD)]  # the broker acknowledges nothing
    blocked = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.05)
    assert not blocked.done()  # held back: AHEAD chunks wait for the broker
    for out in unacked:
        assert out.acked is not None
        await out.acked()
    assert (await asyncio.wait_for(blocked, 1.0)).value.seq == AHEAD + 1
    await stream.aclose()


@pytest.mark.asyncio
async def test_a_refused_chunk_stops_a_stream_held_back_on_its_acks_at_once() -> None:
    """A chunk the broker failed to take is never acknowledged: a stream held back on it stops at once
    (the runner tries it again later), not after `AHEAD_WAIT_S`. Seen in the 60 s broker outage: streams
    resumed together 42.9 s after the broker was back."""
    from pipeline.stages.decode import AHEAD

    backend = ScriptedBackend([f"w{i} " for i in range(AHEAD * 3)])
    handed = await prefilled(backend, sampling=Sampling(max_tokens=AHEAD * 3))
    stream = decode_stage(backend).handle(handed)
    unacked = [await anext(stream) for _ in range(AHEAD)]
    blocked = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.05)
    assert not blocked.done()
    assert unacked[3].refused is not None
    unacked[3].refused()  # handling.py: its produce failed
    with pytest.raises(InfraUnavailable, match="did not take"):
        await asyncio.wait_for(blocked, 1.0)
    await stream.aclose()


@pytest.mark.asyncio
async def test_a_refusal_from_an_earlier_try_does_not_stop_the_next() -> None:
    """The retired producer of an earlier try may fail its batches long after the runner tried the
    message again: the new try's stream goes on."""
    backend = ScriptedBackend(WORDS)
    handed = await prefilled(backend)
    stage = decode_stage(backend)
    first = stage.handle(handed)
    old = await anext(first)
    await first.aclose()  # the try ended (an infrastructure error); the runner retries
    second = stage.handle(handed)
    outs = [await anext(second)]
    assert old.refused is not None
    old.refused()
    outs += [out async for out in second]
    assert [getattr(o.value, "seq", "end") for o in outs] == [1, 2, 3, 4, "end"]


@pytest.mark.asyncio
async def test_a_replaced_worker_whose_backend_fails_before_the_first_chunk_sends_the_request_nowhere() -> None:
    """Paused past its session before its first chunk and taken over, a worker whose upstream then times
    out (retriable, nothing sent) leaves the request to its successor: sent to the fallback pool, it was
    served by two pools at once (mixed text, then usually `stream_incomplete`)."""
    entered, resume = asyncio.Event(), asyncio.Event()

    class Stalls:
        name = "a"

        async def generate(self, request):  # type: ignore[no-untyped-def]
            entered.set()
            await resume.wait()  # the worker is paused here
            raise ModelError("upstream timed out (ReadTimeout)")
            yield  # pragma: no cover

        async def cancel(self, request_id: str) -> None:
            pass

    fallback = BackendSettings(name="b", model=MODEL, pool="pb", kind="openai", base_url="http://127.0.0.1:1/v1")
    store = MemoryStateStore()
    stage = GenerateStage(Stalls(), DECODE.topics, store, backends={"b": fallback})  # type: ignore[arg-type]
    first = msgspec.structs.replace(routed(request()), route=Route("a", "pa", fallbacks=("b",)))
    outs: list[Out] = []

    async def serve() -> None:
        async for out in stage.handle(first):
            outs.append(out)

    running = asyncio.create_task(serve())
    await entered.wait()
    await store.take(first.id, "generate.pa:successor")  # the successor took the stream over and serves it
    resume.set()
    with pytest.raises(InfraUnavailable):  # not committed: the partition's owner finishes it
        await running
    assert outs == []  # nothing sent to pool pb
    resume.clear()
    entered.clear()
    second = msgspec.structs.replace(routed(request("r2")), route=Route("a", "pa", fallbacks=("b",)))
    running = asyncio.create_task(run_handler(stage, second))
    await entered.wait()
    resume.set()
    [onward] = await running  # still owned: the request moves on to the fallback as before
    assert onward.topic == registry.routed_topic("pb") and onward.value.route == Route("b", "pb")


class Flaky(MemoryStateStore):
    """A store whose writes fail while `away` (Redis restarting)."""

    away = False

    async def advance(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.away:
            raise InfraUnavailable("redis is restarting")
        return await super().advance(*args, **kwargs)


@pytest.mark.asyncio
@pytest.mark.parametrize("late", ["taken over", "redis away"])
async def test_acknowledgements_that_land_after_the_try_ended_leave_nothing_behind(late: str) -> None:
    """The runner awaits a stream's last acknowledgements after `handle` returned (a revoke leaves them
    running): what they learn must neither stay in memory, one id per stream at every takeover or Redis
    outage, nor stop the request's next try on this worker."""
    backend, store = ScriptedBackend(WORDS), Flaky()
    handed = await prefilled(backend)
    stage = decode_stage(backend, store)
    outs = [out async for out in stage.handle(handed)]  # the try ends before the broker acknowledges
    if late == "taken over":
        await store.take(handed.id, "decode.local:successor")
    else:
        store.away = True
    for out in outs[:-1]:
        if out.acked is not None:
            with contextlib.suppress(InfraUnavailable):  # the runner's: the message is tried again
                await out.acked()
    assert not stage._fenced and not stage._unrecorded
    store.away = False
    again = await run_handler(stage, handed)  # the request comes back to this worker
    assert [getattr(o.value, "seq", "end") for o in again] == [1, 2, 3, 4, "end"]


@pytest.mark.asyncio
async def test_the_recorded_ending_leaves_the_cache_ticket_out_and_the_sent_one_keeps_it() -> None:
    """The ticket (a 768-byte embedding with a semantic tier) is emit's, on the ending it receives first;
    the recorded copy, kept for the state TTL, only replays the ending, which emit then drops."""
    ticket = Ticket("key", "context", 60.0, vector=bytes(768))
    backend, store = ScriptedBackend(WORDS), MemoryStateStore()
    outs = await run_handler(PrefillStage(backend, PREFILL.topics, name=PREFILL.name),
                             msgspec.structs.replace(routed(request()), cache=ticket))
    [handed] = [o.value for o in outs if o.topic == PREFILL.topics.forward]
    sent = (await run_handler(decode_stage(backend, store), handed))[-1].value
    assert isinstance(sent, Done) and sent.ticket == ticket
    recorded = codec.decode((await store.read(handed.id))["finished"], StreamEvent)
    assert recorded == msgspec.structs.replace(sent, ticket=None)
    [replayed] = await run_handler(decode_stage(backend, store), handed)
    assert replayed.value == recorded


@pytest.mark.asyncio
async def test_a_cancellation_is_recorded_only_for_a_request_the_pipeline_admitted() -> None:
    """Anyone who may write llm.control can name any id: a record per made-up id would fill Redis (each
    kept an hour) and push out live requests' state. Ingest's claim made the admitted one's key."""
    stage = decode_stage(ScriptedBackend(WORDS))
    store = stage._store
    await store.claim("default/admitted", "fingerprint", b"f")
    for rid in ("default/admitted", "default/made-up", "other/made-up-too"):
        await stage.on_control(Cancel(id=rid, reason=CancelReason.client_gone, at=time.time()))
    assert (await store.read("default/admitted"))["cancel"] == b"client_gone"
    assert await store.read("default/made-up") == {} and await store.read("other/made-up-too") == {}


@pytest.mark.asyncio
@pytest.mark.parametrize("window_s", [0.0, 0.005])
async def test_a_backend_that_sends_nothing_is_stopped_at_the_requests_deadline(window_s: float) -> None:
    """The deadline was checked only when a delta came: a backend stalled between deltas held the
    request past it (an upstream's keep-alives, 10 s past a 2 s deadline). With and without merging."""
    backend = ScriptedBackend(WORDS, step_s=3.0)
    handed = await prefilled(backend, deadline_s=1.0)
    started = time.monotonic()
    events = [o.value for o in await run_handler(decode_stage(backend, window_s=window_s), handed)]
    assert isinstance(events[-1], Failed) and events[-1].code is ErrorCode.deadline_exceeded
    assert time.monotonic() - started < 2.0 and events[-1].chunks == 1  # prefill's chunk only
