"""The asyncio API: prefill parks, decode resumes, export/import across engines, cancel frees."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import pytest

from pipeline.engine import async_engine
from pipeline.engine.async_engine import AsyncEngine
from pipeline.engine.errors import SequenceAborted, StepInterrupted, UnknownHandle
from pipeline.engine.params import EngineRequest, Priority
from pipeline.engine.scheduler import SchedulerOutput
from pipeline.engine.sequence import Sequence
from tests.unit.engine.conftest import Loaded, chat_ids, make_engine


@pytest.mark.asyncio
async def test_prefill_decode_handoff_between_engines(loaded: Loaded) -> None:
    prompt = chat_ids(loaded, "Count to five.")
    source, target = AsyncEngine(make_engine(loaded)), AsyncEngine(make_engine(loaded))
    whole = [t async for t in source.generate(EngineRequest(prompt, 8))]
    first, handle = await source.prefill(EngineRequest(prompt, 8))
    assert source.is_parked(handle) and first == whole[0]
    moved = await target.import_kv(await source.export_kv(handle))
    assert source.cancel(handle) and not source.is_parked(handle)
    rest = [t async for t in target.decode(moved)]
    assert [first, *rest] == whole
    for engine in (source, target):
        bm = engine.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and engine.num_active == 0
        await engine.aclose()


@pytest.mark.asyncio
async def test_exports_that_overlap_take_turns_with_the_staging_buffer(loaded: Loaded) -> None:
    """Two sequences' exports at once: the second waits until the first's buffers are written (they lie
    in the runner's one staging buffer), so each import continues its own sequence."""
    source, target = AsyncEngine(make_engine(loaded)), AsyncEngine(make_engine(loaded))
    prompts = [chat_ids(loaded, "Count to five."), chat_ids(loaded, "Name a colour, any colour at all.")]
    wholes = [[t async for t in source.generate(EngineRequest(p, 6))] for p in prompts]
    handles = [(await source.prefill(EngineRequest(p, 6)))[1] for p in prompts]
    order: list[str] = []

    async def write(handle: str) -> bytes:
        async with source.exported(handle) as parts:
            order.append(f"in {handle}")
            await asyncio.sleep(0.05)  # as a slow write to the store would
            data = b"".join(parts)
            order.append(f"out {handle}")
            return data

    exported = await asyncio.gather(*(write(h) for h in handles))
    assert order in ([f"in {handles[0]}", f"out {handles[0]}", f"in {handles[1]}", f"out {handles[1]}"],
                     [f"in {handles[1]}", f"out {handles[1]}", f"in {handles[0]}", f"out {handles[0]}"])
    for data, whole in zip(exported, wholes, strict=True):
        moved = await target.import_kv(data)
        assert [whole[0], *[t async for t in target.decode(moved)]] == whole
    for engine in (source, target):
        await engine.aclose()


@pytest.mark.asyncio
async def test_cancel_stops_a_running_stream_and_frees_its_blocks(loaded: Loaded) -> None:
    engine = AsyncEngine(make_engine(loaded))
    stream = engine.generate(EngineRequest(chat_ids(loaded, "Write a long story."), 100), handle="h1")
    seen = []
    with pytest.raises(SequenceAborted):
        async for token in stream:
            seen.append(token)
            if len(seen) == 2:
                assert engine.cancel("h1")
    assert len(seen) == 2
    with pytest.raises(UnknownHandle):
        [t async for t in engine.decode("h1")]
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine.num_active == 0
    await engine.aclose()


@pytest.mark.asyncio
async def test_a_cancel_during_a_step_stops_the_sequence_within_that_step(loaded: Loaded) -> None:
    """The exact bound: the step running when the cancel lands is the last one that computes the
    sequence, its token is never appended or delivered, and no later step feeds the sequence (while
    another sequence keeps the engine stepping)."""
    engine = AsyncEngine(make_engine(loaded))
    loop = asyncio.get_running_loop()
    cancel_in = 4  # step 1 is the prefill (one chunk); the cancel lands while step 4 computes
    fed: list[set[int]] = []
    seqs: dict[int, Sequence] = {}
    landed = threading.Event()
    execute = engine.engine.execute

    def spy(output: SchedulerOutput, interrupt: threading.Event | None = None) -> list[int | None]:
        fed.append({chunk.seq.seq_id for chunk in output.chunks})
        seqs.update((chunk.seq.seq_id, chunk.seq) for chunk in output.chunks)
        if len(fed) == cancel_in:
            loop.call_soon_threadsafe(lambda: (engine.cancel("target"), landed.set()))
            assert landed.wait(120)  # the cancel has run on the event loop while this step computes
        return execute(output, interrupt)

    engine.engine.execute = spy  # type: ignore[method-assign]

    async def drain(request: EngineRequest, handle: str) -> list[int]:
        return [t async for t in engine.generate(request, handle=handle)]

    other = asyncio.create_task(drain(EngineRequest(chat_ids(loaded, "Count to twenty."), 16), "other"))
    received: list[int] = []
    with pytest.raises(SequenceAborted):
        async for token in engine.generate(EngineRequest(chat_ids(loaded, "Write a long story."), 100), handle="target"):
            received.append(token)
    assert len(await other) == 16 and len(fed) > cancel_in + 2  # the engine stepped on after the cancel
    [target] = [s for s in seqs.values() if s.max_tokens == 100]
    assert target.seq_id in fed[cancel_in - 1]
    assert all(target.seq_id not in step for step in fed[cancel_in:])  # no step after the one in flight
    assert target.num_completion_tokens == cancel_in - 1  # that step's token was discarded
    assert received == target.completion_ids[: len(received)]  # nothing after the cancel was delivered
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine.num_active == 0
    await engine.aclose()


@pytest.mark.asyncio
async def test_next_step_wakes_once_per_step_while_that_step_computes(loaded: Loaded) -> None:
    """What sluice_llm's cancellation watcher relies on: each wake-up comes as a step starts, before it
    ends (the event loop is free while the model thread computes), one per step."""
    engine = AsyncEngine(make_engine(loaded))
    execute = engine.engine.execute
    steps = finished = 0

    def spy(output: SchedulerOutput, interrupt: threading.Event | None = None) -> list[int | None]:
        nonlocal steps, finished
        steps += 1
        time.sleep(0.05)
        try:
            return execute(output, interrupt)
        finally:
            finished += 1

    engine.engine.execute = spy  # type: ignore[method-assign]
    stream = asyncio.create_task(_drain(engine.generate(EngineRequest(chat_ids(loaded, "Count to ten."), 8), handle="h")))
    woken = []  # steps finished at each wake-up
    while not stream.done():
        waiter = asyncio.create_task(engine.next_step())
        done, _ = await asyncio.wait([waiter, stream], return_when=asyncio.FIRST_COMPLETED)
        if waiter in done:
            woken.append(finished)
        else:
            waiter.cancel()
    assert len(await stream) == 8 and steps >= 8
    assert woken == list(range(woken[0], woken[0] + len(woken)))  # one wake-up per step, none skipped
    assert woken[0] <= 1  # at most the first step began before the first waiter
    assert woken[-1] == steps - 1  # the last wake-up came before its step ended
    await engine.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("gather_ms", [0.0, 500.0])
async def test_a_burst_arriving_one_by_one_starts_in_one_step_when_gathered(
    loaded: Loaded, gather_ms: float, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`gather_arrivals_ms`: four requests handed over one by one, each in a later turn of the event loop
    (as Triton hands them to sluice_llm, ~1 ms apart) share the first step; without it the first runs
    alone and the rest wait behind its step. (Turns, not 1 ms sleeps, and a gap that ends a burst of
    0.2 s instead of 3 ms: on a host busy with other work this process can lose the CPU for more than
    3 ms between two turns, which ended the burst after the first request in one run.)"""
    monkeypatch.setattr(async_engine, "ARRIVAL_GAP_S", 0.2)
    engine = AsyncEngine(make_engine(loaded, max_num_batched_tokens=512, gather_arrivals_ms=gather_ms))  # type: ignore[arg-type]
    execute = engine.engine.execute
    fed: list[int] = []

    def spy(output: SchedulerOutput, interrupt: threading.Event | None = None) -> list[int | None]:
        fed.append(len(output.chunks))
        return execute(output, interrupt)

    engine.engine.execute = spy  # type: ignore[method-assign]
    streams = []
    for i in range(4):
        streams.append(asyncio.create_task(_drain(engine.generate(EngineRequest(chat_ids(loaded, f"Say {i}."), 2), handle=f"h{i}"))))
        await asyncio.sleep(0)
    assert [len(tokens) for tokens in await asyncio.gather(*streams)] == [2, 2, 2, 2]
    assert fed[0] == (4 if gather_ms else 1)
    await engine.aclose()


async def _drain(stream: AsyncIterator[int]) -> list[int]:
    return [token async for token in stream]


@pytest.mark.asyncio
async def test_the_batch_lane_waits_for_a_prefilled_interactive_sequence_s_decode(loaded: Loaded) -> None:
    """Between an interactive prefill and its decode (the prefilled message's hop), no batch-only step
    starts, up to `handoff_hold_ms`: the decode's first step does not wait behind one."""
    engine = AsyncEngine(make_engine(loaded, handoff_hold_ms=2000))
    fed: list[set[Priority]] = []
    execute = engine.engine.execute

    def spy(output: SchedulerOutput, interrupt: threading.Event | None = None) -> list[int | None]:
        fed.append({chunk.seq.priority for chunk in output.chunks})
        return execute(output, interrupt)

    engine.engine.execute = spy  # type: ignore[method-assign]
    backfill = asyncio.create_task(
        anext(engine.generate(EngineRequest(chat_ids(loaded, "Write a long story."), 100, priority=Priority.BATCH))))
    await backfill  # the batch lane is running
    first, handle = await engine.prefill(EngineRequest(chat_ids(loaded, "Count to five."), 8))
    steps_at_prefill = len(fed)
    await asyncio.sleep(0.3)  # the hop to the decode stage, exaggerated
    assert len(fed) == steps_at_prefill  # no batch step started meanwhile
    rest = [t async for t in engine.decode(handle)]
    assert len(rest) == 7 and Priority.INTERACTIVE in fed[steps_at_prefill]
    await asyncio.sleep(0.3)
    assert len(fed) > steps_at_prefill + 7  # batch steps resumed once the decode began
    await engine.aclose()


@pytest.mark.asyncio
async def test_the_hold_ends_when_its_time_is_up(loaded: Loaded) -> None:
    engine = AsyncEngine(make_engine(loaded, handoff_hold_ms=100))
    stream = engine.generate(EngineRequest(chat_ids(loaded, "Write a long story."), 100, priority=Priority.BATCH))
    await anext(stream)
    _, handle = await engine.prefill(EngineRequest(chat_ids(loaded, "Count to five."), 8))  # never decoded here
    steps = engine.engine.scheduler.step_count
    await asyncio.sleep(1.0)
    assert engine.engine.scheduler.step_count > steps + 1  # the batch lane ran again after 100 ms
    assert engine.is_parked(handle)
    await stream.aclose()
    await engine.aclose()


@pytest.mark.asyncio
async def test_overlapping_holds_never_starve_the_batch_lane(loaded: Loaded) -> None:
    """Prefills that keep coming while their decodes lag re-arm the hold again and again; the batch
    lane still gets a step after each `handoff_hold_ms` held in a row."""
    engine = AsyncEngine(make_engine(loaded, handoff_hold_ms=300))
    fed: list[tuple[float, set[Priority]]] = []
    execute = engine.engine.execute

    def spy(output: SchedulerOutput, interrupt: threading.Event | None = None) -> list[int | None]:
        fed.append((time.monotonic(), {chunk.seq.priority for chunk in output.chunks}))
        return execute(output, interrupt)

    engine.engine.execute = spy  # type: ignore[method-assign]
    stream = engine.generate(EngineRequest(chat_ids(loaded, "Write a long story."), 200, priority=Priority.BATCH))
    await anext(stream)
    start = time.monotonic()

    def batch_only() -> list[float]:
        return [at for at, lanes in fed if at > start and lanes == {Priority.BATCH}]

    # Prefills back to back, none decoded: each re-arms the hold. About one batch-only step per 300 ms
    # held in a row, none without the cap; counted in steps, not in a fixed time, because a step takes
    # seconds instead of ~70 ms while another process keeps a core busy (OpenMP threads spin).
    while len(batch_only()) < 3 and time.monotonic() - start < 30:
        await engine.prefill(EngineRequest(chat_ids(loaded, "Count to three."), 8))
        await asyncio.sleep(0.01)
    assert len(batch_only()) >= 3
    await stream.aclose()
    await engine.aclose()


@pytest.mark.asyncio
async def test_an_interactive_arrival_stops_a_batch_only_step_and_changes_no_output(loaded: Loaded) -> None:
    """A batch-only step computing when an interactive request arrives stops at its next layer; the
    next step is the interactive request's, and both answers are what they are without the stop."""
    story, count = chat_ids(loaded, "Write a long story."), chat_ids(loaded, "Count to five.")
    reference = AsyncEngine(make_engine(loaded))
    expected_batch = [t async for t in reference.generate(EngineRequest(story, 12, priority=Priority.BATCH))]
    expected_interactive = [t async for t in reference.generate(EngineRequest(count, 6))]
    await reference.aclose()

    engine = AsyncEngine(make_engine(loaded))
    loop = asyncio.get_running_loop()
    fed: list[set[Priority]] = []
    stopped: list[bool] = []
    arrival: list[asyncio.Task[list[int]]] = []
    execute = engine.engine.execute

    async def drain(request: EngineRequest) -> list[int]:
        return [t async for t in engine.generate(request)]

    def spy(output: SchedulerOutput, interrupt: threading.Event | None = None) -> list[int | None]:
        fed.append({chunk.seq.priority for chunk in output.chunks})
        if len(fed) == 4:  # a batch-only decode step: the interactive request arrives while it computes
            loop.call_soon_threadsafe(lambda: arrival.append(asyncio.ensure_future(drain(EngineRequest(count, 6)))))
            deadline = time.monotonic() + 120
            while engine.num_active < 2 and time.monotonic() < deadline:  # it is queued on the event loop
                time.sleep(0.001)
        try:
            return execute(output, interrupt)
        except StepInterrupted:
            stopped.append(True)
            raise

    engine.engine.execute = spy  # type: ignore[method-assign]
    batch = [t async for t in engine.generate(EngineRequest(story, 12, priority=Priority.BATCH))]
    interactive = await arrival[0]
    assert fed[3] == {Priority.BATCH} and stopped == [True] and engine.engine.interrupted_steps == 1
    assert fed[4] == {Priority.INTERACTIVE}  # the arrival's prefill went first; the batch lane yielded
    assert batch == expected_batch and interactive == expected_interactive
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine.num_active == 0
    await engine.aclose()


@pytest.mark.asyncio
async def test_a_step_with_interactive_rows_is_never_stopped(loaded: Loaded) -> None:
    engine = AsyncEngine(make_engine(loaded))
    interrupts: list[threading.Event | None] = []
    execute = engine.engine.execute

    def spy(output: SchedulerOutput, interrupt: threading.Event | None = None) -> list[int | None]:
        interrupts.append(interrupt)
        return execute(output, interrupt)

    engine.engine.execute = spy  # type: ignore[method-assign]
    tokens = [t async for t in engine.generate(EngineRequest(chat_ids(loaded, "Count to five."), 4))]
    assert len(tokens) == 4 and interrupts == [None] * 4  # an interactive-only engine passes no interrupt
    await engine.aclose()


@pytest.mark.asyncio
async def test_parked_sequences_dropped_over_the_bound_are_forgotten(loaded: Loaded) -> None:
    """A prefill-only worker parks every prompt for a decode elsewhere: the engine drops the oldest over
    `max_parked`, and their handles (each holding its sequence) must go with them, not pile up forever."""
    engine = AsyncEngine(make_engine(loaded, max_parked=2))
    handles = [(await engine.prefill(EngineRequest(chat_ids(loaded, f"Say {n}."), 8)))[1] for n in range(6)]
    await engine.prefill(EngineRequest(chat_ids(loaded, "One more."), 8))  # a step after the last trim reports it
    assert engine.num_parked == 2
    assert sum(engine.knows(h) for h in handles) <= 2 and len(engine._handles) <= 3
    await engine.aclose()


@pytest.mark.asyncio
async def test_an_imported_state_of_another_shape_or_past_the_pool_is_refused(loaded: Loaded) -> None:
    """A K/V of as many numbers in another shape was written through a view of the pool, into other
    sequences' blocks; one whose sequence could never fit this pool waited for good."""
    import dataclasses

    from pipeline.engine.errors import KVMismatch, RequestTooLarge
    from pipeline.engine.kv_transfer import KVState

    prompt = chat_ids(loaded, "Count to five.")
    source, small = AsyncEngine(make_engine(loaded)), AsyncEngine(make_engine(loaded, num_blocks=8))
    _, handle = await source.prefill(EngineRequest(prompt, 8))
    state = KVState.from_buffer(await source.export_kv(handle))
    layers, n, heads, dim = state.k.shape
    odd = dataclasses.replace(state, k=state.k.reshape(layers * 2, n, heads // 2, dim) if heads % 2 == 0
                              else state.k.reshape(layers, n, heads * dim // 2, 2))
    with pytest.raises(KVMismatch):
        source.engine.reserve_import(odd, odd.request)
    long = dataclasses.replace(state.request, max_tokens=10_000)
    with pytest.raises(RequestTooLarge):
        small.engine.reserve_import(state, long)
    for engine in (source, small):
        await engine.aclose()
